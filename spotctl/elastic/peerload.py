"""What a heal loads from a peer: torchft's state metadata, never code.

On the torchft engine a joiner (or a replica that fell behind) receives the state of a
peer over torchft's PGTransport: the tensors as raw bytes, and beside them one pickle of
the metadata (the state's tree, each tensor's shape and dtype, the non-tensor values).
torchft 0.2.0 loads that pickle with `pickle.loads`, so whoever gets into the quorum at
the highest step (a fake replica announced to the Lighthouse by any cluster member) ran
code in every replica that healed from it.

`install()` makes torchft's transport load that pickle with `loads` below instead, which
resolves only what such metadata is made of and refuses everything else, before anything
of it runs:

- containers and scalars (`dict`, `list`, `tuple`, `set`, `OrderedDict`, ...);
- torchft's metadata classes, torch's `Size`, `device` and dtypes, the pytree spec and
  key classes, and the DTensor spec, placements and device mesh (FSDP2 / DTensor state);
- a tensor inside that metadata (a device mesh's rank map): rebuilt from bytes loaded with
  torch's weights-only loader, not with `torch.load(weights_only=False)` as torch's own
  `_load_from_bytes` does;
- numpy's array and dtype (numpy's RNG state), when numpy is already imported;
- the container types registered with torch's pytree, and the classes named in
  `SPOTCTL_FT_HEAL_ALLOW` (`module:QualName`, comma-separated: a class of your own in
  the state you pass to spotctl.elastic; a name that is not a class stays refused), each
  only when its module is already imported: this loader never imports a module.

A refused heal fails that replica's step (torchft reports the error and the quorum goes on);
the log line names the global the peer sent.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import warnings
from typing import Any

_EXACT = {
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex",
                 "str", "bytes", "bytearray", "bool", "slice", "range", "object"},
    "collections": {"OrderedDict", "defaultdict", "deque"},
    "copyreg": {"_reconstructor"},  # protocol 0/1: its class and base come through here
    "torch": {"Size", "device", "layout", "memory_format"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor"},
    "torch.utils._pytree": {"TreeSpec", "LeafSpec", "MappingKey", "SequenceKey",
                            "GetAttrKey"},
    "torchft.checkpointing.pg_transport": {"_StateDictMeta", "_TensorMeta", "_DTensorMeta"},
    "torch.distributed.tensor._dtensor_spec": {"DTensorSpec", "TensorMeta",
                                               "ShardOrderEntry"},
    "torch.distributed.tensor.placement_types": {"Shard", "Replicate", "Partial",
                                                 "_StridedShard", "MaskPartial"},
    "torch.distributed._mesh_layout": {"_MeshLayout", "_FlatLayout"},
    "torch.distributed.device_mesh": {"DeviceMesh"},
    "numpy": {"dtype", "ndarray"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
}
_SAFE_STORAGE = ("torch.storage", "_load_from_bytes")
ALLOW_ENV = "SPOTCTL_FT_HEAL_ALLOW"


class RefusedGlobal(pickle.UnpicklingError):
    """A peer's heal metadata named a global this loader does not resolve."""


def _load_storage_from_bytes(b: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(b), weights_only=True)


def _user_allowed() -> set[tuple[str, str]]:
    out = set()
    for item in os.environ.get(ALLOW_ENV, "").split(","):
        mod, sep, name = item.strip().partition(":")
        if sep and mod and name:
            out.add((mod, name))
    return out


def _resolve(module: str, name: str) -> Any:
    """`module.name` when `module` is already imported, else None (never imports)."""
    mod = sys.modules.get(module)
    if mod is None:
        return None
    obj: Any = mod
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _by_name(types: Any) -> dict[tuple[str, str], Any]:
    return {(t.__module__, t.__qualname__): t for t in types if isinstance(t, type)}


class _PeerUnpickler(pickle.Unpickler):
    """Resolves a global only from the names above, the pytree's registered types and the
    user's list: never an attribute lookup by a name the peer chose (a module's
    `__getattr__` can import), never an import."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _SAFE_STORAGE:
            return _load_storage_from_bytes
        obj: Any = None
        if name in _EXACT.get(module, ()):
            obj = _resolve(module, name)
        elif module == "torch":
            import torch

            obj = {str(d).rpartition(".")[2]: d for d in vars(torch).values()
                   if isinstance(d, torch.dtype)}.get(name)
        else:
            from torch.utils._pytree import SUPPORTED_NODES

            obj = _by_name(SUPPORTED_NODES).get((module, name))
            if obj is None and (module, name) in _user_allowed():
                cand = _resolve(module, name)
                obj = cand if isinstance(cand, type) else None  # classes only
        if obj is None:
            raise RefusedGlobal(
                f"a peer's heal named {module}.{name}, which spotctl does not load from "
                f"another node (if it is a class in your own training state, name it in "
                f"{ALLOW_ENV} as {module}:{name})")
        return obj


def loads(data: bytes) -> Any:
    """Load heal metadata a peer sent, resolving only what such metadata is made of."""
    with warnings.catch_warnings():
        # torch's pytree marks LeafSpec deprecated (a FutureWarning whenever one is made):
        # a peer's metadata holds those torch itself pickled, and this is no use of them
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        return _PeerUnpickler(io.BytesIO(data)).load()


class _PickleForTransport:
    """Stands in for the `pickle` module inside torchft's PGTransport: the same dumps,
    this module's loads."""

    dumps = staticmethod(pickle.dumps)
    loads = staticmethod(loads)
    UnpicklingError = pickle.UnpicklingError


def install() -> None:
    """Make torchft's PGTransport load what peers send with `loads`."""
    from torchft.checkpointing import pg_transport

    pg_transport.pickle = _PickleForTransport  # type: ignore[attr-defined,assignment]
