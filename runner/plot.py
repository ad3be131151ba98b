"""The run's plot: reward and environment-token NLL over steps (PNG, matplotlib Agg)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from runner._atomic import atomic_path


def _series(records, key):
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def figure(records: list[dict[str, Any]]) -> Any:
    """The plot's matplotlib figure: reward / eval reward above, env NLL / SFT NLL below. Each
    legend sits to the right of its axes, outside them, so that it covers no curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_n) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for key, label, style in (
        ("reward", "train reward (RL)", "-"),
        ("eval_reward", "eval reward (held-out)", "o--"),
    ):
        xs, ys = _series(records, key)
        if xs:
            ax_r.plot(xs, ys, style, label=label)
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(-0.05, 1.05)
    ax_r.grid(alpha=0.3)
    for key, label in (
        ("env_nll", "env-token NLL (ECHO)"),
        ("sft/nll", "SFT NLL"),
        ("sft/eval_nll", "SFT eval NLL (held-out)"),
    ):
        xs, ys = _series(records, key)
        if xs:
            ax_n.plot(xs, ys, label=label)
    ax_n.set_ylabel("NLL per token")
    ax_n.set_xlabel("step")
    ax_n.grid(alpha=0.3)
    for ax in (ax_r, ax_n):
        if ax.lines:  # (an SFT-only run without a task has no reward)
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot_metrics(records: list[dict[str, Any]], path: Path) -> Path:
    """Writes ``path`` (atomically): `figure` as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(records)
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=80)
    finally:
        plt.close(fig)
    return path
