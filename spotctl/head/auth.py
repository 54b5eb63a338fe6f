"""Who may call the head: the controller (the cluster secret) or one node (its own token).

The cluster secret lives in the controller's cluster directory (0600) and on the head VM;
it is never given to a node. Each node gets `node_token(secret, node_id)`, a credential
bound to its id: `node:<id>:<hmac-sha256(secret, id)>`. The head recomputes the MAC, so
it needs no list of issued tokens, and a node holding its token can speak only for itself.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PREFIX = "node:"


def valid_node_id(node_id: object) -> bool:
    return isinstance(node_id, str) and bool(NODE_ID_RE.fullmatch(node_id))


def _mac(secret: str, node_id: str) -> str:
    return hmac.new(secret.encode(), b"spotctl-node\0" + node_id.encode(), hashlib.sha256).hexdigest()


def node_token(secret: str, node_id: str) -> str:
    """The credential node `node_id` holds (and nothing else it can derive others from)."""
    if not valid_node_id(node_id):
        raise ValueError(f"node id {node_id!r} is not a valid node id")
    return f"{_PREFIX}{node_id}:{_mac(secret, node_id)}"


@dataclass(frozen=True)
class Principal:
    controller: bool
    node_id: str = ""

    def may_speak_for(self, node_id: object) -> bool:
        return self.controller or (isinstance(node_id, str) and node_id == self.node_id)


CONTROLLER = Principal(controller=True)


def identify(secret: str, authorization: str) -> Principal | None:
    """The caller behind an `Authorization: Bearer ...` header, or None. Constant-time."""
    if not authorization.startswith("Bearer "):
        return None
    given = authorization[len("Bearer "):]
    if given.startswith(_PREFIX):
        body = given[len(_PREFIX):]
        node_id, sep, mac = body.rpartition(":")
        if not sep or not valid_node_id(node_id):
            return None
        if hmac.compare_digest(mac.encode(), _mac(secret, node_id).encode()):
            return Principal(controller=False, node_id=node_id)
        return None
    if hmac.compare_digest(given.encode(), secret.encode()):
        return CONTROLLER
    return None
