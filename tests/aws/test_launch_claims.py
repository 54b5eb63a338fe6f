"""The AWS claims (docs/getting-started/aws.md), each exercised against moto through the fault proxy: one
all-or-nothing run_instances per planned offer, failover to the next instance type,
backoff on throttling, IMDSv2 with hop limit 1 on the head too."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import pytest

from spotctl.providers.aws.launch import launch_with_failover

from .conftest import FaultProxy, Rule

pytestmark = pytest.mark.aws

TYPES = ["g5.xlarge", "g4dn.xlarge"]
MakeProvider = Callable[..., Any]


def _form(body: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in body.split(" ") if "=" in kv)


def _via(make_provider: MakeProvider, proxy: FaultProxy, **opts: Any) -> Any:
    return make_provider(instance_types=TYPES, options={"endpoint_url": proxy.url, **opts})


def test_one_all_or_nothing_run_instances_per_planned_offer(
    make_provider: MakeProvider, fault_proxy: FaultProxy
) -> None:
    p = _via(make_provider, fault_proxy)
    offer = next(o for o in p.offers() if o.instance_type == "g5.xlarge")
    got = p.launch(offer, 3, "req-aon")
    assert len(got) == 3
    (call,) = fault_proxy.calls("RunInstances")  # one call for the whole offer
    form = _form(call)
    assert (form["MinCount"], form["MaxCount"]) == ("3", "3"), form  # all or nothing


def test_capacity_error_fails_over_to_the_next_instance_type(
    make_provider: MakeProvider, fault_proxy: FaultProxy
) -> None:
    p = _via(make_provider, fault_proxy)
    offers = p.offers()
    zone = next(o.zone for o in offers if o.instance_type == "g5.xlarge")
    first = next(o for o in offers if o.instance_type == "g5.xlarge" and o.zone == zone)
    second = next(o for o in offers if o.instance_type == "g4dn.xlarge" and o.zone == zone)
    fault_proxy.rules.append(
        Rule("RunInstances", "InsufficientInstanceCapacity", 500, match="InstanceType=g5.xlarge")
    )
    offer, got = launch_with_failover(p, [first, second], 1, "req-type")
    assert offer == second and {i.zone for i in got} == {zone}
    tried = [_form(b)["InstanceType"] for b in fault_proxy.calls("RunInstances")]
    assert tried == ["g5.xlarge", "g4dn.xlarge"], tried


def test_throttling_backs_off_before_each_retry(
    make_provider: MakeProvider, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    from spotctl.providers.aws import api

    slept: list[float] = []
    # the real clock, with every sleep the API client takes recorded
    spy = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    spy.sleep = lambda s: (slept.append(s), time.sleep(s))[1]
    monkeypatch.setattr(api, "time", spy)
    p = _via(make_provider, fault_proxy, retry_base_s=0.2)
    fault_proxy.rules.append(Rule("DescribeSpotPriceHistory", "RequestLimitExceeded", 503, times=2))
    assert p.offers()
    assert len(fault_proxy.calls("DescribeSpotPriceHistory", faulted=True)) == 2
    # base 0.2 s, doubling, jittered into [cap/2, cap]: one wait before each retry
    assert len(slept) == 2, slept
    assert 0.1 <= slept[0] <= 0.2 and 0.2 <= slept[1] <= 0.4, slept


def test_head_requires_imdsv2_with_hop_limit_1(make_provider: MakeProvider, ec2: Any) -> None:
    p = make_provider(instance_types=TYPES)
    head = p.ensure_head()
    (raw,) = [
        i
        for r in ec2.describe_instances(InstanceIds=[head.instance_id])["Reservations"]
        for i in r["Instances"]
    ]
    assert raw["MetadataOptions"]["HttpTokens"] == "required"
    assert raw["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
    p.terminate([head.instance_id])


def test_form_parser_reads_the_proxy_body() -> None:
    body = " ".join(f"{k}={v[0]}" for k, v in parse_qs("Action=RunInstances&MinCount=2").items())
    assert _form(body) == {"Action": "RunInstances", "MinCount": "2"}
