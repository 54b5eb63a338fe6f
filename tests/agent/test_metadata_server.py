"""The metadata emulator speaks IMDSv2 and the GCE protocol over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from spotctl.agent.monitors import http_request
from spotctl.errors import AuthError, SpotctlError, TransientError
from spotctl.providers.local.metadata import MetadataServer, request_preempt, request_state

pytestmark = pytest.mark.timeout(60)

TTL = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN = "X-aws-ec2-metadata-token"
GOOGLE = {"Metadata-Flavor": "Google"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(clock: FakeClock, metadata_server: Callable[..., MetadataServer]) -> MetadataServer:
    return metadata_server(control_token="secret", clock=clock)


def _token(srv: MetadataServer, ttl: str = "60") -> str:
    reply = http_request("PUT", srv.url + "/latest/api/token", {TTL: ttl}, 2.0)
    assert reply.status == 200
    return reply.body.decode()


def _aws(srv: MetadataServer, path: str, token: str | None) -> tuple[int, bytes]:
    headers = {TOKEN: token} if token else {}
    reply = http_request("GET", srv.url + "/latest/meta-data/" + path, headers, 2.0)
    return reply.status, reply.body


def _control(
    srv: MetadataServer, method: str, path: str, body: dict | None, auth: str | None
) -> tuple[int, Any]:
    headers = {} if auth is None else {"Authorization": auth}
    data = None if body is None else json.dumps(body).encode()
    reply = http_request(method, srv.url + path, headers, 5.0, data=data)
    return reply.status, json.loads(reply.body) if reply.status == 200 else reply.body


# --- IMDSv2 -------------------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [None, "0", "21601", "abc"])
def test_token_needs_valid_ttl(server: MetadataServer, ttl: str | None) -> None:
    headers = {} if ttl is None else {TTL: ttl}
    assert http_request("PUT", server.url + "/latest/api/token", headers, 2.0).status == 400


def test_token_through_proxy_refused(server: MetadataServer) -> None:
    reply = http_request(
        "PUT", server.url + "/latest/api/token", {TTL: "60", "X-Forwarded-For": "1.2.3.4"}, 2.0
    )
    assert reply.status == 403


def test_reads_need_unexpired_token(server: MetadataServer, clock: FakeClock) -> None:
    assert _aws(server, "instance-id", None)[0] == 401
    assert _aws(server, "instance-id", "made-up")[0] == 401
    token = _token(server, "60")
    assert _aws(server, "instance-id", token) == (200, b"i-0local000000000001")
    assert _aws(server, "placement/availability-zone", token) == (200, b"local-1a")
    assert _aws(server, "instance-type", token) == (200, b"local.cpu")
    clock.now += 61
    assert _aws(server, "instance-id", token)[0] == 401


def test_instance_action_and_rebalance(server: MetadataServer) -> None:
    token = _token(server)
    assert _aws(server, "spot/instance-action", token)[0] == 404
    assert _aws(server, "events/recommendations/rebalance", token)[0] == 404
    server.set_aws_notice("hibernate", at=1795964645.0)
    server.set_rebalance(at=1795964600.0)
    status, body = _aws(server, "spot/instance-action", token)
    assert status == 200
    assert json.loads(body) == {"action": "hibernate", "time": "2026-11-29T15:04:05Z"}
    status, body = _aws(server, "events/recommendations/rebalance", token)
    assert json.loads(body) == {"noticeTime": "2026-11-29T15:03:20Z"}
    server.clear()
    assert _aws(server, "spot/instance-action", token)[0] == 404
    with pytest.raises(ValueError):
        server.set_aws_notice("explode", at=0.0)


# --- GCE ----------------------------------------------------------------------------------


def _gcp(srv: MetadataServer, key: str, query: str = "", headers=GOOGLE):  # type: ignore[no-untyped-def]
    return http_request("GET", f"{srv.url}/computeMetadata/v1/instance/{key}{query}", headers, 10.0)


def test_gcp_needs_flavor_header(server: MetadataServer) -> None:
    assert _gcp(server, "preempted", headers={}).status == 403
    reply = _gcp(server, "preempted")
    assert reply.status == 200 and reply.body == b"FALSE"
    assert reply.headers["metadata-flavor"] == "Google" and reply.headers["etag"]
    assert _gcp(server, "maintenance-event").body == b"NONE"
    assert _gcp(server, "zone").body == b"projects/000000000000/zones/local-1a"
    assert _gcp(server, "id").body.isdigit()
    assert _gcp(server, "nothing").status == 404


def test_gcp_etag_changes_with_value(server: MetadataServer) -> None:
    first = _gcp(server, "preempted").headers["etag"]
    assert _gcp(server, "preempted").headers["etag"] == first
    server.set_gcp_preempted(True)
    reply = _gcp(server, "preempted")
    assert reply.body == b"TRUE" and reply.headers["etag"] != first
    # A stale ETag returns at once with the new value.
    fast = _gcp(server, "preempted", f"?wait_for_change=true&last_etag={first}")
    assert fast.body == b"TRUE"


def test_gcp_wait_without_etag_waits_for_next_change(server: MetadataServer) -> None:
    replies: list = []
    waiter = threading.Thread(
        target=lambda: replies.append(_gcp(server, "maintenance-event", "?wait_for_change=true"))
    )
    waiter.start()
    end = time.monotonic() + 10
    while server.waiters < 1:
        assert time.monotonic() < end
        time.sleep(0.02)
    assert replies == []  # parked, although a value exists
    server.set_maintenance("TERMINATE_ON_HOST_MAINTENANCE")
    waiter.join(10)
    assert replies[0].body == b"TERMINATE_ON_HOST_MAINTENANCE"


def test_gcp_wait_timeout_sec_returns_current(server: MetadataServer) -> None:
    etag = _gcp(server, "preempted").headers["etag"]
    reply = _gcp(server, "preempted", f"?wait_for_change=true&last_etag={etag}&timeout_sec=0.2")
    assert reply.status == 200 and reply.body == b"FALSE" and reply.headers["etag"] == etag


def test_gcp_faults(server: MetadataServer) -> None:
    server.inject("5xx", 1)
    server.inject("garbage", 1)
    assert _gcp(server, "preempted").status == 503
    assert _gcp(server, "preempted").body == b"MAYBE"
    assert _gcp(server, "preempted").body == b"FALSE"
    assert server.faults_pending() == {"5xx": 0, "garbage": 0, "timeout": 0, "401": 0}
    with pytest.raises(ValueError):
        server.inject("meteor", 1)


# --- control endpoint ---------------------------------------------------------------------


def test_control_needs_bearer_token(server: MetadataServer) -> None:
    assert _control(server, "POST", "/_spotctl/preempt", {"style": "aws"}, None)[0] == 401
    assert _control(server, "POST", "/_spotctl/preempt", {}, "Bearer wrong")[0] == 401
    assert _control(server, "GET", "/_spotctl/state", None, "Bearer nope")[0] == 401
    assert server.deadline is None
    assert server.state()["aws"]["instance_action"] is None


def test_control_disabled_without_token() -> None:
    with MetadataServer() as srv:
        assert _control(srv, "POST", "/_spotctl/preempt", {}, "Bearer x")[0] == 404


def test_control_preempt_aws_and_state(server: MetadataServer, clock: FakeClock) -> None:
    status, body = _control(
        server, "POST", "/_spotctl/preempt", {"style": "aws", "in_s": 90}, "Bearer secret"
    )
    assert status == 200 and body["deadline"] == clock.now + 90
    status, state = _control(server, "GET", "/_spotctl/state", None, "Bearer secret")
    assert state["deadline"] == clock.now + 90
    assert state["aws"]["instance_action"]["action"] == "terminate"
    assert state["gcp"] == {"preempted": False, "maintenance_event": "NONE"}
    assert (
        _control(server, "POST", "/_spotctl/preempt", {"style": "azure"}, "Bearer secret")[0] == 400
    )


def test_control_preempt_gcp(server: MetadataServer, clock: FakeClock) -> None:
    status, body = _control(server, "POST", "/_spotctl/preempt", {"style": "gcp"}, "Bearer secret")
    assert status == 200 and body["deadline"] == clock.now + 30
    assert _gcp(server, "preempted").body == b"TRUE"
    assert server.deadline == clock.now + 30


def test_deadline_callback_fires() -> None:
    fired: list[float] = []
    done = threading.Event()

    def on_deadline(deadline: float) -> None:
        fired.append(deadline)
        done.set()

    with MetadataServer(control_token="t", on_deadline=on_deadline) as srv:
        status, body = _control(
            srv, "POST", "/_spotctl/preempt", {"style": "aws", "in_s": 0.2}, "Bearer t"
        )
        assert status == 200
        assert done.wait(10)
        assert fired == [body["deadline"]] and srv.deadline == body["deadline"]


def test_clear_cancels_deadline() -> None:
    fired: list[float] = []
    with MetadataServer(control_token="t", on_deadline=fired.append) as srv:
        srv.preempt("aws", in_s=0.3)
        srv.clear()
        time.sleep(0.6)
        assert fired == [] and srv.deadline is None


def test_client_helpers(server: MetadataServer, clock: FakeClock) -> None:
    with pytest.raises(AuthError):
        request_preempt(server.url, "wrong")
    deadline = request_preempt(server.url, "secret", "aws", in_s=5, action="stop")
    assert deadline == clock.now + 5
    state = request_state(server.url, "secret")
    assert state["deadline"] == deadline
    assert state["aws"]["instance_action"]["action"] == "stop"
    with pytest.raises(SpotctlError, match="HTTP 400"):
        request_preempt(server.url, "secret", "aws", action="explode")


def test_client_helper_unreachable() -> None:
    srv = MetadataServer(control_token="t").start()
    url = srv.url
    srv.stop()
    with pytest.raises(TransientError):
        request_state(url, "t", timeout_s=1.0)


def test_earliest_deadline_stands(server: MetadataServer, clock: FakeClock) -> None:
    first = server.preempt("aws", in_s=100)
    assert server.preempt("aws", in_s=200) == first
    assert server.preempt("gcp") == clock.now + 30 == server.deadline
    # a gcp notice's hard stop at in_s when given (`spotctl preempt --style gcp --in`)
    assert server.preempt("gcp", in_s=12) == clock.now + 12 == server.deadline
    assert _gcp(server, "preempted").body == b"TRUE"


def test_control_inject_and_clear(server: MetadataServer) -> None:
    assert _control(server, "POST", "/_spotctl/inject", {"kind": "5xx", "count": 2}, None)[0] == 401
    status, body = _control(
        server, "POST", "/_spotctl/inject", {"kind": "5xx", "count": 2}, "Bearer secret"
    )
    assert status == 200 and body["faults"]["5xx"] == 2
    assert _gcp(server, "preempted").status == 503
    bad = _control(server, "POST", "/_spotctl/inject", {"kind": "meteor"}, "Bearer secret")
    assert bad[0] == 400
    server.preempt("gcp")
    status, state = _control(server, "POST", "/_spotctl/clear", {}, "Bearer secret")
    assert status == 200 and state["deadline"] is None and state["gcp"]["preempted"] is False
    assert server.faults_pending()["5xx"] == 0
    assert _gcp(server, "preempted").body == b"FALSE"


def test_a_gcp_preemption_is_a_soft_off_at_the_notice(
        metadata_server: Callable[..., MetadataServer]) -> None:
    """GCP's notice is an ACPI soft-off: the guest starts shutting down (systemd stops the
    agent) when `preempted` turns TRUE, not at the deadline. An AWS notice is not."""
    offs: list[bool] = []
    srv = metadata_server(control_token="secret",
                          on_soft_off=lambda: offs.append(srv.state()["gcp"]["preempted"]))
    srv.preempt("aws", 60)
    assert offs == []
    srv.preempt("gcp", 30)
    assert offs == [True]  # with the metadata already saying so
