"""The rendezvous leave's protocol between the node agent and its leave server
(`spotctl.elastic.rdzv.serve_leaves`), in a module that imports nothing: the agent, which
never imports torch, reads the answers from here.

    python -m spotctl.agent.leave      the leave server (run as the training user)
"""

from __future__ import annotations

import sys

MAX_LEAVE_LINE = 4096
# the server's one-word answers: left, still listed, failed (its log says why)
LEAVE_ANSWERS = (b"left", b"listed", b"error")

if __name__ == "__main__":
    from spotctl.elastic.rdzv import serve_leaves

    sys.exit(serve_leaves())
