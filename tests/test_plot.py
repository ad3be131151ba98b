"""The run's plot (`runner.plot`): its curves, legends that cover none of them and stay inside
the image, the PNG written atomically."""

from __future__ import annotations

import math

import numpy as np

from runner.plot import figure, plot_metrics


def _records(sft=6, rl=20, task=True):
    recs = [{"step": 0, "phase": "eval", "eval_reward": 0.0}] if task else []
    for s in range(1, sft + 1):
        recs.append({"step": s, "phase": "sft", "sft/nll": 4.0 / s, "sft/eval_nll": 4.2 / s})
    for s in range(sft + 1, sft + rl + 1):
        r = {"step": s, "phase": "rl", "reward": min(1.0, 0.05 * s), "env_nll": 6.0 - 0.1 * s}
        if s % 5 == 0:
            r["eval_reward"] = 0.04 * s
        recs.append(r)
    recs[-1]["sft/nll"] = math.nan  # a non-finite value is skipped, not plotted
    return recs


def _inside(inner, outer) -> bool:
    return (
        inner.x0 >= outer.x0 - 0.5
        and inner.x1 <= outer.x1 + 0.5
        and inner.y0 >= outer.y0 - 0.5
        and inner.y1 <= outer.y1 + 0.5
    )


def test_legends_cover_no_curve_and_stay_inside_the_image():
    import matplotlib.pyplot as plt

    fig = figure(_records())
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        image = fig.bbox
        ax_r, ax_n = fig.axes
        labels = {ax: [t.get_text() for t in ax.get_legend().get_texts()] for ax in (ax_r, ax_n)}
        assert labels[ax_r] == ["train reward (RL)", "eval reward (held-out)"]
        assert labels[ax_n] == ["env-token NLL (ECHO)", "SFT NLL", "SFT eval NLL (held-out)"]
        for ax in (ax_r, ax_n):
            box = ax.get_legend().get_window_extent(renderer)
            assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_ylabel()
            assert _inside(box, image), (box, image)  # not cut off at the edge
            for line in ax.lines:  # every point of every curve is drawn inside its axes
                xy = ax.transData.transform(np.asarray(line.get_xydata()))
                assert not any(box.contains(x, y) for x, y in xy)
        env = next(line for line in ax_n.lines if line.get_label().startswith("env"))
        assert list(env.get_xdata()) == list(range(7, 27))
        sft = next(line for line in ax_n.lines if line.get_label() == "SFT NLL")
        assert list(sft.get_xdata()) == list(range(1, 7))  # the NaN record left out
    finally:
        plt.close(fig)


def test_an_sft_only_run_without_a_task_has_no_reward_legend(tmp_path):
    import matplotlib.pyplot as plt

    fig = figure(_records(rl=0, task=False))
    try:
        ax_r, ax_n = fig.axes
        assert ax_r.get_legend() is None and not ax_r.lines
        assert [t.get_text() for t in ax_n.get_legend().get_texts()][0] == "SFT NLL"
    finally:
        plt.close(fig)
    path = plot_metrics(_records(), tmp_path / "plot.png")
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]  # no temporary left
