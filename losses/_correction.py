"""Rollout/trainer mismatch correction: truncated (TIS) and masked (MIS) importance weights.

The sampler (inference engine) and the trainer compute slightly different logprobs for the same
policy. Decoupled PPO keeps three policies: the behaviour policy ``π_roll`` that sampled
(``batch.sampling_logprobs``), the proximal anchor ``π_old`` that the trainer recomputed
(``batch.old_logprobs``) and the current ``π_θ``. The policy ratio is taken against ``π_old``; the
mismatch between ``π_old`` and ``π_roll`` is corrected by a detached per-token weight
(reference/policy-losses.md §7)::

    log ρ_t = clip(old_t - sampling_t, ±max_log_ratio)              per action token
    log ρ_i = Σ_t m_t · log ρ_t                                       per sequence (product)

    TIS token:     c_t = min(ρ_t, C)           TIS sequence:  c_t = min(ρ_i, C)
    MIS token:     c_t = ρ_t · 1[lo ≤ ρ_t ≤ hi]  MIS sequence:  c_t = ρ_i · 1[lo ≤ ρ_i ≤ hi]

``c`` multiplies the per-token policy loss ``ℓ`` under ``stop_gradient`` (never a KL term).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Batch, require
from losses._common import check_choice, check_number, clamped_log_ratio, masked_mean

CORRECTION_KINDS = ("tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")
#: Default TIS caps per level (SkyRL: token 2, sequence 5; verl/Tunix token 2).
DEFAULT_TIS_CAP = {"token": 2.0, "sequence": 5.0}
#: Default MIS upper bound; the lower bound defaults to ``1/high`` (IcePop's ``[1/thr, thr]``).
DEFAULT_MIS_HIGH = 2.0


@dataclasses.dataclass(frozen=True)
class MismatchCorrection:
    """A validated rollout-mismatch correction (build it with `mismatch_correction`).

    A frozen, hashable value object; pass it as ``correction=`` to any policy term. Fields are the
    resolved hyperparameters (see `mismatch_correction`); construction validates them.

    Args:
      kind: ``"tis"`` (truncate) or ``"mis"`` (mask/reject).
      level: ``"token"`` or ``"sequence"``.
      cap: the TIS cap ``C ≥ 1`` (TIS only; None for MIS).
      low: the MIS lower bound ``0 ≤ lo ≤ 1`` (MIS only; None for TIS).
      high: the MIS upper bound ``hi ≥ 1`` (MIS only; None for TIS).
      max_log_ratio: clamp of ``old - sampling`` per token before ``exp``.

    Returns:
      The value object; ``weights(batch, valid)`` computes the per-token weights and metrics and
      ``as_config()`` gives a plain dict that `mismatch_correction` accepts back.
    """

    kind: str
    level: str
    cap: float | None = None
    low: float | None = None
    high: float | None = None
    max_log_ratio: float = 20.0

    def __post_init__(self) -> None:
        where = "mismatch_correction"
        check_choice(where, "kind", self.kind, CORRECTION_KINDS)
        check_choice(where, "level", self.level, CORRECTION_LEVELS)
        check_number(where, "max_log_ratio", self.max_log_ratio, low=0.0, low_open=True)
        if self.kind == "tis":
            if self.low is not None or self.high is not None:
                raise ValueError(
                    f"{where}: low/high are the bounds of kind='mis'; kind='tis' takes cap"
                )
            if self.cap is None:
                raise ValueError(f"{where}: kind='tis' needs cap")
            cap = check_number(where, "cap", self.cap, low=1.0)
            object.__setattr__(self, "cap", cap)
        else:
            if self.cap is not None:
                raise ValueError(
                    f"{where}: cap is the bound of kind='tis'; kind='mis' takes low/high"
                )
            if self.low is None or self.high is None:
                raise ValueError(f"{where}: kind='mis' needs low and high")
            low = check_number(where, "low", self.low, low=0.0, high=1.0)
            high = check_number(where, "high", self.high, low=1.0)
            object.__setattr__(self, "low", low)
            object.__setattr__(self, "high", high)
        object.__setattr__(self, "max_log_ratio", float(self.max_log_ratio))

    def as_config(self) -> dict[str, Any]:
        """The fields as a plain (JSON-friendly) dict; ``mismatch_correction(**d)`` rebuilds it."""
        return dataclasses.asdict(self)

    def weights(self, batch: Batch, valid_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Per-token correction weights ``c[B, T]`` (stop-gradient, 0 off ``valid_BT``) and metrics.

        Args:
          batch: a `Batch` with ``old_logprobs`` and ``sampling_logprobs``.
          valid_BT: bool[B, T], the tokens the policy term reads (its action mask).

        Returns:
          ``(c, metrics)``: float[B, T] weights, and ``mismatch_weight_mean`` (mean ``c`` over
          valid tokens), ``mismatch_ratio_mean`` (mean token ``ρ_t``) and
          ``mismatch_truncated_frac`` (TIS) or ``mismatch_rejected_frac`` (MIS): the fraction of
          valid tokens (token level) or of rows with a valid token (sequence level) whose
          ratio was truncated or rejected.
        """
        where = "mismatch_correction"
        old = jax.lax.stop_gradient(require(batch, "old_logprobs", where))
        sampling = jax.lax.stop_gradient(require(batch, "sampling_logprobs", where))
        log_rho_BT = clamped_log_ratio(old, sampling, valid_BT, self.max_log_ratio)
        if self.level == "sequence":
            log_rho = jnp.sum(log_rho_BT, axis=1, keepdims=True)  # [B, 1]
        else:
            log_rho = log_rho_BT
        if self.kind == "tis":
            log_cap = math.log(self.cap)  # type: ignore[arg-type]
            # exp never overflows (sequence sums reach ±T·max_log_ratio); min keeps C exact.
            rho = jnp.exp(jnp.minimum(log_rho, log_cap + 1.0))
            flagged = rho > self.cap
            c = jnp.minimum(rho, self.cap)
        else:
            log_high = math.log(self.high)  # type: ignore[arg-type]
            rho = jnp.exp(jnp.minimum(log_rho, log_high + 1.0))
            accept = (rho >= self.low) & (rho <= self.high)
            flagged = ~accept
            c = jnp.where(accept, rho, jnp.zeros((), rho.dtype))
        c_BT = jnp.where(valid_BT, jnp.broadcast_to(c, valid_BT.shape), 0.0)
        c_BT = jax.lax.stop_gradient(c_BT)
        dtype = c_BT.dtype
        if self.level == "sequence":
            rows = jnp.any(valid_BT, axis=1, keepdims=True)
            frac = jnp.sum((flagged & rows).astype(dtype)) / jnp.maximum(
                jnp.sum(rows.astype(dtype)), 1.0
            )
        else:
            frac = masked_mean(flagged.astype(dtype), valid_BT)
        name = "mismatch_truncated_frac" if self.kind == "tis" else "mismatch_rejected_frac"
        metrics = {
            "mismatch_weight_mean": masked_mean(c_BT, valid_BT),
            "mismatch_ratio_mean": masked_mean(jnp.exp(log_rho_BT), valid_BT),
            name: jax.lax.stop_gradient(frac),
        }
        return c_BT, metrics


def mismatch_correction(
    *,
    kind: str = "tis",
    level: str = "token",
    cap: float | None = None,
    low: float | None = None,
    high: float | None = None,
    max_log_ratio: float = 20.0,
) -> MismatchCorrection:
    """Rollout/trainer mismatch correction for any policy term (``correction=``).

    With ``ρ_t = exp(clip(old_logprobs - sampling_logprobs, ±max_log_ratio))`` on action tokens
    and ``ρ_i = Π_t ρ_t`` per sequence (reference/policy-losses.md §7; Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training" for TIS; IcePop/GLM-5 and
    verl ``rollout_rs`` for MIS), the policy term's per-token loss becomes ``sg(c_t)·ℓ_t``::

        kind="tis", level="token":     c_t = min(ρ_t, cap)
        kind="tis", level="sequence":  c_t = min(ρ_i, cap)
        kind="mis", level="token":     c_t = ρ_t · 1[low ≤ ρ_t ≤ high]
        kind="mis", level="sequence":  c_t = ρ_i · 1[low ≤ ρ_i ≤ high]

    The weights are data (stop-gradient), finite, and exactly 0 on masked tokens whatever those
    hold (inf/nan). A KL term of the policy (``grpo``/``reinforce`` ``kl_coef``) is not weighted
    (verl, Fireworks cookbook). In *bypass* mode (``old_logprobs`` defaults to
    ``sampling_logprobs``) every ``ρ`` is 1 and the correction is the identity: the policy ratio
    already corrects the mismatch, and weighting again would double-count (verl ``bypass_mode``).
    The sequence ratio is the product of token ratios (verl/SkyRL/TRL); the Fireworks cookbook's
    client uses the geometric mean instead.

    Args:
      kind: ``"tis"`` (truncated importance sampling) or ``"mis"`` (masked: reject outside
        ``[low, high]``).
      level: ``"token"`` or ``"sequence"``.
      cap: TIS cap ``C ≥ 1``; default 2.0 (token) / 5.0 (sequence), as in SkyRL. TIS only.
      low: MIS lower bound in ``[0, 1]``; default ``1/high`` (IcePop). MIS only.
      high: MIS upper bound ``≥ 1``; default 2.0. MIS only.
      max_log_ratio: clamp of each token's ``old - sampling`` before ``exp`` (default 20).

    Returns:
      A frozen `MismatchCorrection`.

    Example:
      >>> import losses
      >>> losses.mismatch_correction(kind="mis", level="sequence", high=4.0)
      MismatchCorrection(kind='mis', level='sequence', cap=None, low=0.25, high=4.0, max_log_ratio=20.0)
    """
    where = "mismatch_correction"
    check_choice(where, "kind", kind, CORRECTION_KINDS)
    check_choice(where, "level", level, CORRECTION_LEVELS)
    if kind == "tis":
        if cap is None:
            cap = DEFAULT_TIS_CAP[level]
    else:
        if high is None:
            high = DEFAULT_MIS_HIGH
        if low is None:
            high = check_number(where, "high", high, low=1.0)
            low = 1.0 / high
    return MismatchCorrection(
        kind=kind, level=level, cap=cap, low=low, high=high, max_log_ratio=max_log_ratio
    )


def as_correction(correction: Any, where: str) -> MismatchCorrection | None:
    """``None``, a `MismatchCorrection`, or a mapping of `mismatch_correction` keywords."""
    if correction is None or isinstance(correction, MismatchCorrection):
        return correction
    if isinstance(correction, Mapping):
        unknown = set(correction) - {f.name for f in dataclasses.fields(MismatchCorrection)}
        if unknown:
            raise ValueError(f"{where}: unknown correction keys {sorted(unknown)}")
        return mismatch_correction(**correction)
    raise ValueError(
        f"{where}: correction must be None, losses.mismatch_correction(...) or a mapping of its "
        f"keywords, got {correction!r}"
    )
