"""How a metric combines across micro-batches and calls: one rule, read by the step runner
(`runner._step` merges a step's micro-batch metrics with it) and the local trainer's kernels
(their Fireworks-style ``name:reduction`` keys, `runner.local.kernels.server_metrics`).

By the metric's last path component (``grpo/clip_frac`` → ``clip_frac``):

* ``sum``: losses (``…loss``), counts (``num_…``, ``rows_…``) and explicit sums (``…_sum``),
  so that micro-batches add up to the whole batch's value;
* ``max``: ``…_max``;
* ``mean`` (row-weighted across micro-batches): everything else (fractions, means, ratios).
"""

from __future__ import annotations


def reduction(key: str) -> str:
    """``"sum"``, ``"max"`` or ``"mean"``: how the metric ``key`` combines (module docstring)."""
    leaf = key.rsplit("/", 1)[-1]
    if leaf.endswith(("loss", "_sum")) or leaf.startswith(("num_", "rows_")):
        return "sum"
    if leaf.endswith("_max"):
        return "max"
    return "mean"
