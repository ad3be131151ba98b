"""Built-in kernels of the local trainer, delegated to `losses` terms with ``token_sum``.

Each Fireworks/Tinker kernel name maps to the `losses` constructor of the same name; the trainer
builds a padded `losses.Batch` with ``action_mask = 1`` on every real target position of every
sequence (0 on padding), ``advantages`` and ``sampling_logprobs = q`` (or ``weights``), so
``reduction="token_sum"`` is exactly the kernel's raw sum over all target tokens of all sequences
(reference/fireworks-sdk.md §4):

=======================  ================================  =======================================
kernel                   Seq inputs (length N-1)           ``loss_fn_config`` keys (defaults)
=======================  ================================  =======================================
``cross_entropy``        ``weights`` (any sign)            —
``importance_sampling``  ``logprobs`` (q), ``advantages``  ``ratio_log_cap`` (20)
``ppo``                  ``logprobs``, ``advantages``      ``clip_low_threshold`` (0.8),
                                                           ``clip_high_threshold`` (1.2),
                                                           ``ratio_log_cap`` (20)
``cispo``                ``logprobs``, ``advantages``      ``clip_low_threshold`` (0.0),
                                                           ``clip_high_threshold`` (4.0),
                                                           ``ratio_log_cap`` (20)
``dro``                  ``logprobs``, ``advantages``      ``beta`` (0.05)
=======================  ================================  =======================================

Those are `runner.BUILTIN_LOSSES` (documented Tinker formulas). The Fireworks-only kernels whose
formulas are *inferred* from the cookbook's client twins (``losses.builtin_twin`` may name them)
are available too, as ``getattr(losses, name)(reduction="token_sum", **config)`` with the
constructors' own defaults: ``dapo`` (``clip_low_threshold``, ``clip_high_threshold``,
``eps_clip_c``, ``ratio_log_cap``), ``gspo`` (thresholds, ``seq_ratio_log_cap``,
``ratio_log_cap``) and ``dppo`` (``divergence``, ``threshold``, ``ratio_log_cap``).

Every kernel also accepts an optional ``target_tokens`` input, which must equal the sequence's
own targets ``tokens[1:]``. ``ratio_log_cap`` is the clamp of ``p - q`` before ``exp`` (the terms'
``max_log_ratio``); DRO has no ratio, so it does not take the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import losses
from runner._padding import pad_ragged
from runner._types import Seq, check_kernel_inputs


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A built-in kernel: its inputs, config keys with defaults, and its `losses` term builder.

    A default of ``None`` means the `losses` constructor's own default.
    """

    name: str
    inputs: tuple[str, ...]
    defaults: Mapping[str, Any]
    build: Callable[..., losses.Term]
    formula: str = "documented"


_RL_INPUTS = ("logprobs", "advantages")
#: Config keys whose values are strings (all others are numbers).
_STRING_KEYS = ("divergence",)


def _policy(ctor):
    def build(*, ratio_log_cap: float = 20.0, **cfg):
        return ctor(reduction="token_sum", max_log_ratio=ratio_log_cap, **cfg)

    return build


_THRESHOLDS_NONE = {"clip_low_threshold": None, "clip_high_threshold": None}

KERNELS: dict[str, Kernel] = {
    "cross_entropy": Kernel(
        "cross_entropy", ("weights",), {}, lambda: losses.weighted_cross_entropy()
    ),
    "importance_sampling": Kernel(
        "importance_sampling",
        _RL_INPUTS,
        {"ratio_log_cap": 20.0},
        _policy(losses.importance_sampling),
    ),
    "ppo": Kernel(
        "ppo",
        _RL_INPUTS,
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "ratio_log_cap": 20.0},
        _policy(losses.ppo),
    ),
    "cispo": Kernel(
        "cispo",
        _RL_INPUTS,
        {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0, "ratio_log_cap": 20.0},
        _policy(losses.cispo),
    ),
    "dro": Kernel(
        "dro",
        _RL_INPUTS,
        {"beta": 0.05},
        lambda *, beta: losses.dro(beta=beta, reduction="token_sum"),
    ),
    "dapo": Kernel(
        "dapo",
        _RL_INPUTS,
        {**_THRESHOLDS_NONE, "eps_clip_c": None, "ratio_log_cap": 20.0},
        _policy(losses.dapo),
        formula="inferred",
    ),
    "gspo": Kernel(
        "gspo",
        _RL_INPUTS,
        {**_THRESHOLDS_NONE, "seq_ratio_log_cap": 10.0, "ratio_log_cap": 20.0},
        _policy(losses.gspo),
        formula="inferred",
    ),
    "dppo": Kernel(
        "dppo",
        _RL_INPUTS,
        {"divergence": "binary_tv", "threshold": None, "ratio_log_cap": 20.0},
        _policy(losses.dppo),
        formula="inferred",
    ),
}

#: Metric reductions (Fireworks ``name:reduction`` keys) of the terms' metrics; default ``mean``.
_METRIC_REDUCTION = {
    "loss": "sum",
    "num_tokens": "sum",
    "num_weighted_tokens": "sum",
    "weight_sum": "sum",
    "ratio_max": "max",
}


def resolve(loss_name: str, config: Mapping[str, Any] | None) -> tuple[Kernel, tuple]:
    """Validates a kernel name and its config; returns the kernel and the full frozen config.

    Raises:
      ValueError: unknown kernel, unknown config key, or a non-numeric / non-finite value. Value
        ranges are checked by the `losses` constructor (eagerly, naming the key).
    """
    if not isinstance(loss_name, str) or loss_name not in KERNELS:
        raise ValueError(f"unknown loss {loss_name!r}; expected one of {tuple(KERNELS)}")
    kernel = KERNELS[loss_name]
    config = dict(config or {})
    unknown = sorted(set(config) - set(kernel.defaults))
    if unknown:
        allowed = tuple(kernel.defaults) or "none"
        raise ValueError(
            f"{loss_name}: unknown loss_fn_config key(s) {unknown}; allowed keys: {allowed}"
        )
    full = dict(kernel.defaults)
    for key, value in config.items():
        if key in _STRING_KEYS:
            if not isinstance(value, str):
                raise ValueError(f"{loss_name}: config '{key}' must be a string, got {value!r}")
            full[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float | np.number):
            raise ValueError(f"{loss_name}: config '{key}' must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{loss_name}: config '{key}' must be finite, got {value!r}")
        full[key] = value
    if "ratio_log_cap" in full and not full["ratio_log_cap"] > 0:  # clearer than max_log_ratio
        raise ValueError(
            f"{loss_name}: config 'ratio_log_cap' must be > 0, got {full['ratio_log_cap']}"
        )
    frozen = tuple(sorted(full.items()))
    kernel.build(**full)  # eager validation of values by the losses constructor
    return kernel, frozen


def check_inputs(kernel: Kernel, seqs: Sequence[Seq]) -> None:
    """Kernel-specific input checks (after `runner.validate_seqs`); raises ``ValueError``.

    See `runner._types.check_kernel_inputs` (shared with the Fireworks backend).
    """
    check_kernel_inputs(seqs, kernel.inputs, kernel.name)


def build_batch(kernel: Kernel, seqs: Sequence[Seq], rows: int, width: int, dtype) -> dict:
    """Host-side padded arrays for `losses.Batch` (``[rows, width]``, model dtype).

    ``action_mask`` is 1 on every real target of every sequence; ``weights`` (cross_entropy) or
    ``advantages`` and ``sampling_logprobs`` (RL kernels) are the Seq inputs, 0 on padding.
    """
    n = np.fromiter((s.num_targets for s in seqs), np.int64, len(seqs))
    mask = np.zeros((rows, width), dtype)
    mask[: len(seqs)] = np.arange(width)[None, :] < n[:, None]
    arrays = {
        name: pad_ragged([s.inputs[name] for s in seqs], width, rows, dtype)
        for name in kernel.inputs
    }
    fields = {"action_mask": mask}
    if kernel.name == "cross_entropy":
        fields["weights"] = arrays["weights"]
    else:
        fields["advantages"] = arrays["advantages"]
        fields["sampling_logprobs"] = arrays["logprobs"]
    return fields


def server_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Term metrics as Fireworks-style ``name:reduction`` keys (``loss`` → ``loss:sum``)."""
    out = {}
    for key, value in metrics.items():
        out[f"{key}:{_METRIC_REDUCTION.get(key, 'mean')}"] = float(value)
    return out
