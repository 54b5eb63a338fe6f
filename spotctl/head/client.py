"""A small client of the head's coordinator API (urllib: no extra dependency on nodes)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from spotctl.errors import SpotctlError

# Cluster traffic never goes through a proxy (http_proxy & co. are ignored): the token
# would travel to whoever runs the proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def urlopen_direct(req: urllib.request.Request | str, timeout: float) -> Any:
    """urllib's urlopen without any proxy from the environment."""
    return _DIRECT.open(req, timeout=timeout)


class HeadUnavailable(SpotctlError):
    exit_code = 9


class HeadClient:
    def __init__(self, url: str, token: str, timeout_s: float = 3.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urlopen_direct(req, timeout=self.timeout_s) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            why = ""
            try:
                why = str(json.loads(e.read(4096) or b"{}").get("error", ""))[:200]
            except (ValueError, OSError, AttributeError):
                pass
            raise HeadUnavailable(
                f"head at {self.url} answered {e.code} to {path}" + (f": {why}" if why else "")
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise HeadUnavailable(f"head at {self.url} is not reachable: {e}") from None

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/api/heartbeat", body)

    def notice(self, node_id: str, notice: dict[str, Any]) -> None:
        self._call("POST", "/api/notice", {"node_id": node_id, "notice": notice})

    def _obj(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """An answer that must be a JSON object (the head's answers are input too)."""
        out = self._call(method, path, body)
        if not isinstance(out, dict):
            raise HeadUnavailable(f"head at {self.url} gave a malformed answer to {path}")
        return out

    def status(self) -> dict[str, Any]:
        return self._obj("GET", "/api/status")

    def samples(self) -> list[dict[str, Any]]:
        """The head's samples of world size, step and throughput (spotctl.head.samples)."""
        got = self._obj("GET", "/api/samples").get("samples")
        if not isinstance(got, list):
            raise HeadUnavailable(f"head at {self.url} gave a malformed sample list")
        return [s for s in got if isinstance(s, dict)]

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        evs = self._obj("GET", f"/api/events?since={since}").get("events")
        if not isinstance(evs, list):
            raise HeadUnavailable(f"head at {self.url} gave a malformed event list")
        return evs

    def drain(self, reason: str, leavers: list[str]) -> int:
        gen = self._obj("POST", "/api/drain", {"reason": reason, "leavers": leavers}).get("gen")
        if isinstance(gen, bool) or not isinstance(gen, int):
            raise HeadUnavailable(f"head at {self.url} gave a malformed drain answer")
        return gen

    def forget(self, nodes: list[str]) -> None:
        self._call("POST", "/api/forget", {"nodes": nodes})

    def event(self, type_: str, **data: Any) -> None:
        self._call("POST", "/api/event", {"type": type_, **data})

    def pause_loop(self, ttl_s: float, by: str) -> dict[str, Any]:
        """Ask the head to pause its reconcile loop: {"paused": bool, "busy": who runs}."""
        return self._obj("POST", "/api/rebalance", {"action": "pause", "ttl_s": ttl_s, "by": by})

    def resume_loop(self) -> dict[str, Any]:
        return self._obj("POST", "/api/rebalance", {"action": "resume"})

    def health(self) -> dict[str, Any]:
        return self._obj("GET", "/api/health")
