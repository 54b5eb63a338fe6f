"""9 and 10: capacity and API faults.

9 runs the way it meets users: a 3-node local cluster trains, the local "cloud" takes a
node back (its capacity drops to 2: a GCP-style notice), the replacement `up` meets the
exhausted pool while the job trains at 2, capacity comes back and `up` restores 3; the
figures are measured on that job, on either engine: on torchrun from the head's rescale
events (a drain each time) and, for the replays, the workers' own sample trace
(scripts/chaos_lib/replays.py), on torchft from the replicas' own step logs (the reclaimed
replica's graceful leave, the joiner's heal from a live peer; scripts/chaos_lib/ft.py). The same scenario's cloud API half runs against the GCP
test server (tests/gcp/fake_compute.py) with the real GcpProvider and google-cloud-compute
client over REST: every zone exhausted gives one clear CapacityError per zone and leaves
nothing behind.

10 (429 and 5xx from the API) is a provider-level check only: no job trains while it runs,
so the job figures are reported as not applicable (null), never as 0, and no engine is
involved (`--engine torchft` runs it the same).

Neither touches the caller's environment: SPOTCTL_HOME is passed to the provider's
context, never set in os.environ.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from .result import Result

NOT_A_JOB = ["committed_steps_lost", "steps_replayed"]

REPO = Path(__file__).resolve().parents[2]


def _provider(fake, home: Path, zones: list[str]):
    from spotctl.providers.base import ProviderContext
    from spotctl.providers.gcp.provider import GcpProvider
    from spotctl.spec import ClusterSpec
    from spotctl.state import ClusterDir

    spec = ClusterSpec.model_validate(
        {
            "name": "chaos",
            "provider": "gcp",
            "gcp": {
                "project": "chaos-proj",
                "region": "us-central1",
                "zones": zones,
                "ssh_cidr": "203.0.113.7/32",
            },
        }
    )
    ctx = ProviderContext(
        cluster="chaos",
        spec=spec,
        cluster_dir=ClusterDir(home, "chaos").ensure(),
        options={
            "gcp_endpoint": fake.endpoint,
            "gcp_backoff_base": 0.05,
            "gcp_backoff_max": 0.2,
            "gcp_poll_interval": 0.01,
            "gcp_op_timeout": 30,
            "head_process": False,
            "host_key_wait_s": 1.0,  # the fake publishes no host keys
        },
    )
    return GcpProvider(ctx)


def _offer(p, zone: str):
    return next(
        o
        for o in p.offers()
        if o.zone == zone
        and o.instance_type == "n1-standard-8"
        and o.gpu_name == "T4"
        and o.gpus == 1
    )


def _fake():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.gcp.fake_compute import FakeCompute

    return FakeCompute()


def _capacity_api(res: Result) -> bool:
    """The API half of 9: every GCP zone exhausted (one with a 503-flavoured variant)."""
    from spotctl.errors import CapacityError

    zones = ["us-central1-a", "us-central1-b"]
    with tempfile.TemporaryDirectory() as tmp, _fake() as fake:
        p = _provider(fake, Path(tmp), zones)
        fake.exhaust(zones[0])
        fake.exhaust(zones[1], "http503")
        msgs: dict[str, str] = {}
        try:
            for z in zones:  # the reconciler tries every zone in turn
                try:
                    p.launch(_offer(p, z), 1, f"req-{z}")
                except CapacityError as e:
                    msgs[z] = str(e)
        except Exception as e:
            res.detail["api"] = {"error": f"wrong error type {type(e).__name__}: {e}"}
            return False
        leaked = list(fake.instances)
        fake.exhausted.clear()  # capacity comes back
        insts = p.launch(_offer(p, zones[0]), 1, "req-later")
        res.leaks += [f"instance {i} left by a failed launch" for i in leaked]
        clear = sorted(msgs) == zones and all(z in m and "\n" not in m for z, m in msgs.items())
        ok = clear and not leaked and len(insts) == 1 and len(p.list("chaos")) == 1
        res.detail["api"] = {"errors": msgs, "later_launch": [i.id for i in insts], "ok": ok}
        p.terminate([i.id for i in insts])
    return ok


def capacity_everywhere(root: Path, engine: str = "torchrun") -> Result:
    """9: the pool runs out while the job trains: a reclaimed node, a replacement that
    cannot launch, training at reduced size meanwhile, and the join once capacity is back.
    On torchft the survivors must go on from memory through both (no replica restarted)."""
    from collections.abc import Callable

    from spotctl.providers.local.capacity import set_capacity

    from . import ft, local
    from .cluster import Cluster

    res = Result("9 capacity exhausted while training", notice=True)
    api_ok = _capacity_api(res)
    env = {"TRAIN_DATASET_SIZE": "4096", "TRAIN_GLOBAL_BATCH": "24"}
    script = None
    if engine == "torchft":  # the replicas log each step attempt: the figures come from it
        (root / "capacity" / "steps").mkdir(parents=True, exist_ok=True)
        env["CHAOS_STEP_LOG"] = f"{root / 'capacity' / 'steps'}/{{node}}.jsonl"
        script = ft.SCRIPT
    c = Cluster(
        root / "capacity",
        "cap",
        "2..3",
        local.EVERY,
        train_env=env,
        # cooldown 0: the replacement tries the reclaimed zone again at once
        extra_toml="\n[rebalance]\ncooldown_s = 0\n\n[local]\ncapacity = [{ at_s = 0, nodes = 3 }]\n",
        engine=engine,
        script=script,
    )

    def _cycle(c: Cluster, r: Result, fault: Callable[[], None], world: int) -> None:
        if engine == "torchft":  # nobody restarts: a node that left keeps its last pid
            ft._cycle(c, r, fault, world, gone=set())
        else:
            local._cycle(c, r, fault, world)
    try:
        c.up()
        c.training(3, past=local.EVERY + 2, timeout=240)
        # the cloud takes one node back: notice, drain, the job goes on at 2
        reclaim = Result("reclaim", notice=True)
        _cycle(c, reclaim, lambda: set_capacity(c.cluster_dir, 2), 2)
        res.detail["reclaim"] = reclaim.detail | {"recover_s": reclaim.recover_s}
        # the reclaimed node counts until its hard stop, as on a cloud: from then on the
        # pool is exhausted with the job at 2. It has drained and left: its hard stop (GCP
        # style, 30 s after the notice) is brought forward to 1 s from now (the local cloud
        # keeps the earliest deadline; the head ignores a second notice), not waited out.
        for node in sum((e.get("nodes") or [] for e in c.events("capacity-reclaim")), []):
            c.cli("preempt", node, "--name", "cap", "--style", "aws", "--in", "1", check=False)
        deadline = time.monotonic() + 90
        while len(c.live_nodes()) > 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reclaimed node still alive: {c.live_nodes()}")
            time.sleep(1)
        # the replacement meets the exhausted pool; the job trains at 2 meanwhile
        st0 = c.status()
        t0 = time.time()
        up = c.cli("up", "--json", "--wait", "30", check=False, timeout=200)
        up_out = _json(up.stdout)
        st1 = c.training(2, past=st0["step"] + 5, timeout=120)
        exhausted_s = round(time.time() - t0, 1)
        launched_while_full = list(up_out.get("launched") or [])
        res.detail["exhausted_up"] = {"rc": up.returncode, "out": up_out,
                                      "stderr": up.stderr.strip()[-300:]}  # fmt: skip
        # capacity back: `up` joins a third node through a drain
        join = Result("join", notice=True)

        def back() -> None:
            set_capacity(c.cluster_dir, 3)
            p = c.cli("up", "--json", "--wait", "150", check=False, timeout=240)
            res.detail["back_up"] = {"rc": p.returncode, "out": _json(p.stdout),
                                     "stderr": p.stderr.strip()[-500:]}  # fmt: skip

        _cycle(c, join, back, 3)
        res.recover_s = join.recover_s  # capacity back -> training at 3 again
        res.committed_steps_lost = max(reclaim.committed_steps_lost or 0,
                                       join.committed_steps_lost or 0)  # fmt: skip
        res.steps_replayed = (reclaim.steps_replayed or 0) + (join.steps_replayed or 0)
        res.detail.update(
            engine=engine,
            steps_at_2_while_exhausted=st1["step"] - st0["step"],
            seconds_exhausted=exhausted_s,  # failed `up`, then 5+ steps at 2
            join=join.detail,
        )  # fmt: skip
        res.survived = (
            api_ok
            and reclaim.survived
            and join.survived
            and up.returncode == 0
            and not launched_while_full
            and st1["world_size"] == 2
        )
        res.notes = (
            f"reclaimed at 2 in {reclaim.recover_s}s; up while exhausted launched "
            f"{len(launched_while_full)}; trained {st1['step'] - st0['step']} steps at 2; "
            f"back at 3 in {join.recover_s}s"
        )
    except Exception as e:
        res.survived = False
        res.notes = f"{type(e).__name__}: {str(e)[:200]}"
        res.detail["error"] = str(e)[-4000:]
        try:
            res.detail["events"] = c.events()[-30:]
        except Exception:
            pass
    finally:
        res.leaks += c.down()
    return res


def _json(text: str) -> dict:
    import json

    try:
        out = json.loads(text)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def throttling() -> Result:
    """10: 429 and 5xx on insert and list: retried with backoff, then succeeds."""
    # no job trains here: lost and replayed steps do not apply (null, never 0)
    res = Result("10 API throttling and 5xx (provider only)", not_applicable=list(NOT_A_JOB))
    with tempfile.TemporaryDirectory() as tmp, _fake() as fake:
        p = _provider(fake, Path(tmp), ["us-central1-a"])
        fake.fail("instances.insert", 429, "rateLimitExceeded", times=2)
        fake.fail("instances.aggregatedList", 503, "backendError", times=2)
        t0 = time.time()
        try:
            insts = p.launch(_offer(p, "us-central1-a"), 1, "req-t")
        except Exception as e:
            res.notes = f"{type(e).__name__}: {e}"
            return res
        res.recover_s = round(time.time() - t0, 2)
        inserts = len(fake.calls("instances.insert"))
        lists = len(fake.calls("instances.aggregatedList"))
        res.survived = len(insts) == 1 and inserts == 3 and len(fake.instances) == 1
        res.detail = {"insert_calls": inserts, "list_calls": lists}
        res.notes = f"insert tried {inserts}x, list {lists}x, then launched"
        p.terminate([i.id for i in insts])
    return res
