"""Host keys out of band on AWS: cloud-init's console block parsed and pinned; moto's
console output has no such block, so nothing is pinned there (trust on first use stays)."""

from __future__ import annotations

import base64
from collections.abc import Callable

import pytest

from spotctl.providers.aws.provider import AwsProvider
from spotctl.providers.base import Offer
from spotctl.providers.hostkeys import parse_console_keys

from .conftest import REGION

pytestmark = pytest.mark.aws

ED = base64.b64encode(b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + b"k" * 32).decode()
CONSOLE = f"""[   12.3] cloud-init[812]: Cloud-init v. 24.1 running 'modules:final'
ec2: #############################################################
-----BEGIN SSH HOST KEY KEYS-----
ssh-ed25519 {ED} root@ip-10-0-0-7
ssh-rsa not-a-key root@ip-10-0-0-7
-----END SSH HOST KEY KEYS-----
ec2: #############################################################
"""


def test_console_block_is_parsed_and_bad_keys_dropped() -> None:
    assert parse_console_keys(CONSOLE) == [("ssh-ed25519", ED)]
    assert parse_console_keys("no block here") == []
    # a block whose key names another type than its line says is refused
    assert parse_console_keys(CONSOLE.replace("ssh-ed25519 " + ED, "ssh-rsa " + ED)) == []


def test_console_without_keys_pins_nothing(make_provider: Callable[..., AwsProvider]) -> None:
    p = make_provider()
    offer = Offer(provider="aws", region=REGION, zone=f"{REGION}a", instance_type="g5.xlarge",
                  gpus=1, gpu_name="A10G", spot_price=0.5)  # fmt: skip
    [inst] = p.launch(offer, 1, "hk")
    assert p.console_host_keys(inst.id) == []
    p._pin_host_keys(inst, fresh=False)
    assert not p.ctx.cluster_dir.known_hosts.exists()
    # a fresh instance on an address another one had: that one's pin goes (the first
    # connection then pins on first use, instead of failing on a changed key for good)
    kh = p.ctx.cluster_dir.known_hosts
    kh.write_text(f"{inst.public_address} ssh-ed25519 {ED}\nother ssh-ed25519 {ED}\n")
    p._pin_host_keys(inst)
    assert kh.read_text() == f"other ssh-ed25519 {ED}\n"
    assert p.cleanup() == []


def test_a_type_without_the_latest_console_gives_the_buffered_one(
    make_provider: Callable[..., AwsProvider], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Only Nitro types serve the latest console output; others answer
    UnsupportedOperation to Latest=True (it was taken for "no keys")."""
    from botocore.exceptions import ClientError

    p = make_provider()
    calls: list[dict[str, object]] = []

    def console(**kw: object) -> dict[str, object]:
        calls.append(kw)
        if kw.get("Latest"):
            raise ClientError({"Error": {"Code": "UnsupportedOperation",
                                         "Message": "not supported"}}, "GetConsoleOutput")
        return {"Output": CONSOLE}

    monkeypatch.setattr(p.ec2, "get_console_output", console)
    assert p.console_host_keys("i-0abc") == [("ssh-ed25519", ED)]
    assert [c.get("Latest") for c in calls] == [True, None]


def test_the_heads_loop_pins_the_private_address_it_connects_to(
    make_provider: Callable[..., AwsProvider], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """From the controller SSH goes to a node's public address, from the head (its own
    reconcile loop) to its private one: the keys are pinned for the address used."""
    from spotctl.providers.base import Instance

    inst = Instance(id="i-1", cluster="c", role="worker", zone=f"{REGION}a",
                    instance_type="g5.xlarge", gpus=1, state="running", request_id="r",
                    address="10.0.0.7", public_address="203.0.113.7")  # fmt: skip
    for on_head, pinned, other in (("", "203.0.113.7", "10.0.0.7"),
                                   ("i-0head", "10.0.0.7", "203.0.113.7")):  # fmt: skip
        p = make_provider(options={"on_head": on_head})
        monkeypatch.setattr(p, "console_host_keys", lambda _id: [("ssh-ed25519", ED)])
        p._pin_host_keys(inst)
        text = p.ctx.cluster_dir.known_hosts.read_text()
        assert pinned in text and other not in text, text
