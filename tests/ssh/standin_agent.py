"""Stand-in node agent for the ssh tests while the lead's `spotctl agent` is absent.

Reads agent.json like the real agent, reads the token from token_file (never argv or
env), heartbeats to head_url every 0.5 s, and exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = json.loads(Path(ap.parse_args().config).read_text())
    token = Path(cfg["token_file"]).read_text().strip()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"standin agent for {cfg['node_id']} up", flush=True)
    while True:
        req = urllib.request.Request(
            cfg["head_url"] + "/api/heartbeat",
            data=json.dumps({"node_id": cfg["node_id"]}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req, timeout=2).read()
        except OSError as e:
            print(f"heartbeat failed: {e}", flush=True)
        time.sleep(0.5)


if __name__ == "__main__":
    main()
