"""One local "VM": the process that stands for a spot instance in local mode.

It owns the node's metadata endpoint (IMDSv2 and GCP protocols, via MetadataServer), runs
the node agent as a child, and plays the cloud's part when a preemption deadline passes:
it kills the whole node hard (every process tagged with this node), like a reclaimed VM.

    python -m spotctl.providers.local.vm NODE_DIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from spotctl.agent import proctree
from spotctl.state import write_json_atomic


def main(node_dir: Path) -> int:
    vm_path = node_dir / "vm.json"
    vm = json.loads(vm_path.read_text())
    # the "cloud's" control endpoint answers the controller (cluster secret), not the node
    token = (node_dir.parent.parent / "token").read_text().strip()
    from spotctl.providers.local.metadata import MetadataServer

    dead = threading.Event()

    def reclaim(*_: object) -> None:
        dead.set()
        vm["ended_at"] = time.time()
        tag = os.environ.get(proctree.TAG_VAR, "")
        # SIGKILL the agent, torchrun, the zygote and workers; record the preemption once
        # they are gone (as a cloud shows an instance terminated); then ourselves
        proctree.kill_tag(tag, root=os.getpid(), timeout_s=5) if tag else None
        vm["state"] = "preempted"
        write_json_atomic(vm_path, vm)
        os.kill(os.getpid(), signal.SIGKILL)

    agents: list[subprocess.Popen[bytes]] = []

    def soft_off() -> None:
        # GCP's ACPI soft-off at a preemption notice: the OS stops the agent's unit
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)

    md = MetadataServer(
        host=vm.get("address", "127.0.0.1"), port=0, control_token=token, on_deadline=reclaim,
        on_soft_off=soft_off,
        instance_id=vm["node_id"], zone=vm.get("zone", "local-a"), instance_type="local",
    )
    md.start()
    vm["metadata_url"] = md.url
    vm["pid"] = os.getpid()
    vm["state"] = "running"
    write_json_atomic(vm_path, vm)
    cfg_path = node_dir / "agent.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["metadata_url"] = md.url
    cfg_path.write_text(json.dumps(cfg, indent=2))
    log = open(node_dir / "agent.log", "ab")
    agent = subprocess.Popen(
        [sys.executable, "-m", "spotctl.cli.app", "agent", "--config", str(cfg_path)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(node_dir),
    )
    agents.append(agent)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    while not stopping.is_set() and agent.poll() is None:
        stopping.wait(0.5)
    # an agent that stopped after a GCP notice's soft-off (its node left): the "cloud"
    # still takes the VM at the deadline, as a preemption
    while md.deadline is not None and not stopping.is_set() and not dead.is_set():
        stopping.wait(0.5)
    if dead.is_set():
        # reclaimed: the reclaim thread recorded "preempted" and is killing the tree and
        # us; writing "stopped" now would make the preemption look like a lost node
        threading.Event().wait()
    if agent.poll() is None:
        # SIGINT, not SIGTERM: SIGTERM is the soft-off of a GCP preemption, after which
        # an agent with a notice finishes its leave first
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
    vm["state"] = "stopped"
    vm["ended_at"] = time.time()
    write_json_atomic(vm_path, vm)
    md.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
