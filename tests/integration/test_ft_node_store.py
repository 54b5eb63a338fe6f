"""The torchft engine's per-node replica group: its torchrun's store (where the group's
workers meet, and other replicas' workers when torchft picks this group's store for a
quorum) listens on the node's address only, like the head's store and the Lighthouse;
torch's own listener would take every interface. A real torchrun from the agent's own
command, with a probe for a training script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spotctl.agent.config import AgentConfig
from spotctl.agent.supervisor import torchrun_command
from tests.conftest import free_port

PROBE = r"""
import json, os, socket, sys
from datetime import timedelta
from torch.distributed import TCPStore

addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
out = {"addr": addr, "port": port, "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
s = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10), use_libuv=True)
s.set("probe", "ok")
out["store"] = s.get("probe").decode()
for other in ("127.0.0.1", "127.0.0.7"):
    c = socket.socket()
    c.settimeout(5)
    try:
        c.connect((other, port))
        out[other] = "accepted"
    except OSError as e:
        out[other] = type(e).__name__
    finally:
        c.close()
open(sys.argv[1], "w").write(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_the_replica_groups_store_listens_on_the_node_address_only(tmp_path: Path) -> None:
    addr = "127.0.0.5"
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "out.json"
    cfg = AgentConfig(cluster="c", node_id="n1", head_url="http://127.0.0.1:1",
                      store_host="127.0.0.1", store_port=2, token_file="t",
                      workdir=str(tmp_path), script=str(script), args=[str(out)],
                      nproc_per_node=1, local_addr=addr, engine="torchft",
                      lighthouse="http://127.0.0.1:9", python=sys.executable)
    port = free_port()  # free on loopback: nothing binds 127.0.0.5 itself
    cmd = torchrun_command(cfg, port)
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    # the workers got the group's store at the node's address, through torchrun's agent
    assert (r["addr"], r["port"], r["agent_store"], r["store"]) == (addr, port, "True", "ok"), r
    # and nothing listens on that port at any other address
    assert r["127.0.0.1"] == "ConnectionRefusedError", r
    assert r["127.0.0.7"] == "ConnectionRefusedError", r
