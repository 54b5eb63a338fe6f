"""The node agent's configuration: one JSON file per node (agent.json), written by the
local provider or rendered by the SSH bootstrap. Secrets are not in it: the head token is
read from `token_file` (0600), never passed on a command line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METADATA_STYLES = ("local", "aws", "gcp", "file", "none")


@dataclass
class AgentConfig:
    cluster: str
    node_id: str
    head_url: str  # coordinator API, e.g. http://10.0.0.5:7470
    store_host: str  # head's TCPStore (torchrun c10d rendezvous)
    store_port: int
    token_file: str  # file holding the cluster token (0600)
    workdir: str  # node's working directory: logs, worker status files
    script: str  # training script path on the node
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    max_nodes: int = 1
    checkpoint_dir: str = ""
    checkpoint_every: int = 20
    checkpoint_every_s: float = 0.0
    keep_last: int = 3
    checkpoint_writers: int = 0  # 0: by the size of each rank's share (see elastic.checkpoint)
    max_steps: int = 0
    python: str = ""  # interpreter for torchrun; "" = the agent's own
    env: dict[str, str] = field(default_factory=dict)
    local_addr: str = "127.0.0.1"  # address peers and the head reach this node at
    # "torchrun" (restart path: one rendezvous on the head) or "torchft" (this node's
    # workers are one replica group under their own torchrun, joined through the head's
    # Lighthouse at `lighthouse`, e.g. http://10.0.0.5:29510)
    engine: str = "torchrun"
    lighthouse: str = ""
    # torchft: nodes per replica group ([train] nodes_per_replica); above 1 the head
    # places this node in a group and its torchrun spans the group's nodes
    replica_nodes: int = 1
    # Where preemption notices come from: local emulator (both protocols), aws, gcp,
    # a notice file (ssh hosts with their own eviction signal), or none.
    metadata: str = "none"
    metadata_url: str = ""  # e.g. http://169.254.169.254 (aws) or http://metadata.google.internal
    notice_file: str = ""
    poll_interval_s: float = 2.0  # metadata poll interval (aws spec: 2 s)
    # The unprivileged user training workers (torchrun, the zygote and every worker) run
    # as, when the agent runs as root: they then cannot read the node token. "" = the
    # agent's own user. Ignored (with a warning) when the agent is not root.
    run_as: str = ""
    # GPUs this node's instance type has: workers start only once nvidia-smi lists them
    # and torch sees them (spotctl.agent.gpugate), waiting at most gpu_wait_s (the driver
    # may still be installing at first boot). 0 = a CPU node: no gate.
    expect_gpus: int = 0
    gpu_wait_s: float = 300.0

    def __post_init__(self) -> None:
        if self.metadata not in METADATA_STYLES:
            raise ValueError(f"metadata must be one of {METADATA_STYLES}, got {self.metadata!r}")
        if self.nproc_per_node < 1:
            raise ValueError("nproc_per_node must be >= 1")
        if self.expect_gpus < 0 or not 0 <= self.gpu_wait_s <= 3600:
            raise ValueError("expect_gpus must be >= 0 and gpu_wait_s within [0, 3600]")
        if self.engine not in ("torchrun", "torchft"):
            raise ValueError(f"engine must be torchrun or torchft, got {self.engine!r}")
        if not 1 <= self.replica_nodes <= 64 or (self.replica_nodes > 1
                                                    and self.engine != "torchft"):
            raise ValueError("replica_nodes must be 1..64, and above 1 only on torchft")
        if self.engine == "torchft" and not self.lighthouse:
            raise ValueError("engine torchft needs the head's lighthouse address")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: Path) -> AgentConfig:
        return cls(**json.loads(Path(path).read_text()))

    def token(self) -> str:
        return Path(self.token_file).read_text().strip()
