"""``python -m runner report``: the table's numbers against NumPy computations straight from the
JSONL text, and the comparison PNG."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runner.__main__ import main
from runner.report import headline, read_records


def _write_run(run_dir: Path, seed: int, *, sft: int, rl: int, env: bool, stale: bool) -> None:
    """A run's metrics.jsonl in the main job's layout (step 0 eval, SFT, RL, evals at the ends)."""
    rng = np.random.default_rng(seed)
    t0 = 1.7e9 + seed
    lines = [{"step": 0, "phase": "eval", "eval_reward": float(rng.uniform()), "time": t0}]
    for step in range(1, sft + rl + 1):
        r = {"step": step, "time": t0 + 3.0 * step + float(rng.uniform())}
        if step <= sft:
            r.update(phase="sft", **{"sft/nll": float(rng.uniform(1, 4)), "tokens": 100.0})
            r["data/lines"] = [1, 2, 3]  # a list: not a number, not in the table
        else:
            r.update(
                phase="rl",
                reward=float(rng.uniform()),
                tokens_per_s=float(rng.uniform(100, 900)),
                **{
                    "grpo/kl": float(rng.uniform(0, 0.1)),
                    "grpo/clip_frac_low": float(rng.uniform(0, 0.05)),
                    "grpo/clip_frac_high": float(rng.uniform(0, 0.05)),
                    "passes/forwards": float(rng.integers(1, 3)),
                    "passes/backwards": 1.0,
                },
            )
            if env:
                r["env_nll"] = float(rng.uniform(0.5, 3))
            if stale:
                r["async/version_offset_mean"] = float(rng.uniform(0, 2))
        if step in (sft, sft + rl):
            r["eval_reward"] = float(rng.uniform())
        lines.append(r)
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _column(text: str, key: str, phase: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key`` over the records of ``phase``, parsed here from the JSONL."""
    rows = [json.loads(line) for line in text.splitlines()]
    rows = [r for r in rows if r["phase"] == phase and key in r]
    return np.array([r["step"] for r in rows]), np.array([r[key] for r in rows], dtype=float)


@pytest.fixture
def runs(tmp_path):
    _write_run(tmp_path / "echo", 1, sft=12, rl=30, env=True, stale=False)
    _write_run(tmp_path / "async", 2, sft=12, rl=30, env=False, stale=True)
    return tmp_path


def test_report_table_numbers_match_the_jsonl(runs, capsys):
    out = runs / "report.png"  # the default: beside the first run directory
    assert main(["report", str(runs / "echo"), str(runs / "async")]) == 0
    printed = capsys.readouterr().out
    for name in ("echo", "async"):
        text = (runs / name / "metrics.jsonl").read_text()
        h = headline(name, read_records(runs / name))
        steps, _ = _column(text, "tokens", "sft")
        rl_steps, rewards = _column(text, "reward", "rl")
        assert (h.sft_steps, h.rl_steps) == (len(steps), len(rl_steps)) == (12, 30)
        _, sft_eval = _column(text, "eval_reward", "sft")
        _, rl_eval = _column(text, "eval_reward", "rl")
        assert h.eval_after_sft == sft_eval[-1] and h.eval_after_rl == rl_eval[-1]
        _, env = _column(text, "env_nll", "rl")
        if name == "echo":
            assert (h.env_nll_first, h.env_nll_last) == (env[0], env[-1])
            assert f"{env[0]:.3f} → {env[-1]:.3f}" in printed
        else:
            assert h.env_nll_first is None and env.size == 0
        times = np.array([json.loads(line)["time"] for line in text.splitlines()])
        assert h.wall_s == pytest.approx(times.max() - times.min())
        _, tps = _column(text, "tokens_per_s", "rl")
        assert h.rl_tokens_per_s == pytest.approx(np.median(tps))
        _, fwd = _column(text, "passes/forwards", "rl")
        assert h.forwards == pytest.approx(fwd.mean()) and h.backwards == 1.0
        for cell in (
            f"{sft_eval[-1]:.3f}",
            f"{rl_eval[-1]:.3f}",
            f"{np.median(tps):.0f}",
            f"{fwd.mean():g}+1",
        ):
            assert cell in printed, (name, cell)
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert f"plot: {out}" in printed


def test_report_errors_name_the_file_and_line(runs, capsys):
    assert main(["report", str(runs / "missing")]) == 2
    assert "missing/metrics.jsonl not found" in capsys.readouterr().err
    path = runs / "echo" / "metrics.jsonl"
    path.write_text(path.read_text() + "{torn\n")
    assert main(["report", str(runs / "echo")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:44" in err and err.count("\n") == 1


def test_runs_with_equal_values_stay_distinguishable(runs, monkeypatch):
    """Two runs with the same held-out rewards (the default run and ``--env-coef 0`` share their
    SFT phase and may end equal) drew one line over the other; each run now has its own line
    style, and a later run's markers are hollow, so the earlier line shows through."""
    import matplotlib.axes

    from runner.report import write_comparison

    calls = []
    plot = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    records = read_records(runs / "echo")
    write_comparison([("a", records), ("b", records)], runs / "same.png")
    held = [kw for kw in calls if kw.get("marker")]  # the held-out rewards: 3 points a run
    by_style = {(kw["linestyle"], kw["marker"], kw["markerfacecolor"] == "none") for kw in held}
    assert len(held) == 2 and len(by_style) == 2, held
    smoothed = [kw for kw in calls if kw.get("linewidth") == 1.8]
    assert {kw["linestyle"] for kw in smoothed} == {"-", "--"}
