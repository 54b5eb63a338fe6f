"""Control plane: launching 64 nodes on (moto's) EC2, bootstrapping 64 nodes over SSH
(bench_lib.bootstrap: a real loopback sshd and head), planning 1,000 nodes x 500 offers,
rendering `status` for 64 nodes.

`up` of 64 nodes: spotctl's launch path is what `up` does against the cloud API before
the SSH bootstrap - prepare (security group, key pair), live offers, the planner, then
one all-or-nothing `run_instances` per planned offer (AwsProvider.launch, with its
idempotency lookup), and a final `list`. The baseline is the loop a script without a
planner would run: `run_instances` for one instance at a time, 64 times in a row, with
the same image, type, zone, market options and tags. Both talk HTTP to a moto server on
127.0.0.1 (ThreadedMotoServer, as tests/aws do), so the figures measure client-side work
and API round trips, not EC2's own latency.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .core import Context, Row, row

REGION = "us-east-1"
ITYPE = "g4dn.xlarge"  # 1 GPU: 64 nodes = 64 instances
_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
}


@contextmanager
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per call
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    keys = [*_ENV, "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(_ENV, AWS_ENDPOINT_URL=url)
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    try:
        yield url
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _provider(ctx: Context, url: str, ami: str, name: str, gpus: int) -> Any:
    from spotctl.providers import ProviderContext
    from spotctl.providers.aws.provider import create
    from spotctl.spec import ClusterSpec
    from spotctl.state import Store

    store = Store(ctx.subdir("control-home"))
    spec = ClusterSpec.model_validate(
        {
            "name": name,
            "provider": "aws",
            "gpus": f"{gpus}..{gpus}",
            "aws": {
                "region": REGION,
                "ami": ami,
                "ssh_cidr": "198.51.100.7/32",
                "instance_types": [ITYPE],
            },
        }
    )
    pctx = ProviderContext(
        cluster=name,
        spec=spec,
        cluster_dir=store.cluster_dir(name).ensure(),
        options={"endpoint_url": url, "poll_s": 0.01, "retry_base_s": 0.01},
    )
    return create(pctx), spec


def spotctl_up(ctx: Context, url: str, ami: str, nodes: int) -> tuple[float, int]:
    """spotctl's launch path for `nodes` 1-GPU nodes; (seconds, instances running)."""
    from spotctl.control.planner import Observed, plan

    name = f"b{uuid.uuid4().hex[:8]}"
    prov, spec = _provider(ctx, url, ami, name, nodes)
    t = time.perf_counter()
    prov.prepare()
    offers = prov.offers()
    p = plan(spec, Observed(), offers, {}, time.time())
    for a in p.launches:
        assert a.offer is not None
        prov.launch(a.offer, a.count, f"{name}-{uuid.uuid4().hex[:10]}")
    live = prov.list(name)
    dt = time.perf_counter() - t
    prov.terminate([i.id for i in live])
    return dt, len(live)


def serial_up(ctx: Context, url: str, ami: str, nodes: int) -> tuple[float, int]:
    """The baseline loop: one run_instances per instance, in a row."""
    import boto3

    name = f"s{uuid.uuid4().hex[:8]}"
    prov, _ = _provider(ctx, url, ami, name, nodes)
    prov.prepare()  # same security group and key as spotctl's; not timed
    group, key = prov._prepared
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=url)
    zone = ec2.describe_availability_zones()["AvailabilityZones"][0]["ZoneName"]
    tags = [{"Key": "spotctl:cluster", "Value": name}]
    t = time.perf_counter()
    ids = []
    for _ in range(nodes):
        r = ec2.run_instances(
            ImageId=ami,
            InstanceType=ITYPE,
            MinCount=1,
            MaxCount=1,
            KeyName=key,
            SecurityGroupIds=[group],
            Placement={"AvailabilityZone": zone},
            InstanceMarketOptions={
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            },
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
        ids.append(r["Instances"][0]["InstanceId"])
    resv = ec2.describe_instances(
        Filters=[
            {"Name": "tag:spotctl:cluster", "Values": [name]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
    )
    n = sum(len(x["Instances"]) for x in resv["Reservations"])
    dt = time.perf_counter() - t
    ec2.terminate_instances(InstanceIds=ids)
    return dt, n


def planner_case(nodes: int, offers: int) -> tuple[Any, Any, list[Any]]:
    """A cluster of `nodes` 1-GPU nodes that may grow by 20 %, over `offers` offers in
    10 zones at varied prices, some with a capacity limit, some zones cooling down."""
    from spotctl.control.planner import Observed, ObservedNode
    from spotctl.providers.base import Offer
    from spotctl.spec import ClusterSpec

    zones = [f"r1-{chr(97 + i)}" for i in range(10)]
    spec = ClusterSpec.model_validate(
        {
            "name": "p",
            "gpus": f"{nodes}..{nodes + nodes // 5}",
            "rebalance": {"replace_saving_pct": 30},
        }
    )
    obs = Observed(
        nodes=tuple(
            ObservedNode(
                id=f"n{i}",
                zone=zones[i % 10],
                region="r1",
                instance_type="g1",
                gpus=1,
                price=1.0 + (i % 7) * 0.05,
                state="running" if i % 50 else "lost",
            )
            for i in range(nodes)
        )
    )
    offs = [
        Offer(
            provider="aws",
            region="r1" if i % 5 else "r2",
            zone=zones[i % 10],
            instance_type=f"g{1 + i % 4}",
            gpus=1 + i % 4,
            gpu_name="A10G",
            spot_price=round(0.5 + (i * 37 % 100) / 50, 4),
            on_demand_price=4.0,
            interruption_band=i % 5,
            available=None if i % 3 else 5 + i % 11,
        )
        for i in range(offers)
    ]
    return spec, obs, offs


def time_planner(nodes: int, offers: int) -> float:
    from spotctl.control.planner import plan

    spec, obs, offs = planner_case(nodes, offers)
    blocked = {"r1-c": 2e9}
    t = time.perf_counter()
    plan(spec, obs, offs, blocked, 1e9)
    return time.perf_counter() - t


def status_snapshot(nodes: int) -> dict[str, Any]:
    """What spotctl.control.status.collect returns for a cluster of `nodes` running nodes."""
    states = ["running"] * 8 + ["joining", "draining"]
    return {
        "cluster": "bench",
        "provider": "aws",
        "state": "running",
        "gpus": {"now": nodes, "min": nodes // 2, "max": nodes},
        "world_size": nodes,
        "step": 123456,
        "last_checkpoint_step": 123400,
        "loss": 0.0123,
        "throughput": 5120.0,
        "cost_per_hour": nodes * 0.526,
        "cost": {"spent_usd": 812.5, "on_demand_usd": 2480.0, "saved_usd": 1667.5},
        "drain": None,
        "head_error": None,
        "nodes": [
            {
                "id": f"i-{i:017x}",
                "provider": "aws",
                "zone": f"us-east-1{'abcdf'[i % 5]}",
                "instance_type": ITYPE,
                "gpus": 1,
                "state": states[i % 10],
                "uptime_s": 3600.0 + i * 61,
                "heartbeat_age_s": 0.2 + (i % 4) / 10,
                "step": 123456 - i % 3,
                "price": 0.526,
                "notice": i % 17 == 0,
            }
            for i in range(nodes)
        ],
    }


def time_render(snap: dict[str, Any], as_json: bool) -> float:
    from rich.console import Console

    from spotctl.control.status import render

    buf = io.StringIO()
    con = Console(file=buf, width=160, force_terminal=True, color_system="truecolor")
    t = time.perf_counter()
    if as_json:
        buf.write(json.dumps(snap, indent=2))
    else:
        con.print(render(snap))
    return time.perf_counter() - t


def bootstrap_rows(
    ctx: Context, nodes: int, launch: list[float], launch_base: list[float],
    install_s: float | None = None,
) -> list[Row]:
    """SSH bootstrap of `nodes` nodes (spotctl vs serial vs 8 slots held to heartbeat),
    launch + bootstrap, and the node package build."""
    from . import bootstrap as bs

    why = bs.available()
    if why:
        ctx.log(f"control: SSH bootstrap skipped: {why}")
        return []
    n = ctx.reps(1)
    ctx.log(f"control: SSH bootstrap of {nodes} nodes (loopback sshd, real head), {n} time(s)")
    install_s = bs.INSTALL_S if install_s is None else install_s
    t = bs.measure(ctx, nodes, n, install_s)
    ours, serial, old8 = t["spotctl"], t["serial"], t["old8"]
    k = min(len(ours), len(serial), len(launch), len(launch_base))
    rows = [
        row("control", f"bootstrap: {nodes} nodes over SSH", ours, serial, "s",
            "to the last first heartbeat; spotctl: 32 SSH slots, heartbeats awaited outside "
            "them; baseline: one host at a time (stand-in agent, deps present: see "
            "bench_lib/bootstrap.py)"),
        row("control", f"bootstrap: {nodes} nodes vs 8 slots held", ours, old8, "s",
            "baseline: the previous scheme, 8 slots each held until its host's heartbeat"),
        row("control", f"bootstrap: {nodes} nodes, {install_s:g} s installs", t["spotctl+install"],
            t["old8+install"], "s",
            "each host's install takes that long on its side (a sleep: a cloud host installs "
            "on its own CPU); baseline: 8 slots each held until its host's heartbeat"),
        row("control", f"up: launch + bootstrap {nodes} nodes", [launch[i] + ours[i] for i in range(k)],
            [launch_base[i] + serial[i] for i in range(k)], "s",
            "launch row (moto) + bootstrap row, per repetition; baseline: serial both"),
    ]  # fmt: skip
    cold, warm = bs.package_times(ctx.work)
    rows.append(row("control", "node package: wheel + wheelhouse", [warm], [cold], "s",
                    "spotctl: cached (new process); baseline: cold build (pip wheel of the "
                    "source tree, dependencies repacked)"))  # fmt: skip
    return rows


def bench(
    ctx: Context,
    nodes: int = 64,
    plan_nodes: int = 1000,
    plan_offers: int = 500,
    repeat: int | None = None,
    install_s: float | None = None,
) -> list[Row]:
    n = ctx.reps(5) if repeat is None else repeat
    rows: list[Row] = []
    ours: list[float] = []
    base: list[float] = []
    counts: set[tuple[int, int]] = set()
    ctx.log(f"control: up of {nodes} nodes on a moto server, {n} time(s) each way")
    with moto_server() as url:
        import boto3

        ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=url)
        ami = str(ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"])
        spotctl_up(ctx, url, ami, 1)  # warm both clients' imports and moto's caches
        for _ in range(n):
            dt, a = spotctl_up(ctx, url, ami, nodes)
            ours.append(dt)
            dt2, b = serial_up(ctx, url, ami, nodes)
            base.append(dt2)
            counts.add((a, b))
    bad = [c for c in counts if c != (nodes, nodes)]
    rows.append(
        row(
            "control",
            f"up: launch {nodes} nodes (moto)",
            ours,
            base,
            "s",
            "spotctl: prepare+offers+plan+batched run_instances per offer; baseline: "
            f"{nodes} serial 1-instance run_instances"
            + (f"; WARNING instance counts {bad}" if bad else ""),
        )
    )
    rows += bootstrap_rows(ctx, nodes, ours, base, install_s)
    ctx.log(f"control: planner {plan_nodes} nodes x {plan_offers} offers")
    time_planner(plan_nodes, plan_offers)  # warm
    pl = [time_planner(plan_nodes, plan_offers) * 1000 for _ in range(max(n, 5))]
    rows.append(
        row(
            "control",
            f"planner: {plan_nodes:,} nodes x {plan_offers} offers",
            pl,
            [],
            "ms",
            "spotctl.control.planner.plan (pure); no baseline",
        )
    )
    snap = status_snapshot(nodes)
    time_render(snap, False)
    rs = [time_render(snap, False) * 1000 for _ in range(max(n, 5))]
    js = [time_render(snap, True) * 1000 for _ in range(max(n, 5))]
    rows.append(
        row(
            "control",
            f"status render: {nodes} nodes",
            rs,
            js,
            "ms",
            "rich table (spotctl.control.status.render) vs json.dumps of the same snapshot",
        )
    )
    return rows
