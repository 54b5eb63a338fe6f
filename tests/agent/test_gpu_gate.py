"""The GPU gate (spotctl.agent.gpugate): on a GPU type no worker starts until nvidia-smi
lists the type's GPUs and torch sees them; otherwise the node says why to the head and
starts nothing. nvidia-smi is a stand-in executable on PATH that answers like the real
one: one name per GPU for `--query-gpu=name --format=csv,noheader`, exit 9 with the
driver's message when the driver is not loaded, exit 6 when no device is found, exit 2
for arguments it does not know."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from spotctl.agent import gpugate
from spotctl.agent.config import AgentConfig
from spotctl.agent.supervisor import Agent
from spotctl.control import reconcile
from spotctl.control.planner import plan
from spotctl.head.auth import node_token
from spotctl.head.client import HeadClient
from spotctl.providers.base import Instance
from spotctl.spec import ClusterSpec
from spotctl.state import Store
from tests.security.conftest import serve_head

NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")


def _exe(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_nvidia_smi(bindir: Path, gpus: list[str] | None, code: int = 0) -> Path:
    """`gpus` None: the driver is not loaded (exit `code`, 9 by default)."""
    bindir.mkdir(exist_ok=True)
    if gpus is None:
        answer = f'echo "{NO_DRIVER}"; exit {code or 9}'
    elif not gpus:
        answer = 'echo "No devices were found"; exit 6'
    else:
        answer = "".join(f'echo "{g}"\n' for g in gpus) + "exit 0"
    return _exe(bindir / "nvidia-smi", f"""\
if [ "$1" != "--query-gpu=name" ] || [ "$2" != "--format=csv,noheader" ] || [ $# -ne 2 ]; then
  echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
  exit 2
fi
{answer}
""")


def env_with(bindir: Path) -> dict[str, str]:
    # only the stand-in's directory: a real nvidia-smi elsewhere never answers for it
    bindir.mkdir(exist_ok=True)
    return {"PATH": str(bindir), "HOME": os.environ.get("HOME", "/")}


def cuda_python(tmp: Path, count: int) -> str:
    """An interpreter whose torch sees `count` GPUs: this machine's own torch is CPU-only,
    so this stand-in answers the gate's probe (and only it) the way a CUDA torch would."""
    return str(_exe(tmp / "cuda-python", f"""\
[ "$1" = "-c" ] && [ "$2" = "{gpugate.TORCH_PROBE}" ] || exit 2
echo {count}
"""))


def gate(env: dict[str, str], expected: int, python: str = sys.executable,
         wait_s: float = 0.0) -> gpugate.GateResult:
    return gpugate.wait_for_gpus(expected, python, env, wait_s, sleep=lambda s: None)


def test_a_cpu_node_skips_the_gate(tmp_path: Path) -> None:
    res = gate(env_with(tmp_path / "bin"), 0)  # no nvidia-smi at all: never asked
    assert res.ok and res.driver_gpus is None


def test_no_nvidia_smi_keeps_the_gate_closed(tmp_path: Path) -> None:
    res = gate(env_with(tmp_path / "bin"), 1)
    assert not res.ok
    assert "nvidia-smi is not installed" in res.reason


def test_a_driver_that_does_not_answer_keeps_the_gate_closed(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", None)
    res = gate(env_with(tmp_path / "bin"), 1)
    assert not res.ok
    assert "nvidia-smi exited 9: NVIDIA-SMI has failed" in res.reason


def test_no_devices_keeps_the_gate_closed(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", [])
    res = gate(env_with(tmp_path / "bin"), 1)
    assert not res.ok and "exited 6: No devices were found" in res.reason


def test_fewer_gpus_than_the_type_has_keeps_the_gate_closed(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", ["NVIDIA A10G"] * 3)
    res = gate(env_with(tmp_path / "bin"), 4, python=cuda_python(tmp_path, 4))
    assert not res.ok and res.driver_gpus == 3
    assert "nvidia-smi lists 3 GPU(s), the instance type has 4" in res.reason


def test_a_cpu_only_torch_keeps_the_gate_closed(tmp_path: Path) -> None:
    # the driver lists the GPUs, but this machine's torch (CPU-only) sees none
    fake_nvidia_smi(tmp_path / "bin", ["NVIDIA A10G"])
    res = gate(env_with(tmp_path / "bin"), 1)
    assert not res.ok and res.driver_gpus == 1 and res.torch_gpus == 0
    assert "torch sees 0 of the instance type's 1 GPU(s)" in res.reason


def test_the_gate_opens_when_driver_and_torch_see_every_gpu(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", ["NVIDIA H100 80GB HBM3"] * 8)
    res = gate(env_with(tmp_path / "bin"), 8, python=cuda_python(tmp_path, 8))
    assert res.ok and (res.driver_gpus, res.torch_gpus) == (8, 8)


def test_the_gate_waits_for_a_driver_installed_at_first_boot(tmp_path: Path) -> None:
    """GCP installs the driver at first boot: nvidia-smi fails, then answers."""
    bindir = tmp_path / "bin"
    env = env_with(bindir)
    now = [0.0]
    probes: list[str] = []

    def sleep(s: float) -> None:
        now[0] += s
        probes.append("slept")
        if len(probes) == 2:  # the install finishes during the second wait
            fake_nvidia_smi(bindir, ["Tesla T4"])

    fake_nvidia_smi(bindir, None)
    res = gpugate.wait_for_gpus(1, cuda_python(tmp_path, 1), env, 60.0, interval_s=5.0,
                                clock=lambda: now[0], sleep=sleep)
    assert res.ok and res.waited_s == 10.0


def test_the_wait_is_bounded(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", None)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    res = gpugate.wait_for_gpus(1, sys.executable, env_with(tmp_path / "bin"), 30.0,
                                interval_s=5.0, clock=lambda: now[0], sleep=sleep)
    assert not res.ok and res.waited_s <= 30.0
    assert "gave up after 30s" in res.reason  # probes at 0, 5, ... 30 s


def _status(url: str, secret: str) -> dict[str, object]:
    req = urllib.request.Request(url + "/api/status", headers={"Authorization": f"Bearer {secret}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def _events(url: str, secret: str) -> list[dict[str, object]]:
    req = urllib.request.Request(url + "/api/events?since=0",
                                 headers={"Authorization": f"Bearer {secret}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        evs: list[dict[str, object]] = json.loads(r.read())["events"]
        return evs


@pytest.mark.parametrize("gpus", [None, ["NVIDIA A10G"]], ids=["no-driver", "too-few"])
def test_a_closed_gate_reports_to_the_head_and_starts_no_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: list[str] | None
) -> None:
    """The agent of a 4-GPU type on a node without its GPUs: state `failed` at the head,
    a gpu-gate-failed event saying why, and no torchrun (the controller then replaces it)."""
    fake_nvidia_smi(tmp_path / "bin", gpus)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    secret = "s" * 43
    (tmp_path / "head").mkdir()
    with serve_head(tmp_path / "head", secret) as srv:
        tok = tmp_path / "token"
        tok.write_text(node_token(secret, "n1"))
        tok.chmod(0o600)
        cfg = AgentConfig(cluster="c", node_id="n1", head_url=srv.url, store_host="127.0.0.1",
                          store_port=1, token_file=str(tok), workdir=str(tmp_path / "w"),
                          script=str(tmp_path / "train.py"), nproc_per_node=4,
                          python=cuda_python(tmp_path, 4), expect_gpus=4, gpu_wait_s=0)
        agent = Agent(cfg)
        agent.step()  # still probing: waits, starts nothing
        assert agent.state == "waiting" and agent.torchrun is None
        agent._run_gpu_gate()
        for _ in range(3):
            agent.step()
        assert agent.state == "failed" and agent.torchrun is None
        node = _status(srv.url, secret)["nodes"]["n1"]  # type: ignore[index]
        assert node["state"] == "failed"
        evs = [e for e in _events(srv.url, secret) if e["type"] == "gpu-gate-failed"]
        assert len(evs) == 1 and evs[0]["node"] == "n1"
        want = "nvidia-smi exited 9" if gpus is None else "nvidia-smi lists 1 GPU(s)"
        assert want in str(evs[0]["reason"])


class _OneNode:
    """The provider's answer for a cluster with one running GPU worker (the planner's
    other inputs come from the head and the journal)."""

    def list(self, cluster: str) -> list[Instance]:
        return [Instance(id="n1", cluster=cluster, role="worker", zone="use1-az1",
                         instance_type="g5.12xlarge", gpus=4, state="running",
                         request_id="r1", price=2.0, launched_at=time.time() - 3600)]


def test_the_controller_replaces_a_node_whose_gate_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node at the head in state `failed` is observed as lost, so the plan terminates it
    (and launches its replacement like any lost node's)."""
    monkeypatch.setenv("SPOTCTL_HOME", str(tmp_path / "home"))
    store = Store(tmp_path / "home")
    spec = ClusterSpec.model_validate({"name": "c1", "provider": "local",
                                       "train": {"script": str(tmp_path / "train.py")}})
    store.upsert_cluster("c1", "local", spec.model_dump(mode="json"), "running")
    secret = store.cluster_dir("c1").token(create=True)
    (tmp_path / "head").mkdir()
    with serve_head(tmp_path / "head", secret) as srv:
        store.set_head("c1", {"url": srv.url})
        HeadClient(srv.url, node_token(secret, "n1")).heartbeat(
            {"node_id": "n1", "agent_state": "failed", "workers": []})
        _, obs = reconcile.observe(store, spec, _OneNode())
    store.close()
    assert [(n.id, n.state) for n in obs.nodes] == [("n1", "lost")]
    p = plan(spec, obs, (), {}, time.time())
    assert [(a.type, a.node_ids) for a in p.actions] == [("terminate", ("n1",))]


def test_a_cloud_gpu_worker_expects_its_types_gpus(spotctl_home: Path) -> None:
    """The agent config the cloud bootstrap renders: the instance type's GPU count and the
    spec's wait; under the test seam (nodes are processes on this CPU machine) no gate."""
    from spotctl.providers import ProviderContext
    from spotctl.providers.base import HeadInfo
    from spotctl.remote.bootstrap import CloudNodes

    spec = ClusterSpec.model_validate({
        "name": "g", "provider": "aws", "train": {"gpu_wait_s": 600},
        "aws": {"region": "us-east-1", "ssh_cidr": "198.51.100.7/32"}})
    vm = Instance(id="i-1", cluster="g", role="worker", zone="us-east-1a",
                  instance_type="g5.12xlarge", gpus=4, state="running", request_id="r",
                  address="10.0.0.7")
    head = HeadInfo(url="http://10.0.0.5:7470", store_host="10.0.0.5", store_port=29400,
                    lighthouse="http://10.0.0.5:29510")
    for options, want in (({}, 4), ({"ssh_override": "127.0.0.1:2222"}, 0)):
        ctx = ProviderContext("g", spec, Store(spotctl_home).cluster_dir("g").ensure(), options)
        nodes = CloudNodes(ctx, metadata="aws", metadata_url="http://169.254.169.254",
                           api_port=7470, store_port=29400)
        cfg = nodes.agent_config(vm, head)
        assert (cfg.expect_gpus, cfg.gpu_wait_s) == (want, 600.0)


def test_a_probe_answer_that_is_no_gpu_count_closes_the_gate(tmp_path: Path) -> None:
    """The probe runs as the training user and a root agent reads it: thousands of digits
    (int() refuses over 4,300) or non-ASCII digits are no count, and the agent goes on."""
    fake_nvidia_smi(tmp_path / "bin", ["NVIDIA A10G"])
    for i, answer in enumerate(["9" * 5000, "\u0661"]):  # the second: ARABIC-INDIC ONE
        py = _exe(tmp_path / f"odd-python-{i}", f'printf "%s\\n" "{answer}"\n')
        res = gate(env_with(tmp_path / "bin"), 1, python=str(py))
        assert not res.ok and res.torch_gpus is None, res
        assert "torch could not count GPUs" in res.reason, res.reason
