"""Input checks for the head's API: every field a client sends is typed and bounded here,
so the coordinator only ever sees well-formed values. A check that fails raises BadInput
(the server answers 400 naming the field)."""

from __future__ import annotations

import math
import re
from typing import Any

from spotctl.head.auth import valid_node_id
from spotctl.spec import MAX_GPUS

MAX_STR = 256
MAX_STEP = 1 << 53  # steps, checkpoints: JSON-exact integers (the head bounds their rate)
MAX_WORKERS = 64  # per node (GPUs per VM are far fewer)
MAX_STARTUP_KEYS = 32
# crashed: its workers failed the same way CRASH_LIMIT times in a row (spotctl.agent.crashloop)
AGENT_STATES = ("waiting", "running", "leaving", "left", "finished", "failed", "crashed")
MAX_ERROR = 400  # the last error line a node reports (crashloop.LINE_MAX)
PHASES = ("init", "train", "draining", "drained", "drain-failed", "done")
# Event types a client may post, with their fields (type checked). Anything else: 400.
EVENT_FIELDS: dict[str, dict[str, type]] = {
    "rebalance-recommendation": {"node": str},
    "gpu-gate-failed": {"node": str, "reason": str},
    "note": {"message": str, "node": str},
}
# the types a node may post (about itself)
NODE_EVENTS = ("rebalance-recommendation", "gpu-gate-failed")


class BadInput(ValueError):
    pass


def _str(v: Any, what: str, max_len: int = MAX_STR) -> str:
    if not isinstance(v, str) or len(v) > max_len or any(ord(c) < 32 for c in v):
        raise BadInput(f"{what} must be a printable string of at most {max_len} characters")
    return v


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadInput(f"{what} must be an integer in [{lo}, {hi}]")
    return v


def _num(v: Any, what: str, optional: bool = True) -> float | None:
    """A finite number (None allowed when optional)."""
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadInput(f"{what} must be a finite number")
    return float(v)


def _metric(v: Any, what: str) -> float | None:
    """Loss/throughput reported by a training script: NaN/inf is a fact (kept as None)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return _num(v, what)


def node_id(v: Any, what: str = "node_id") -> str:
    if not valid_node_id(v):
        raise BadInput(f"{what} must be a node id ([A-Za-z0-9._-], at most 128)")
    return str(v)


def notice(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise BadInput("notice must be an object")
    out: dict[str, Any] = {}
    for k in ("id", "source", "kind", "action"):
        if k in v and v[k] is not None:
            out[k] = _str(v[k], f"notice.{k}")
    out["deadline"] = _num(v.get("deadline"), "notice.deadline")
    if "received_at" in v:
        out["received_at"] = _num(v["received_at"], "notice.received_at")
    return out


def worker(v: Any, i: int, max_world: int = MAX_GPUS) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise BadInput(f"workers[{i}] must be an object")
    w = f"workers[{i}]"
    phase = v.get("phase")
    if phase not in PHASES:
        raise BadInput(f"{w}.phase must be one of {', '.join(PHASES)}")
    world = _int(v.get("world_size"), f"{w}.world_size", 1, max_world)
    out: dict[str, Any] = {
        "rank": _int(v.get("rank"), f"{w}.rank", 0, world - 1),
        "local_rank": _int(v.get("local_rank", 0), f"{w}.local_rank", 0, MAX_WORKERS - 1),
        "world_size": world,
        "step": _int(v.get("step", 0), f"{w}.step", 0, MAX_STEP),
        "phase": phase,
        "incarnation": _str(v.get("incarnation") or "", f"{w}.incarnation", 128),
        "resume_step": _int(v.get("resume_step") or 0, f"{w}.resume_step", 0, MAX_STEP),
        "first_step_at": _num(v.get("first_step_at"), f"{w}.first_step_at"),
        "last_ckpt": _int(v.get("last_ckpt") or 0, f"{w}.last_ckpt", 0, MAX_STEP),
        "loss": _metric(v.get("loss"), f"{w}.loss"),
        "throughput": _metric(v.get("throughput"), f"{w}.throughput"),
        "drain_step": None if v.get("drain_step") is None
        else _int(v["drain_step"], f"{w}.drain_step", 0, MAX_STEP),
        "pid": _int(v.get("pid") or 0, f"{w}.pid", 0, 1 << 31),
    }
    if v.get("engine") is not None:
        if v["engine"] not in ("torchrun", "torchft"):
            raise BadInput(f"{w}.engine must be torchrun or torchft")
        out["engine"] = v["engine"]
    # which kind of script formed the group: "plain" (its own init_process_group,
    # spotctl.elastic.plain) or "elastic" (spotctl.elastic); absent: not said
    if v.get("route") is not None:
        if v["route"] not in ("plain", "elastic"):
            raise BadInput(f"{w}.route must be plain or elastic")
        out["route"] = v["route"]
    # torchft: the replicas in the step's quorum, and the steps this process ran whose work
    # was thrown away (the coordinator's lost steps come from these counts)
    if v.get("replicas") is not None:
        out["replicas"] = _int(v["replicas"], f"{w}.replicas", 0, max_world)
    if v.get("regroup_pause_s") is not None:
        pause = _num(v["regroup_pause_s"], f"{w}.regroup_pause_s")
        if pause is None or not 0 <= pause <= 1e6:
            raise BadInput(f"{w}.regroup_pause_s must be seconds in [0, 1e6]")
        out["regroup_pause_s"] = pause
    if v.get("failed_steps") is not None:
        out["failed_steps"] = _int(v["failed_steps"], f"{w}.failed_steps", 0, MAX_STEP)
    # diloco/localsgd: syncs nobody applied, and the local steps they dropped (the head
    # journals each new one as a `sync_failed` event), and the local steps a group dropped
    # when it left on a notice mid-round (a `notice_drop` event)
    for k in ("failed_syncs", "dropped_steps", "notice_dropped"):
        if v.get(k) is not None:
            out[k] = _int(v[k], f"{w}.{k}", 0, MAX_STEP)
    st = v.get("startup")
    if st is not None:
        if not isinstance(st, dict) or len(st) > MAX_STARTUP_KEYS:
            raise BadInput(f"{w}.startup must be an object of at most {MAX_STARTUP_KEYS} numbers")
        # timings reported by the training library: numbers, flags or short labels are
        # kept, anything else is dropped (it is informational only)
        out["startup"] = {
            _str(k, f"{w}.startup key", 64): x for k, x in st.items()
            if x is None or isinstance(x, bool) or (isinstance(x, str) and len(x) <= 64)
            or (isinstance(x, (int, float)) and math.isfinite(x))
        }
        # the one timing the head computes with (when the workers were spawned)
        _num(st.get("started_at"), f"{w}.startup.started_at", optional=False)
    return out


def fields(v: dict[str, Any], allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    """A request body holds only the route's fields, and all of its required ones."""
    extra = [k for k in v if k not in allowed]
    if extra:
        raise BadInput(f"unexpected field {str(extra[0])[:40]!r} (allowed: {', '.join(allowed)})")
    missing = [k for k in required if k not in v]
    if missing:
        raise BadInput(f"{missing[0]} missing")


HEARTBEAT_FIELDS = ("node_id", "agent_state", "addr", "workers", "drain_gen", "notice", "ready",
                    "net", "group", "error", "replica_index")
GROUP_FIELDS = ("size", "port", "id", "gen", "slot", "broken")
MAX_GROUP_NODES = 64  # [train] nodes_per_replica at most
MAX_NET_DEVICES = 64  # interfaces, and RDMA devices (a p5 has 32 EFA devices)
NET_FLAGS = ("libfabric", "ofi_nccl", "tcpx")
NET_DEVICE_FIELDS = ("name", "kind", "driver")


def _net_devices(v: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(v, list) or len(v) > MAX_NET_DEVICES:
        raise BadInput(f"{what} must be a list of at most {MAX_NET_DEVICES}")
    out = []
    for i, d in enumerate(v):
        if not isinstance(d, dict) or set(d) - set(NET_DEVICE_FIELDS) or "name" not in d:
            raise BadInput(f"{what}[{i}] must be an object of {', '.join(NET_DEVICE_FIELDS)}")
        out.append({k: _str(d.get(k, ""), f"{what}[{i}].{k}", 32) for k in NET_DEVICE_FIELDS})
    return out


def net(v: Any) -> dict[str, Any]:
    """What a node's agent found on its network (spotctl.agent.netprobe) and the transport
    NCCL named; informational, bounded like the rest (a few KiB at most)."""
    if not isinstance(v, dict):
        raise BadInput("net must be an object")
    allowed = ("interfaces", "rdma", "efa", *NET_FLAGS, "nccl_transport")
    fields(v, allowed)
    out: dict[str, Any] = {
        "interfaces": _net_devices(v.get("interfaces", []), "net.interfaces"),
        "rdma": _net_devices(v.get("rdma", []), "net.rdma"),
        "efa": _int(v.get("efa", 0), "net.efa", 0, MAX_NET_DEVICES),
    }
    for k in NET_FLAGS:
        if not isinstance(v.get(k, False), bool):
            raise BadInput(f"net.{k} must be true or false")
        out[k] = v.get(k, False)
    t = v.get("nccl_transport")
    out["nccl_transport"] = None if t is None else _str(t, "net.nccl_transport", 64)
    return out


def heartbeat(v: dict[str, Any], max_world: int = MAX_GPUS) -> dict[str, Any]:
    """A node's report; no worker's world size over `max_world` (the spec's maximum GPUs
    when the head was told it, else the largest any spec may ask for)."""
    fields(v, HEARTBEAT_FIELDS, ("node_id",))
    out: dict[str, Any] = {"node_id": node_id(v.get("node_id"))}
    state = v.get("agent_state", "waiting")
    if state not in AGENT_STATES:
        raise BadInput(f"agent_state must be one of {', '.join(AGENT_STATES)}")
    out["agent_state"] = state
    if "addr" in v:
        out["addr"] = _str(v["addr"], "addr", 128)
    ws = v.get("workers", [])
    if not isinstance(ws, list) or len(ws) > MAX_WORKERS:
        raise BadInput(f"workers must be a list of at most {MAX_WORKERS}")
    out["workers"] = [worker(w, i, max_world) for i, w in enumerate(ws)]
    if "drain_gen" in v:
        out["drain_gen"] = _int(v["drain_gen"], "drain_gen", 0, 1 << 40)
    if v.get("notice") is not None:
        out["notice"] = notice(v["notice"])
    if not isinstance(v.get("ready", True), bool):
        raise BadInput("ready must be true or false")
    out["ready"] = v.get("ready", True)
    if v.get("net") is not None:
        out["net"] = net(v["net"])
    if v.get("group") is not None:
        out["group"] = group(v["group"])
    if v.get("replica_index") is not None:  # torchft: the index its workers run with
        out["replica_index"] = _int(v["replica_index"], "replica_index", 0, MAX_GPUS)
    if v.get("error") is not None:  # the last error line of its workers (a crash loop)
        out["error"] = _str(v["error"], "error", MAX_ERROR)
    return out


def group(v: Any) -> dict[str, Any]:
    """A torchft node's replica group: its size and the port its group store would listen
    on, and the group (id, generation, slot) its torchrun runs in, if any, or last ran in
    and failed in (`broken`)."""
    if not isinstance(v, dict):
        raise BadInput("group must be an object")
    fields(v, GROUP_FIELDS, ("size", "port"))
    out: dict[str, Any] = {"size": _int(v["size"], "group.size", 1, MAX_GROUP_NODES),
                           "port": _int(v["port"], "group.port", 1, 65535)}
    if v.get("id") is not None:
        gid = _str(v["id"], "group.id", 16)
        if not re.fullmatch(r"g[0-9]{1,6}", gid):  # [0-9]: ASCII digits only
            raise BadInput("group.id must be g followed by digits")
        out["id"] = gid
        out["gen"] = _int(v.get("gen"), "group.gen", 0, 1 << 40)
        out["slot"] = _int(v.get("slot"), "group.slot", 0, out["size"] - 1)
        if not isinstance(v.get("broken", False), bool):
            raise BadInput("group.broken must be true or false")
        out["broken"] = v.get("broken", False)
    elif "broken" in v:
        raise BadInput("group.broken needs the group's id, gen and slot")
    return out


def node_list(v: Any, what: str, max_len: int = 1024) -> list[str]:
    if not isinstance(v, list) or len(v) > max_len:
        raise BadInput(f"{what} must be a list of node ids")
    return [node_id(x, f"{what}[{i}]") for i, x in enumerate(v)]


def drain(v: dict[str, Any]) -> tuple[str, list[str]]:
    fields(v, ("reason", "leavers"), ("reason", "leavers"))
    reason = v.get("reason")
    if reason not in ("rebalance",):
        raise BadInput("reason must be 'rebalance'")
    return reason, node_list(v["leavers"], "leavers")


def event(v: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    type_ = v.get("type")
    if not isinstance(type_, str) or type_ not in EVENT_FIELDS:
        raise BadInput(f"event type must be one of {', '.join(EVENT_FIELDS)}")
    allowed = EVENT_FIELDS[type_]
    data: dict[str, Any] = {}
    for k, x in v.items():
        if k == "type":
            continue
        if k not in allowed:
            raise BadInput(f"event field {k!r} is not allowed for {type_}")
        data[k] = node_id(x, k) if k == "node" else _str(x, k, 1024)
    return type_, data
