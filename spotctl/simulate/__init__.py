"""Trace-driven simulation: what a job would cost and how far it would get on spot
capacity under spotctl, a restart-on-preemption policy and on-demand."""

from __future__ import annotations

from spotctl.simulate.engine import POLICIES, PolicyResult, SimResult, run_policy, simulate
from spotctl.simulate.model import Prices, SimModel, load_recovery_json, resolve_prices
from spotctl.simulate.traces import NodeEvent, Trace, read_trace

__all__ = [
    "POLICIES",
    "NodeEvent",
    "PolicyResult",
    "Prices",
    "SimModel",
    "SimResult",
    "Trace",
    "load_recovery_json",
    "read_trace",
    "resolve_prices",
    "run_policy",
    "simulate",
]
