"""Capacity, quota, auth and throttling errors: real botocore over HTTP to a fault proxy
that answers chosen calls with EC2 error bodies and forwards the rest to moto."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotctl.errors import AuthError, CapacityError, QuotaError, TransientError
from spotctl.providers.aws.launch import launch_with_failover
from spotctl.providers.aws.provider import AwsProvider

from .conftest import FaultProxy, Rule

pytestmark = pytest.mark.aws

TYPES = ["g5.xlarge", "p4d.24xlarge"]
MakeProvider = Callable[..., AwsProvider]


def _via(make_provider: MakeProvider, proxy: FaultProxy, **kw: Any) -> AwsProvider:
    return make_provider(instance_types=TYPES, options={"endpoint_url": proxy.url}, **kw)


def _zones(p: AwsProvider, itype: str = "g5.xlarge") -> list[Any]:
    return sorted((o for o in p.offers() if o.instance_type == itype), key=lambda o: o.zone)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("InsufficientInstanceCapacity", 500),
        ("SpotMaxPriceTooLow", 400),
        ("UnfulfillableCapacity", 400),
        ("InsufficientCapacity", 500),
    ],
)
def test_capacity_error_fails_over_to_next_zone_without_retrying(
    make_provider: MakeProvider, fault_proxy: FaultProxy, code: str, status: int
) -> None:
    p = _via(make_provider, fault_proxy)
    first, second = _zones(p)[:2]
    fault_proxy.rules.append(Rule("RunInstances", code, status, match=first.zone))
    offer, got = launch_with_failover(p, [first, second], 2, "req-fo")
    assert offer == second
    assert {i.zone for i in got} == {second.zone} and len(got) == 2
    # One try in the full zone: capacity errors are never retried with backoff.
    assert len(fault_proxy.calls("RunInstances", faulted=True)) == 1
    assert len(fault_proxy.calls("RunInstances", faulted=False)) == 1


def test_capacity_everywhere_is_one_line_naming_each_offer(
    make_provider: MakeProvider, fault_proxy: FaultProxy
) -> None:
    p = _via(make_provider, fault_proxy)
    offers = _zones(p)[:3]
    fault_proxy.rules.append(Rule("RunInstances", "InsufficientInstanceCapacity", 500))
    with pytest.raises(CapacityError) as err:
        launch_with_failover(p, offers, 1, "req-none")
    msg = str(err.value)
    assert "\n" not in msg
    for o in offers:
        assert f"g5.xlarge in {o.zone} (InsufficientInstanceCapacity)" in msg
    assert len(fault_proxy.calls("RunInstances")) == 3
    assert p.list(p.ctx.cluster) == []


def test_capacity_error_message_names_offer_and_zone(
    make_provider: MakeProvider, fault_proxy: FaultProxy
) -> None:
    p = _via(make_provider, fault_proxy)
    offer = _zones(p)[0]
    fault_proxy.rules.append(Rule("RunInstances", "InsufficientInstanceCapacity", 500))
    with pytest.raises(
        CapacityError,
        match=rf"g5\.xlarge .*in {offer.zone}: "
        "InsufficientInstanceCapacity",
    ):
        p.launch(offer, 1, "req-msg")


@pytest.mark.parametrize(
    "code", ["VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"]
)
def test_quota_stops_the_walk_with_one_line(
    make_provider: MakeProvider, fault_proxy: FaultProxy, code: str
) -> None:
    p = _via(make_provider, fault_proxy)
    offers = _zones(p)[:3]
    fault_proxy.rules.append(Rule("RunInstances", code, 400))
    with pytest.raises(QuotaError) as err:
        launch_with_failover(p, offers, 1, "req-q")
    assert "\n" not in str(err.value) and code in str(err.value)
    assert offers[0].zone in str(err.value)
    if code == "MaxSpotInstanceCountExceeded":  # the spot vCPU quota, named by its code
        assert "L-3819A6DF" in str(err.value)
    assert len(fault_proxy.calls("RunInstances")) == 1  # no other zone was tried


@pytest.mark.parametrize(("code", "status"), [("UnauthorizedOperation", 403), ("AuthFailure", 401)])
def test_auth_errors_stop_with_one_line(
    make_provider: MakeProvider, fault_proxy: FaultProxy, code: str, status: int
) -> None:
    p = _via(make_provider, fault_proxy)
    fault_proxy.rules.append(Rule("DescribeInstanceTypes", code, status))
    with pytest.raises(AuthError, match=code) as err:
        p.offers()
    assert "\n" not in str(err.value)
    assert len(fault_proxy.calls("DescribeInstanceTypes")) == 1


def test_missing_credentials_is_an_auth_error(
    make_provider: MakeProvider, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(AuthError, match="no usable credentials"):
        make_provider(instance_types=TYPES).offers()


@pytest.mark.parametrize(
    ("code", "status"),
    [("RequestLimitExceeded", 503), ("Throttling", 400), ("InternalError", 500), ("Weird", 502)],
)
def test_throttling_and_5xx_are_retried_then_succeed(
    make_provider: MakeProvider, fault_proxy: FaultProxy, code: str, status: int
) -> None:
    p = _via(make_provider, fault_proxy)
    fault_proxy.rules.append(Rule("DescribeSpotPriceHistory", code, status, times=2))
    offers = p.offers()
    assert offers
    assert len(fault_proxy.calls("DescribeSpotPriceHistory", faulted=True)) == 2
    assert len(fault_proxy.calls("DescribeSpotPriceHistory", faulted=False)) == 1


def test_persistent_throttling_gives_up_as_transient(
    make_provider: MakeProvider, fault_proxy: FaultProxy
) -> None:
    p = make_provider(
        instance_types=TYPES, options={"endpoint_url": fault_proxy.url, "retry_attempts": 3}
    )
    fault_proxy.rules.append(Rule("DescribeSpotPriceHistory", "RequestLimitExceeded", 503))
    with pytest.raises(TransientError, match="gave up after 3 tries") as err:
        p.offers()
    assert err.value.retryable
    assert len(fault_proxy.calls("DescribeSpotPriceHistory")) == 3


def test_unreachable_endpoint_is_transient(make_provider: MakeProvider) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = make_provider(
        instance_types=TYPES,
        options={"endpoint_url": f"http://127.0.0.1:{port}", "retry_attempts": 2},
    )
    with pytest.raises(TransientError, match="cannot reach EC2 after 2 tries"):
        p.offers()


def test_cleanup_goes_on_after_an_error_and_names_what_is_left(
    make_provider: MakeProvider, fault_proxy: FaultProxy, ec2: Any, moto_url: str
) -> None:
    """`down` after a partial failure: TerminateInstances refused (an identity without
    ec2:TerminateInstances), yet the key pair and the workers' role and profile are still
    removed, and what is left (the instances, their security group) is named, not hidden
    behind the first error."""
    import boto3

    p = _via(make_provider, fault_proxy)
    p.prepare()  # key pair, security group, the workers' role and profile
    p.launch(_zones(p)[0], 1, "req-td")
    fault_proxy.rules.append(Rule("TerminateInstances", "UnauthorizedOperation", 403))
    leaks = p.cleanup()
    assert any(x.startswith("terminate instances:") and "UnauthorizedOperation" in x
               for x in leaks), leaks
    [inst] = [i.id for i in p.list(p.ctx.cluster)]
    assert any(inst in x and "still not terminated" in x for x in leaks), leaks
    flt = [{"Name": "tag:spotctl:cluster", "Values": [p.ctx.cluster]}]
    assert ec2.describe_key_pairs(Filters=flt)["KeyPairs"] == []
    iam = boto3.client("iam", region_name="us-east-1", endpoint_url=moto_url)
    assert p.node_profile not in [r["RoleName"] for r in iam.list_roles()["Roles"]]
    assert p.node_profile not in [x["InstanceProfileName"]
                                  for x in iam.list_instance_profiles()["InstanceProfiles"]]
    # once the refusal is gone, down finishes the job
    fault_proxy.rules.clear()
    assert p.cleanup() == []
