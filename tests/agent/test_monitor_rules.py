"""What each notice monitor makes of what it reads (spotctl.agent.monitors), in process:
the notice's every field, deadlines and their fallbacks, odd replies counted with their
line, which monitors each metadata style gets, and the loop's delivery and pacing. The
same monitors against the metadata emulator over real HTTP: test_monitors.py."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from spotctl.agent import monitors as m
from spotctl.agent.monitors import (
    AwsImdsMonitor,
    FileNoticeMonitor,
    GcpMetadataMonitor,
    MonitorLoop,
    Notice,
    Reply,
)

T0 = 1_800_000_000.0


def clock() -> float:
    return T0


def test_iso_times() -> None:
    assert m.parse_iso_utc("2027-01-15T08:00:00Z") == 1800000000.0
    assert m.parse_iso_utc(" 2027-01-15T08:00:00Z ") == 1800000000.0
    assert m.parse_iso_utc("2027-01-15T08:00:00") == 1800000000.0  # no zone: UTC
    assert m.parse_iso_utc("2027-01-15T09:00:00+01:00") == 1800000000.0
    for bad in ("", None, 5, "tomorrow"):
        with pytest.raises(ValueError) as e:
            m.parse_iso_utc(bad)  # type: ignore[arg-type]
        if bad in ("", None, 5):
            assert str(e.value) == f"not a timestamp: {bad!r}"
    assert m.format_iso_utc(1800000000.0) == "2027-01-15T08:00:00Z"
    assert m.format_iso_utc(1800000000.9) == "2027-01-15T08:00:00Z"


def test_notice_json_round_trip_and_defaults() -> None:
    n = m.make_notice("aws", "rebalance", "rebalance", math.inf, T0, {"a": 1}, {"x": 2})
    assert n.detail == {"payload": {"a": 1}, "x": 2}
    assert n.id == m.notice_id("aws", "rebalance", {"a": 1}) and len(n.id) == 16
    assert m.notice_id("aws", "rebalance", {"a": 1}) != m.notice_id("gcp", "rebalance", {"a": 1})
    assert m.notice_id("aws", "x", {"a": 1}) != m.notice_id("aws", "y", {"a": 1})
    assert m.notice_id("aws", "x", {"a": 1}) != m.notice_id("aws", "x", {"a": 2})
    js = n.to_json()
    assert js == {"id": n.id, "source": "aws", "kind": "rebalance", "action": "rebalance",
                  "deadline": None, "received_at": T0, "detail": n.detail}  # fmt: skip
    back = Notice.from_json(json.loads(json.dumps(js)))
    assert back == n and back.detail == n.detail and back.deadline == math.inf
    assert Notice.from_json({**js, "deadline": T0 + 5}).deadline == T0 + 5
    bare = Notice.from_json({"id": 7, "source": "file", "kind": "preempted"})
    assert (bare.id, bare.action, bare.deadline, bare.received_at, bare.detail) == (
        "7",
        "",
        math.inf,
        0.0,
        {},
    )
    assert Notice.from_json({**js, "detail": None}).detail == {}
    assert n.seconds_left(T0 - 10) == math.inf
    assert m.make_notice("f", "k", "a", T0 + 30, T0, "p").seconds_left(T0 + 10) == 20.0


def aws() -> AwsImdsMonitor:
    return AwsImdsMonitor("http://169.254.169.254/", clock=clock)


def test_aws_interruption_and_rebalance_notices() -> None:
    mon = aws()
    assert mon.base_url == "http://169.254.169.254" and mon.name == "aws-imds"
    n = mon._interruption({"action": "stop", "time": "2027-01-15T08:02:00Z"}, T0)
    assert n is not None and (n.source, n.kind, n.action, n.deadline, n.received_at) == (
        "aws",
        "spot-interruption",
        "stop",
        T0 + 120,
        T0,
    )
    assert n.detail == {"payload": {"action": "stop", "time": "2027-01-15T08:02:00Z"}}
    r = mon._rebalance({"noticeTime": "2027-01-15T07:59:00Z"}, T0)
    assert r is not None and (r.kind, r.action, r.deadline, r.received_at) == (
        "rebalance",
        "rebalance",
        math.inf,
        T0,
    )
    assert r.detail == {"payload": {"noticeTime": "2027-01-15T07:59:00Z"},
                        "notice_time": T0 - 60}  # fmt: skip
    assert mon.errors == 0
    bad: list[tuple[dict[str, Any], str]] = [({"action": "", "time": "2027-01-15T08:02:00Z"}, "instance-action: missing "
            "action/time in {'action': '', 'time': '2027-01-15T08:02:00Z'}"),
           ({"action": "stop"}, "instance-action: missing action/time in {'action': 'stop'}"),
           ({"action": 1, "time": "x"}, "instance-action: missing action/time in "
            "{'action': 1, 'time': 'x'}"),
           ({"action": "stop", "time": "soon"}, "instance-action: bad time 'soon'")]  # fmt: skip
    for i, (data, line) in enumerate(bad, 1):
        assert mon._interruption(data, T0) is None
        assert (mon.errors, mon.last_error) == (i, line)
    assert mon._rebalance({}, T0) is None
    assert mon.last_error == "rebalance: missing noticeTime in {}"
    assert mon._rebalance({"noticeTime": "later"}, T0) is None
    assert (mon.errors, mon.last_error) == (6, "rebalance: bad noticeTime 'later'")
    with pytest.raises(ValueError, match="token_ttl_s must be in 1..21600, got 0"):
        AwsImdsMonitor("http://x", token_ttl_s=0)
    assert AwsImdsMonitor("http://x", token_ttl_s=21600).token_ttl_s == 21600
    assert AwsImdsMonitor("http://x", token_ttl_s=40)._refresh_margin() == 10.0
    assert AwsImdsMonitor("http://x")._refresh_margin() == 60.0


DROP = Reply(0, {}, b"")  # the stub closes the connection without an answer


class MetadataStub:
    """A real HTTP server on loopback answering each path with a scripted Reply (DROP: the
    connection is closed unanswered), for the replies the metadata emulator does not make
    (no ETag, odd windows, one path failing while another answers). It records each
    request's method, path with query, and headers."""

    def __init__(self, answers: Mapping[str, Reply]):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.answers = dict(answers)
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.requests.append(("GET", self.path, dict(self.headers.items())))
                got = stub.answers[self.path.split("?", 1)[0]]
                if got is DROP:
                    self.close_connection = True
                    return
                self.send_response(got.status)
                for k, v in got.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(got.body)))
                self.end_headers()
                self.wfile.write(got.body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True,
                         kwargs={"poll_interval": 0.05}).start()  # fmt: skip

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub() -> Iterator[MetadataStub]:
    s = MetadataStub({})
    yield s
    s.close()


GOOGLE = {"Metadata-Flavor": "Google", "ETag": "e1"}
PRE = "/computeMetadata/v1/instance/preempted"
MAINT = "/computeMetadata/v1/instance/maintenance-event"
UPCOMING = "/computeMetadata/v1/instance/upcoming-maintenance"


def gcp(url: str, key: str = "preempted", timeout_s: float = 35.0) -> GcpMetadataMonitor:
    return GcpMetadataMonitor(url + "/", timeout_s=timeout_s, key=key, clock=clock)


def test_gcp_preempted_reads(stub: MetadataStub) -> None:
    mon = gcp(stub.url)
    assert (mon.name, mon.wait_timeout_sec, mon.interval_s, mon.polls) == (
        "gcp-preempted", 30, 0.0, 0)  # fmt: skip
    assert gcp(stub.url, timeout_s=5.5).wait_timeout_sec == 1
    assert gcp(stub.url, timeout_s=7).wait_timeout_sec == 2
    stub.answers[PRE] = Reply(200, GOOGLE, b"FALSE\n")
    assert mon.poll() == [] and (mon.value, mon.etag, mon.retry_after_s) == ("FALSE", "e1", 0.0)
    method, path, headers = stub.requests[-1]
    assert (method, path, headers.get("Metadata-Flavor")) == ("GET", PRE, "Google")
    # later polls wait for a change from the ETag seen
    stub.answers[PRE] = Reply(200, {**GOOGLE, "ETag": "e2"}, b"TRUE")
    (n,) = mon.poll(wait=True)
    assert stub.requests[-1][1] == PRE + "?wait_for_change=true&last_etag=e1&timeout_sec=30"
    assert (n.source, n.kind, n.action, n.deadline, n.received_at, n.detail) == (
        "gcp", "preempted", "terminate", T0 + 30, T0, {"payload": "TRUE"})  # fmt: skip
    assert (mon.value, mon.etag, mon.polls, mon.errors) == ("TRUE", "e2", 2, 0)
    # a reply without an ETag: the next read cannot wait, so it is paced
    stub.answers[PRE] = Reply(200, {"Metadata-Flavor": "Google"}, b"TRUE")
    mon.poll(wait=True)
    assert (mon.retry_after_s, mon.etag) == (1.0, "")
    mon.poll(wait=True)
    assert stub.requests[-1][1] == PRE
    # odd values are counted and not taken
    stub.answers[PRE] = Reply(200, GOOGLE, b"x" * 50)
    assert mon.poll() == [] and mon.value == "TRUE"
    assert (mon.errors, mon.last_error) == (1, f"preempted: unexpected value {'x' * 40!r}")


@pytest.mark.parametrize("reply, line", [
    (Reply(503, GOOGLE, b""), "preempted: HTTP 503, retry in 1 s"),
    (Reply(500, GOOGLE, b""), "preempted: HTTP 500"),
    (Reply(404, GOOGLE, b""), "preempted: HTTP 404"),
    (Reply(200, {"ETag": "e"}, b"TRUE"), "preempted: reply lacks Metadata-Flavor: Google"),
    (DROP, "GET {url}: RemoteDisconnected: Remote end closed connection without response"),
])  # fmt: skip
def test_gcp_odd_replies_pause_a_second(stub: MetadataStub, reply: Reply, line: str) -> None:
    mon = gcp(stub.url)
    stub.answers[PRE] = reply
    assert mon.poll() == []
    assert (mon.retry_after_s, mon.errors, mon.last_error, mon.value) == (
        1.0, 1, line.format(url=stub.url + PRE), "")  # fmt: skip
    stub.answers[PRE] = Reply(200, GOOGLE, b"FALSE")
    mon.poll()
    assert mon.retry_after_s == 0.0  # reset by a good read


def test_gcp_maintenance_deadlines(stub: MetadataStub) -> None:
    mon = gcp(stub.url, "maintenance-event")
    assert mon.name == "gcp-maintenance-event"
    window = {"window_start_time": "2027-01-15T08:10:00Z"}
    stub.answers[MAINT] = Reply(200, GOOGLE, b"TERMINATE_ON_HOST_MAINTENANCE")
    stub.answers[UPCOMING] = Reply(200, {}, json.dumps(window).encode())
    (n,) = mon.poll()
    assert (n.kind, n.action, n.deadline, n.received_at, n.detail) == (
        "maintenance", "terminate", T0 + 600, T0,
        {"payload": "TERMINATE_ON_HOST_MAINTENANCE"})  # fmt: skip
    assert n.source == "gcp" and mon.value == "TERMINATE_ON_HOST_MAINTENANCE"
    # a window that started already, none announced, or an odd one: 60 s from now; a
    # window without a zone is UTC
    for answer, deadline, odd in (
            (Reply(200, {}, b'{"window_start_time": "2027-01-15T08:00:00Z"}'), T0 + 60, 0),
            (Reply(404, {}, b""), T0 + 60, 0),
            (Reply(200, {}, b"{}"), T0 + 60, 1),
            (Reply(200, {}, b'{"window_start_time": "2027-01-15T08:10:00"}'), T0 + 600, 0),
            (DROP, T0 + 60, 1)):  # fmt: skip
        stub.answers[UPCOMING] = answer
        before = mon.errors
        (n,) = mon.poll()
        assert n.deadline == deadline, answer
        assert mon.errors - before == odd, answer
    assert mon.last_error == (f"upcoming-maintenance: GET {stub.url}{UPCOMING}: "
                              "RemoteDisconnected: Remote end closed connection without "
                              "response")  # fmt: skip
    for value in (b"NONE", b"MIGRATE_ON_HOST_MAINTENANCE"):
        stub.answers[MAINT] = Reply(200, GOOGLE, value)
        assert mon.poll() == [] and mon.value == value.decode()


def test_file_notices(tmp_path: Path) -> None:
    f = tmp_path / "notice"
    mon = FileNoticeMonitor(f, clock=clock)
    assert (mon.name, mon.interval_s) == ("file-notice", 1.0)
    assert mon.poll() == [] and mon.polls == 1
    f.write_text("")
    (n,) = mon.poll()
    assert (n.source, n.kind, n.action, n.deadline, n.received_at, n.detail) == (
        "file",
        "preempted",
        "terminate",
        T0 + 30,
        T0,
        {"payload": ""},
    )
    f.write_text(json.dumps({"deadline": T0 + 5, "action": "stop"}))
    (n,) = mon.poll()
    assert (n.action, n.deadline) == ("stop", T0 + 5) and mon.errors == 0
    f.write_text(json.dumps({"action": "hibernate"}))
    assert [(x.action, x.deadline) for x in mon.poll()] == [("hibernate", T0 + 30)]
    for text, why in (("[1]", "not a JSON object"),
                      ("{nope", "Expecting property name enclosed in double quotes: "
                       "line 1 column 2 (char 1)"),
                      ('{"deadline": "x", "action": "stop"}',
                       "could not convert string to float: 'x'")):  # fmt: skip
        f.write_text(text)
        (n,) = mon.poll()  # the file is there: still a notice, with the default deadline
        assert (n.action, n.deadline) == ("terminate", T0 + 30), text
        assert mon.last_error == f"{f}: bad content ({why}); using a 30 s deadline"
    f.write_bytes(b"\xff\xfe")  # not UTF-8: read with replacement
    assert len(mon.poll()) == 1
    f.unlink()
    f.mkdir()
    before = mon.errors
    assert mon.poll() == [] and mon.errors == before + 1
    assert mon.last_error.startswith(f"{f}: [Errno 21] Is a directory")


def test_which_monitors_each_style_gets(tmp_path: Path) -> None:
    def kinds(style: str, **kw: Any) -> list[tuple[str, str, Any]]:
        return [(type(x).__name__, x.source, getattr(x, "key", getattr(x, "interval_s", None)))
                for x in m.build_monitors(style, "http://md", **kw)]  # fmt: skip

    assert kinds("aws") == [("AwsImdsMonitor", "aws", 2.0)]
    assert kinds("aws", poll_interval_s=0.5) == [("AwsImdsMonitor", "aws", 0.5)]
    assert kinds("gcp") == [("GcpMetadataMonitor", "gcp", "preempted"),
                            ("GcpMetadataMonitor", "gcp", "maintenance-event")]  # fmt: skip
    assert kinds("local") == [("AwsImdsMonitor", "local", 2.0),
                              ("GcpMetadataMonitor", "local", "preempted")]  # fmt: skip
    assert kinds("none") == [] and kinds("file") == []
    f = str(tmp_path / "n")
    assert kinds("file", notice_file=f) == [("FileNoticeMonitor", "file", 1.0)]
    assert kinds("none", notice_file=f, poll_interval_s=0.25) == [
        ("FileNoticeMonitor", "file", 0.25)
    ]
    assert m.build_monitors("aws", "http://md/")[0].base_url == "http://md"
    with pytest.raises(ValueError) as e:
        m.build_monitors("azure", "http://md")
    assert str(e.value) == "unknown metadata style 'azure'"
    assert m.build_monitors("none") == []


class Scripted:
    """A monitor that returns scripted notices, one list per poll, then nothing."""

    def __init__(self, name: str, script: list[list[Notice]], blocking: bool = False,
                 fail: str = "") -> None:  # fmt: skip
        self.name, self.script, self.blocking = name, list(script), blocking
        self.errors, self.last_error, self.interval_s, self.retry_after_s = 0, "", 0.01, 0.0
        self.waits: list[bool] = []
        self.fail = fail
        self.done = threading.Event()

    def poll(self, wait: bool = False) -> list[Notice]:
        self.waits.append(wait)
        if self.fail:
            self.errors += 1
            self.last_error = self.fail
        if not self.script:
            self.done.set()
            return []
        return self.script.pop(0)


def test_the_loop_delivers_each_notice_once_and_waits_only_after_the_first_read() -> None:
    a = m.make_notice("aws", "spot-interruption", "terminate", T0 + 120, T0, "a")
    b = m.make_notice("aws", "rebalance", "rebalance", math.inf, T0, "b")
    got: list[Notice] = []
    plain = Scripted("plain", [[a], [a, b], [b]])
    long = Scripted("long", [[a], [], [b]], blocking=True)
    loop = MonitorLoop([plain, long], got.append).start()
    assert loop.start() is loop and len(loop._threads) == 2  # started once
    assert plain.done.wait(10) and long.done.wait(10)
    assert loop.running
    loop.stop()
    assert not loop.running
    assert sorted(n.id for n in got) == sorted([a.id, b.id])
    assert set(loop.seen) == {a.id, b.id}
    assert long.waits[0] is False and all(long.waits[1:]) and not any(plain.waits)


def test_the_loop_logs_a_repeated_error_at_1_10_100(caplog: pytest.LogCaptureFixture) -> None:
    loop = MonitorLoop([], lambda n: None)
    with caplog.at_level("WARNING", logger="spotctl.agent.monitors"):
        for _ in range(101):
            loop._note_error("aws-imds", "refused")
        loop._note_error("aws-imds", "other")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["aws-imds: refused (seen 1 times)", "aws-imds: refused (seen 10 times)",
                     "aws-imds: refused (seen 100 times)", "aws-imds: other (seen 1 times)"]  # fmt: skip
    assert loop.error_repeats == {("aws-imds", "refused"): 101, ("aws-imds", "other"): 1}


def test_the_loop_counts_a_crashing_monitor_and_a_failing_callback() -> None:
    class Crashing(Scripted):
        def poll(self, wait: bool = False) -> list[Notice]:
            self.waits.append(wait)
            if len(self.waits) >= 3:
                self.done.set()
            raise RuntimeError("bug")

    crash = Crashing("crash", [])
    n = m.make_notice("file", "preempted", "terminate", T0, T0, "x")
    bad_cb = Scripted("cb", [[n]])

    def boom(_: Notice) -> None:
        raise RuntimeError("callback bug")

    loop = MonitorLoop([crash, bad_cb], boom, interval_s=0.01).start()
    assert crash.done.wait(10) and bad_cb.done.wait(10)
    loop.stop()
    assert crash.errors >= 3
    assert crash.last_error == "poll crashed (see the traceback logged first)"
    assert loop.error_repeats[("crash", crash.last_error)] >= 3
    assert n.id in loop.seen  # delivered (once) although the callback failed
