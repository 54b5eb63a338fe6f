"""An unset [aws]/[gcp] ssh_cidr is filled from the controller's public address (one
/32 or /128) with a line saying so: `up` does it before anything is launched, `check`
reports it, `init`'s spec mentions it. The address comes from SPOTCTL_CONTROLLER_ADDRESS
or the checkip service, here a loopback server standing in for it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from spotctl.control import address
from spotctl.errors import SpecError, SpotctlError
from spotctl.spec import ClusterSpec


def _spec(provider: str, **section: Any) -> ClusterSpec:
    return ClusterSpec.model_validate({"name": "c", "provider": provider, provider: section})


def _fixed(addr: str) -> address.Lookup:
    return lambda: (addr, "a test")


@pytest.fixture
def checkip(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """A loopback stand-in for the checkip service; append the body it answers next."""
    answers: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            body = answers.pop(0)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(address, "CHECKIP_URL", f"http://127.0.0.1:{srv.server_address[1]}/")
    monkeypatch.delenv(address.ADDRESS_ENV, raising=False)
    try:
        yield answers
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_unset_ssh_cidr_is_this_machines_address_with_a_line(provider: str) -> None:
    spec = _spec(provider)
    line = address.fill_ssh_cidr(spec, _fixed("198.51.100.23"))
    assert getattr(spec, provider).ssh_cidr == "198.51.100.23/32"
    assert line == (f"{provider}.ssh_cidr not set: SSH allowed from this machine's public "
                    f"address 198.51.100.23/32 (from a test); set ssh_cidr in [{provider}] "
                    "to choose")  # fmt: skip
    v6 = _spec(provider)
    address.fill_ssh_cidr(v6, _fixed("2001:db8::7"))
    assert getattr(v6, provider).ssh_cidr == "2001:db8::7/128"


def test_a_set_ssh_cidr_and_other_providers_are_left_alone() -> None:
    def never() -> tuple[str, str]:
        raise AssertionError("looked up an address it does not need")

    spec = _spec("aws", ssh_cidr="203.0.113.0/24")
    assert address.fill_ssh_cidr(spec, never) is None
    assert spec.aws.ssh_cidr == "203.0.113.0/24"
    assert address.fill_ssh_cidr(_spec("local"), never) is None


def test_the_address_comes_from_the_env_or_the_checkip_service(
    checkip: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkip.append(b"192.0.2.44\n")
    assert address.public_address() == ("192.0.2.44", address.CHECKIP_URL)
    monkeypatch.setenv(address.ADDRESS_ENV, "192.0.2.45")
    assert address.public_address() == ("192.0.2.45", f"${address.ADDRESS_ENV}")
    # whatever answers, only an address is used: never a page, a range or an empty body
    monkeypatch.delenv(address.ADDRESS_ENV)
    for body in (b"<html>captive portal</html>", b"0.0.0.0/0", b""):
        checkip.append(body)
        spec = _spec("gcp")
        with pytest.raises(SpecError) as e:
            address.fill_ssh_cidr(spec)
        msg = str(e.value)
        assert msg.startswith("gcp.ssh_cidr: not set and ") and "not an IP address" in msg
        assert "\n" not in msg and spec.gcp.ssh_cidr == ""


def test_an_unreachable_service_names_the_field_and_the_fix(
    checkip: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import free_port

    monkeypatch.setattr(address, "CHECKIP_URL", f"http://127.0.0.1:{free_port()}/")
    with pytest.raises(SpecError, match=r"^aws\.ssh_cidr: not set and could not ask "
                                        r"http://127\.0\.0\.1:\d+/ .*ssh_cidr = "):
        address.fill_ssh_cidr(_spec("aws"))


def test_up_fills_it_before_reconciling_and_says_so(
    run_cli: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spotctl.control import reconcile

    seen: list[Any] = []

    def stop(store: Any, spec: ClusterSpec, **kw: Any) -> Any:
        seen.append((spec.aws.ssh_cidr, kw.get("options")))
        raise SpotctlError("stopped by the test")

    monkeypatch.setattr(reconcile, "reconcile", stop)
    monkeypatch.setenv(address.ADDRESS_ENV, "192.0.2.9")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('x')\n")
    (tmp_path / "spotctl.toml").write_text('name = "c"\nprovider = "aws"\n[aws]\n'
                                           'region = "us-east-1"\n')  # fmt: skip
    res = run_cli("up")
    # and the existing SSH rule follows it (spotctl/providers/aws/network.py)
    assert seen == [("192.0.2.9/32", {"follow_ssh_cidr": True})]
    assert ("up: aws.ssh_cidr not set: SSH allowed from this machine's public address "
            "192.0.2.9/32 (from $SPOTCTL_CONTROLLER_ADDRESS)") in res.stderr
    assert res.exit_code != 0 and "stopped by the test" in str(res.exception)


def test_init_spec_mentions_ssh_cidr(run_cli: Any, tmp_path: Any) -> None:
    res = run_cli("init", str(tmp_path / "p"))
    assert res.exit_code == 0, res.output
    text = (tmp_path / "p" / "spotctl.toml").read_text()
    assert "ssh_cidr" in text and "public address" in text
