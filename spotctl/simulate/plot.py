"""PNG of a simulation: nodes over time and cumulative progress, one line per policy."""

from __future__ import annotations

from pathlib import Path

from spotctl.errors import SpecError
from spotctl.simulate.engine import SimResult

_COLORS = {"spotctl": "tab:green", "restart": "tab:red", "ondemand": "tab:blue"}


def write_plot(result: SimResult, path: str | Path) -> Path:
    """Draw and save. Raises SpecError when matplotlib is missing or the path is unwritable."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecError("--plot needs matplotlib (pip install 'spotctl[sim]')") from None
    out = Path(path)
    fig, (ax_n, ax_p) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    try:
        tr = result.trace
        xs = [t / 3600 for t, _ in tr.timeline] + [tr.span_s / 3600]
        ys = [n for _, n in tr.timeline] + [tr.timeline[-1][1]]
        ax_n.fill_between(xs, ys, step="post", color="0.85", label="trace capacity")
        # spotctl drawn last so the line it is compared against never hides it.
        order = {"ondemand": 0, "restart": 1, "spotctl": 2}
        for r in sorted(result.results, key=lambda r: order.get(r.policy, -1)):
            ts = [s.t_s / 3600 for s in r.samples]
            color = _COLORS.get(r.policy)
            ax_n.step(
                ts,
                [s.world for s in r.samples],
                where="post",
                color=color,
                label=f"{r.policy} training",
                linewidth=1.2,
            )
            ax_p.plot(ts, [s.progress for s in r.samples], color=color, label=r.policy)
        oracle_x = [0.0]
        oracle_y = [0.0]
        done = 0.0
        for i, (t, n) in enumerate(tr.timeline):
            nxt = tr.timeline[i + 1][0] if i + 1 < len(tr.timeline) else tr.span_s
            done += (nxt - t) * min(n, result.nodes) / result.nodes / result.model.step_time_s
            oracle_x.append(nxt / 3600)
            oracle_y.append(done)
        ax_p.plot(oracle_x, oracle_y, color="0.4", linestyle="--", label="oracle")
        ax_n.set_ylabel("nodes")
        ax_n.yaxis.get_major_locator().set_params(integer=True)
        ax_n.set_title(f"{tr.name}: {result.nodes} x {result.gpus_per_node} GPU nodes")
        ax_n.legend(loc="upper right", fontsize="small")
        ax_p.set_ylabel("progress (full-size steps)")
        ax_p.set_xlabel("hours since trace start")
        ax_p.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        try:
            fig.savefig(out, format="png", dpi=100)
        except OSError as e:
            raise SpecError(f"--plot {out}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)
    return out
