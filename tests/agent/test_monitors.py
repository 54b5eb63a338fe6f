"""Monitors against the real metadata emulator over HTTP (no patched functions)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spotctl.agent.monitors import (
    AwsImdsMonitor,
    FileNoticeMonitor,
    GcpMetadataMonitor,
    MonitorLoop,
    Notice,
    build_monitors,
    parse_iso_utc,
)
from spotctl.providers.local.metadata import MetadataServer
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(metadata_server: Callable[..., MetadataServer]) -> MetadataServer:
    return metadata_server(control_token="secret", timeout_sleep_s=1.5)


_closed_port = free_port  # a loopback port nobody listens on


# --- AWS ----------------------------------------------------------------------------------


def test_aws_no_notice_is_404(server: MetadataServer) -> None:
    mon = AwsImdsMonitor(server.url)
    assert mon.poll() == []
    assert mon.errors == 0, mon.last_error
    assert server.requests["/latest/meta-data/spot/instance-action"] == 1
    assert server.requests["/latest/meta-data/events/recommendations/rebalance"] == 1


def test_aws_spot_interruption_parsed(server: MetadataServer) -> None:
    server.set_aws_notice("stop", at=parse_iso_utc("2026-11-29T15:04:05Z"))
    mon = AwsImdsMonitor(server.url)
    [notice] = mon.poll()
    assert notice.source == "aws"
    assert notice.kind == "spot-interruption"
    assert notice.action == "stop"
    assert notice.deadline == parse_iso_utc("2026-11-29T15:04:05Z") == 1795964645.0
    assert notice.detail["payload"] == {"action": "stop", "time": "2026-11-29T15:04:05Z"}
    assert mon.errors == 0


def test_aws_rebalance_has_no_deadline(server: MetadataServer) -> None:
    server.set_rebalance(at=1795964645.0)
    [notice] = AwsImdsMonitor(server.url).poll()
    assert notice.kind == "rebalance"
    assert math.isinf(notice.deadline)
    assert notice.to_json()["deadline"] is None
    assert Notice.from_json(json.loads(json.dumps(notice.to_json()))) == notice


def test_aws_same_notice_same_id_across_polls(server: MetadataServer) -> None:
    server.set_aws_notice("terminate", at=time.time() + 120)
    mon = AwsImdsMonitor(server.url)
    first, second = mon.poll(), mon.poll()
    assert len(first) == len(second) == 1
    assert first[0].id == second[0].id
    other = AwsImdsMonitor(server.url, source="local").poll()[0]
    assert other.id != first[0].id  # the source is part of the identity


def test_aws_token_reused_then_refreshed_before_expiry(server: MetadataServer) -> None:
    now = [1000.0]
    mon = AwsImdsMonitor(server.url, token_ttl_s=100, clock=lambda: now[0])
    mon.poll()
    mon.poll()
    assert server.token_puts == 1  # one token serves many reads
    now[0] += 90  # inside the refresh margin (25 s for a 100 s TTL)
    mon.poll()
    assert server.token_puts == 2
    assert mon.errors == 0


def test_aws_401_refetches_token_once_and_retries(server: MetadataServer) -> None:
    server.set_aws_notice("terminate", at=time.time() + 60)
    mon = AwsImdsMonitor(server.url)
    assert len(mon.poll()) == 1
    server.inject("401", 1)  # the service forgets every token
    assert len(mon.poll()) == 1
    assert server.token_puts == 2
    assert mon.errors == 0


def test_aws_persistent_401_is_counted_not_raised(server: MetadataServer) -> None:
    server.set_aws_notice("terminate", at=time.time() + 60)
    server.inject("401", 2)
    mon = AwsImdsMonitor(server.url, rebalance=False)
    assert mon.poll() == []
    assert mon.errors == 1 and "401" in mon.last_error


def test_aws_ttl_validated_and_short_token_renewed(server: MetadataServer) -> None:
    with pytest.raises(ValueError):
        AwsImdsMonitor(server.url, token_ttl_s=0)
    with pytest.raises(ValueError):
        AwsImdsMonitor(server.url, token_ttl_s=21601)
    now = [0.0]
    mon = AwsImdsMonitor(server.url, token_ttl_s=1, clock=lambda: now[0])
    mon.poll()
    now[0] += 0.8  # past the refresh margin of a 1 s token
    mon.poll()
    assert server.token_puts == 2 and mon.errors == 0


@pytest.mark.parametrize("fault", ["5xx", "garbage", "timeout", "401"])
def test_aws_faults_give_no_notice_and_no_exception(server: MetadataServer, fault: str) -> None:
    server.set_aws_notice("terminate", at=time.time() + 60)
    server.inject(fault, 5)
    mon = AwsImdsMonitor(server.url, timeout_s=0.5, rebalance=False)
    assert mon.poll() == []
    assert mon.errors >= 1 and mon.last_error
    # After the faults are cleared the notice comes through.
    server.clear()
    server.set_aws_notice("terminate", at=time.time() + 60)
    assert len(mon.poll()) == 1


def test_aws_missing_keys_and_refused_connection_counted(server: MetadataServer) -> None:
    mon = AwsImdsMonitor(f"http://127.0.0.1:{_closed_port()}", timeout_s=0.5)
    assert mon.poll() == []
    assert mon.errors == 1 and "token" in mon.last_error
    bad = AwsImdsMonitor(server.url)
    assert bad._interruption({"action": "terminate"}, 0.0) is None
    assert bad._interruption({"action": "terminate", "time": "soon"}, 0.0) is None
    assert bad._rebalance({}, 0.0) is None
    assert bad.errors == 3


# --- GCP ----------------------------------------------------------------------------------


def test_gcp_false_then_true(server: MetadataServer) -> None:
    mon = GcpMetadataMonitor(server.url)
    assert mon.poll() == []
    assert mon.etag and mon.value == "FALSE"
    server.set_gcp_preempted(True)
    before = time.time()
    [notice] = mon.poll()
    assert notice.kind == "preempted" and notice.source == "gcp"
    assert before + 29 <= notice.deadline <= time.time() + 31
    assert mon.poll()[0].id == notice.id


def test_gcp_long_poll_wakes_on_change(server: MetadataServer) -> None:
    mon = GcpMetadataMonitor(server.url, timeout_s=30.0)  # server waits up to 25 s
    assert mon.poll() == []
    got: list[list[Notice]] = []
    waiter = threading.Thread(target=lambda: got.append(mon.poll(wait=True)))
    waiter.start()
    # The waiting request is parked on the server until the value changes.
    deadline = time.monotonic() + 10
    while server.waiters < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert got == []
    server.set_gcp_preempted(True)
    waiter.join(20)
    assert not waiter.is_alive()
    assert len(got[0]) == 1 and got[0][0].kind == "preempted"


def test_gcp_long_poll_times_out_with_same_value(server: MetadataServer) -> None:
    mon = GcpMetadataMonitor(server.url, timeout_s=6.0)  # timeout_sec=1
    mon.poll()
    etag = mon.etag
    assert mon.poll(wait=True) == []
    assert mon.etag == etag and mon.errors == 0


def test_gcp_maintenance(server: MetadataServer) -> None:
    mon = GcpMetadataMonitor(server.url, key="maintenance-event")
    server.set_maintenance("MIGRATE_ON_HOST_MAINTENANCE")
    assert mon.poll() == []
    server.set_maintenance("TERMINATE_ON_HOST_MAINTENANCE")
    [notice] = mon.poll()
    assert notice.kind == "maintenance" and notice.action == "terminate"
    assert mon.errors == 0


def test_gcp_maintenance_of_a_gpu_vm_uses_the_announced_window(server: MetadataServer) -> None:
    # GPU VMs hear of a TERMINATE maintenance up to an hour ahead: the deadline is the
    # window's start, not 60 s from now (which would drain the node an hour early).
    start = time.time() + 3000
    mon = GcpMetadataMonitor(server.url, key="maintenance-event")
    server.set_maintenance("TERMINATE_ON_HOST_MAINTENANCE", window_start=start)
    [notice] = mon.poll()
    assert notice.kind == "maintenance" and abs(notice.deadline - start) < 1.5
    assert mon.errors == 0
    # Without an announced window, the short grace stands.
    server.clear()
    mon2 = GcpMetadataMonitor(server.url, key="maintenance-event")
    server.set_maintenance("TERMINATE_ON_HOST_MAINTENANCE")
    [short] = mon2.poll()
    assert short.deadline - time.time() < 120


def test_gcp_503_sets_retry_after(server: MetadataServer) -> None:
    server.set_gcp_preempted(True)
    server.inject("5xx", 1)
    mon = GcpMetadataMonitor(server.url)
    assert mon.poll() == []
    assert mon.retry_after_s == 1.0 and "503" in mon.last_error
    assert len(mon.poll()) == 1
    assert mon.retry_after_s == 0.0


@pytest.mark.parametrize("fault", ["5xx", "garbage", "timeout"])
def test_gcp_faults_give_no_notice(server: MetadataServer, fault: str) -> None:
    server.set_gcp_preempted(True)
    server.inject(fault, 1)
    mon = GcpMetadataMonitor(server.url, timeout_s=0.5)
    assert mon.poll() == []
    assert mon.errors == 1
    assert len(mon.poll()) == 1


def test_gcp_reply_without_flavor_header_is_odd(server: MetadataServer) -> None:
    # The AWS side of the emulator answers 404 without Metadata-Flavor; point the GCP
    # monitor at a server that answers 200 without the header instead.
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Impostor(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"TRUE")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=httpd.serve_forever, daemon=True,
                     kwargs={"poll_interval": 0.05}).start()
    try:
        mon = GcpMetadataMonitor(f"http://127.0.0.1:{httpd.server_address[1]}")
        assert mon.poll() == []
        assert mon.errors == 1 and "Metadata-Flavor" in mon.last_error
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_gcp_refused_connection(server: MetadataServer) -> None:
    mon = GcpMetadataMonitor(f"http://127.0.0.1:{_closed_port()}", timeout_s=0.5)
    assert mon.poll(wait=True) == []
    assert mon.errors == 1 and mon.retry_after_s == 1.0


# --- file ---------------------------------------------------------------------------------


def test_file_monitor(tmp_path: Path) -> None:
    path = tmp_path / "notice"
    mon = FileNoticeMonitor(path, clock=lambda: 100.0)
    assert mon.poll() == []
    path.write_text("")
    [empty] = mon.poll()
    assert empty.deadline == 130.0 and empty.source == "file"
    path.write_text(json.dumps({"deadline": 555.0}))
    [dated] = mon.poll()
    assert dated.deadline == 555.0 and dated.id != empty.id
    path.write_text("{not json")
    [odd] = mon.poll()
    assert odd.deadline == 130.0 and mon.errors == 1


def test_build_monitors() -> None:
    kinds = [type(m).__name__ for m in build_monitors("local", "http://x", "/tmp/n")]
    assert kinds == ["AwsImdsMonitor", "GcpMetadataMonitor", "FileNoticeMonitor"]
    assert [m.key for m in build_monitors("gcp", "http://x")] == ["preempted", "maintenance-event"]
    assert build_monitors("none") == []
    with pytest.raises(ValueError):
        build_monitors("azure")


# --- loop ---------------------------------------------------------------------------------


def _wait_for(cond, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


def test_loop_calls_on_notice_once_per_id(server: MetadataServer, tmp_path: Path) -> None:
    got: list[Notice] = []
    aws = AwsImdsMonitor(server.url, interval_s=0.05)
    gcp = GcpMetadataMonitor(server.url, timeout_s=6.0)
    loop = MonitorLoop([aws, gcp], got.append).start()
    try:
        server.set_aws_notice("terminate", at=time.time() + 120)
        server.set_gcp_preempted(True)
        _wait_for(lambda: len(got) >= 2 and aws.polls >= 5)
        polls = aws.polls
        _wait_for(lambda: aws.polls >= polls + 5)  # many more polls see the same notice
        server.set_rebalance()
        _wait_for(lambda: len(got) >= 3)
        _wait_for(lambda: aws.polls >= polls + 10)
    finally:
        loop.stop()
    kinds = sorted(n.kind for n in got)
    assert kinds == ["preempted", "rebalance", "spot-interruption"]
    assert len({n.id for n in got}) == 3
    assert not loop.running


def test_loop_rate_limits_repeated_errors(server: MetadataServer) -> None:
    mon = AwsImdsMonitor(f"http://127.0.0.1:{_closed_port()}", timeout_s=0.2, interval_s=0.01)
    loop = MonitorLoop([mon], lambda n: None).start()
    try:
        _wait_for(lambda: mon.errors >= 12)
    finally:
        loop.stop()
    assert sum(loop.error_repeats.values()) >= 12
    assert len(loop.error_repeats) == 1  # one distinct error, counted, not a log line each


def test_loop_survives_callback_errors(server: MetadataServer) -> None:
    calls: list[str] = []

    def boom(notice: Notice) -> None:
        calls.append(notice.id)
        raise RuntimeError("handler bug")

    server.set_aws_notice("terminate", at=time.time() + 60)
    server.set_rebalance()
    mon = AwsImdsMonitor(server.url, interval_s=0.05)
    loop = MonitorLoop([mon], boom).start()
    try:
        _wait_for(lambda: len(calls) == 2 and mon.polls >= 3)
    finally:
        loop.stop()
    assert len(set(calls)) == 2
