"""``python -m runner report RUN_DIR [RUN_DIR ...]``: the headline numbers of each run as one table,
and one PNG comparing the runs' curves (docs/tracking.md).

Everything is read from each run's ``metrics.jsonl`` (the source of truth): `headline` computes a
run's numbers, `write_comparison` draws the curves that any of the runs logged (`CURVES`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from runner._atomic import atomic_path

Record = Mapping[str, Any]


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``.

    Raises:
      ValueError: no such file, or a line that is not a JSON object (naming file:line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"report: {path} not found (is {run_dir} a run directory?)")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"report: {path}:{number} is not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ValueError(f"report: {path}:{number} is not a record with an integer step")
        out.append(rec)
    return out


def _number(record: Record, key: str) -> float | None:
    v = record.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


@dataclasses.dataclass(frozen=True)
class Headline:
    """One run's headline numbers (``None``: the run did not log it).

    Attributes:
      sft_steps, rl_steps: records of each phase.
      eval_after_sft: held-out reward at the end of SFT (step 0's when the run has no SFT).
      eval_after_rl: held-out reward at the last RL step.
      env_nll_first, env_nll_last: ``env_nll`` of the first and last RL step that logged it.
      wall_s: ``time`` of the last record minus that of the first (a resume's pause included).
      rl_tokens_per_s: median of the RL steps' ``tokens_per_s``.
      forwards, backwards: mean ``passes/forwards`` / ``passes/backwards`` per RL step.
    """

    name: str
    sft_steps: int
    rl_steps: int
    eval_after_sft: float | None
    eval_after_rl: float | None
    env_nll_first: float | None
    env_nll_last: float | None
    wall_s: float | None
    rl_tokens_per_s: float | None
    forwards: float | None
    backwards: float | None


def headline(name: str, records: Sequence[Record]) -> Headline:
    """`Headline` of one run's records."""
    sft = [r for r in records if r.get("phase") == "sft"]
    rl = [r for r in records if r.get("phase") == "rl"]
    before_rl = [r for r in records if r.get("phase") != "rl"]
    after_sft = [v for r in before_rl if (v := _number(r, "eval_reward")) is not None]
    after_rl = [v for r in rl if (v := _number(r, "eval_reward")) is not None]
    env = [v for r in rl if (v := _number(r, "env_nll")) is not None]
    times = [v for r in records if (v := _number(r, "time")) is not None]

    def mean(key):
        vals = [v for r in rl if (v := _number(r, key)) is not None]
        return sum(vals) / len(vals) if vals else None

    tps = [v for r in rl if (v := _number(r, "tokens_per_s")) is not None]
    return Headline(
        name=name,
        sft_steps=len(sft),
        rl_steps=len(rl),
        eval_after_sft=after_sft[-1] if after_sft else None,
        eval_after_rl=after_rl[-1] if after_rl else None,
        env_nll_first=env[0] if env else None,
        env_nll_last=env[-1] if env else None,
        wall_s=times[-1] - times[0] if len(times) > 1 else None,
        rl_tokens_per_s=statistics.median(tps) if tps else None,
        forwards=mean("passes/forwards"),
        backwards=mean("passes/backwards"),
    )


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _duration(s: float | None) -> str:
    if s is None:
        return "—"
    m, sec = divmod(round(s), 60)
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


#: The table's columns: header → the cell of a `Headline`.
COLUMNS: tuple[tuple[str, Callable[[Headline], str]], ...] = (
    ("run", lambda h: h.name),
    ("steps SFT+RL", lambda h: f"{h.sft_steps}+{h.rl_steps}"),
    ("eval reward after SFT", lambda h: _fmt(h.eval_after_sft, ".3f")),
    ("eval reward after RL", lambda h: _fmt(h.eval_after_rl, ".3f")),
    (
        "env NLL first → last",
        lambda h: (
            "—" if h.env_nll_first is None else f"{h.env_nll_first:.3f} → {h.env_nll_last:.3f}"
        ),
    ),
    ("wall time", lambda h: _duration(h.wall_s)),
    ("RL tok/s (median)", lambda h: _fmt(h.rl_tokens_per_s, ".0f")),
    (
        "passes per RL step fwd+bwd",
        lambda h: "—" if h.forwards is None else f"{h.forwards:g}+{h.backwards:g}",
    ),
)


def print_table(heads: Sequence[Headline], file=None) -> None:
    """The headline table with rich (plain text when the output is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="runs")
    for header, _ in COLUMNS:
        if header == "run":  # names whole; the numbers' headers wrap instead
            table.add_column(header, no_wrap=True, min_width=max(len(h.name) for h in heads))
        else:
            table.add_column(header, justify="right")
    for h in heads:
        table.add_row(*(cell(h) for _, cell in COLUMNS))
    console = Console(file=file)
    if not console.is_terminal:  # a file or a pipe: wide enough that no cell wraps
        console = Console(file=file, width=160)
    console.print(table)


def _series(records: Sequence[Record], get: Callable[[Record], float | None]):
    xs, ys = [], []
    for r in records:
        v = get(r)
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _key(key: str) -> Callable[[Record], float | None]:
    return lambda r: _number(r, key)


def _clip_frac(r: Record) -> float | None:
    """The fraction of tokens clipped by the policy term: ``*/clip_frac``, else the sum of
    ``*/clip_frac_low`` and ``*/clip_frac_high`` (disjoint: a token is clipped on one side)."""
    total, found = 0.0, False
    for k in r:
        if k.endswith(("/clip_frac", "/clip_frac_low", "/clip_frac_high")):
            x = _number(r, k)
            if x is not None:
                total, found = total + x, True
    return total if found else None


def _kl(r: Record) -> float | None:
    """The policy term's ``*/kl`` (KL to the reference model; 0 while ``[rl].kl_coef = 0``)."""
    for k in sorted(r):
        if k.endswith("/kl") and (x := _number(r, k)) is not None:
            return x
    return None


@dataclasses.dataclass(frozen=True)
class Curve:
    """One panel of the comparison: ``get`` reads the value of a record (``None``: absent);
    ``smooth``: also draw a moving average (noisy per-step values)."""

    title: str
    ylabel: str
    get: Callable[[Record], float | None]
    smooth: bool = False


#: The panels, in order; a panel no run logged is left out.
CURVES: tuple[Curve, ...] = (
    Curve("train reward (RL)", "reward", _key("reward"), smooth=True),
    Curve("held-out reward", "reward", _key("eval_reward")),
    Curve("env-token NLL (ECHO)", "NLL per token", _key("env_nll"), smooth=True),
    Curve("KL to the reference", "KL", _kl, smooth=True),
    Curve("clip fraction", "fraction of tokens", _clip_frac, smooth=True),
    Curve(
        "staleness (async)",
        "version offset (mean)",
        _key("async/version_offset_mean"),
        smooth=True,
    ),
)

SMOOTH_WINDOW = 9
MARKERS_UP_TO = 30
#: Run ``i`` draws with ``LINESTYLES[i]`` and, where points are few, ``MARKERS[i]`` (hollow and
#: larger after the first run), so that runs with equal values stay distinguishable.
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")


def _moving_average(ys: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_comparison(runs: Sequence[tuple[str, Sequence[Record]]], path: Path) -> Path:
    """One PNG (atomically written): a panel per `CURVES` entry that any run logged, one colour
    per run, the legend outside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    panels = [c for c in CURVES if any(_series(recs, c.get)[0] for _, recs in runs)]
    if not panels:
        raise ValueError("report: none of the runs logged a reward, NLL, KL or clip fraction")
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(6.0 * cols, 3.2 * rows), squeeze=False, layout="constrained"
    )
    from matplotlib.ticker import MaxNLocator

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    smoothed = False
    for ax, curve in zip(axes.flat, panels, strict=False):
        values = []
        for i, (_, recs) in enumerate(runs):
            xs, ys = _series(recs, curve.get)
            if not xs:
                continue
            values.extend(ys)
            color, line = colors[i % len(colors)], LINESTYLES[i % len(LINESTYLES)]
            if curve.smooth and len(xs) > SMOOTH_WINDOW:
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(
                    xs,
                    _moving_average(ys, SMOOTH_WINDOW),
                    color=color,
                    linestyle=line,
                    linewidth=1.8,
                )
                smoothed = True
            else:  # markers where the points are few (evaluations, short runs)
                few = len(xs) <= MARKERS_UP_TO
                ax.plot(
                    xs,
                    ys,
                    color=color,
                    linestyle=line,
                    linewidth=1.5,
                    # a later run's hollow, larger marker leaves an equal earlier point visible
                    marker=MARKERS[i % len(MARKERS)] if few else None,
                    markersize=4 + 2 * (i % len(MARKERS)),
                    markerfacecolor=color if i % len(MARKERS) == 0 else "none",
                )
        if not any(values):  # say it: a flat line at 0 reads like a missing curve
            ax.text(
                0.5,
                0.6,
                "0 at every step",
                transform=ax.transAxes,
                ha="center",
                color="0.35",
                fontsize=11,
            )
        ax.set_title(curve.title, fontsize=11)
        ax.set_ylabel(curve.ylabel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles = [
        Line2D(
            [],
            [],
            color=colors[i % len(colors)],
            linestyle=LINESTYLES[i % len(LINESTYLES)],
            linewidth=2.5,
            label=name,
        )
        for i, (name, _) in enumerate(runs)
    ]
    if smoothed:
        handles.append(
            Line2D([], [], color="gray", alpha=0.35, linewidth=1, label="per step (faint)")
        )
        handles.append(
            Line2D([], [], color="gray", linewidth=2, label=f"mean of {SMOOTH_WINDOW} steps")
        )
    fig.legend(handles=handles, loc="outside right upper", frameon=False, fontsize=10)
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
    return path


def _names(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name, with its parent's where two runs share a name."""
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{Path(d).resolve().parent.name}/{Path(d).resolve().name}" for d in run_dirs]


def report(run_dirs: Sequence[Path], out: Path, file=None) -> list[Headline]:
    """Prints the table of ``run_dirs`` and writes the comparison PNG to ``out``."""
    if not run_dirs:
        raise ValueError("report: give at least one run directory")
    runs = [(name, read_records(d)) for name, d in zip(_names(run_dirs), run_dirs, strict=True)]
    heads = [headline(name, recs) for name, recs in runs]
    print_table(heads, file=file)
    write_comparison(runs, out)
    print(f"plot: {out}", file=file)
    return heads
