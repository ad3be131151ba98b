"""Rollout/trainer mismatch corrections and off-policy filters, as detached per-token weights.

The sampler (inference engine) and the trainer compute slightly different logprobs for the same
policy. Decoupled PPO keeps three policies: the behaviour policy ``π_roll`` that sampled
(``batch.sampling_logprobs``), the proximal anchor ``π_old`` that the trainer recomputed
(``batch.old_logprobs``) and the current ``π_θ``. The policy ratio is taken against ``π_old``; the
mismatch between ``π_old`` and ``π_roll`` is corrected or filtered by a detached per-token weight
``c`` that multiplies the per-token policy loss ``ℓ`` (docs/sources.md#mismatch-corrections,
docs/sources.md#mismatch-corrections). With ``lr_t = clip(old_t - sampling_t, ±max_log_ratio)`` on action tokens::

    tis        token: c_t = min(ρ_t, C)              sequence: c_t = min(ρ_i, C)
    mis        token: c_t = ρ_t·1[lo ≤ ρ_t ≤ hi]      sequence: c_t = ρ_i·1[lo ≤ ρ_i ≤ hi]
    icepop     token: c_t = ρ_t·1[lo ≤ ρ_t ≤ hi]      (= mis, token level, band [0.5, 5])
    rejection  c_t = 1[stat within bounds]           stat = k1/k2/k3 of lr at token / seq_sum /
                                                     seq_mean / seq_max level (verl rollout_rs)
    opsm       c_t = 1 - 1[A_t < 0]·1[mean_s(π_b,s - sg(p_s)) > δ]   (DeepSeek-V3.2)

    ρ_t = exp(lr_t),  ρ_i = exp(Σ_t m_t·lr_t)

Rules compose with `correction_chain` (the product of their weights: masks ANDed). A weighting
rule (``tis``/``mis``/``icepop``) may be normalised to batch mean 1 (``batch_normalize=True``),
with the mean carried as data (``Batch.is_weight_mean``, `importance_weight_mean`).

**Denominators.** Every kind folds into the weight: a rejected token's ``c`` is 0 but it stays in
the reduction's denominators, which depend on masks only (docs/conventions.md#the-losses-contract) so that `split_batch` is
exact. verl's rejection sampling instead writes into ``response_mask``, so rejected tokens leave
its local token-mean denominator; to reproduce that, AND ``c > 0`` of the rejection rules into
``action_mask`` on the full batch before `with_normalizers` and correct with the IS rule alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Batch, count, require
from losses._common import check_choice, check_number, clamped_log_ratio, masked_mean, safe

#: The correction kinds `mismatch_correction` builds.
CORRECTION_KINDS = ("tis", "mis", "icepop", "rejection", "opsm")
#: Every level name; `KIND_LEVELS` says which a kind takes.
CORRECTION_LEVELS = ("token", "sequence", "seq_sum", "seq_mean", "seq_max")
#: The levels each kind takes; the first is its default.
KIND_LEVELS = {
    "tis": ("token", "sequence"),
    "mis": ("token", "sequence"),
    "icepop": ("token",),
    "rejection": ("token", "seq_sum", "seq_mean", "seq_max"),
    "opsm": ("sequence",),
}
#: The divergence statistics of ``kind="rejection"`` (verl ``rollout_rs``).
REJECTION_STATISTICS = ("k1", "k2", "k3")
#: Which batch field is OPSM's behaviour policy ``π_b``: ``"sampling"`` or ``"old"`` logprobs.
OPSM_BEHAVIOURS = ("sampling", "old")
#: Default TIS caps per level (SkyRL: token 2, sequence 5; verl/Tunix token 2).
DEFAULT_TIS_CAP = {"token": 2.0, "sequence": 5.0}
#: Default MIS upper bound; the lower bound defaults to ``1/high``.
DEFAULT_MIS_HIGH = 2.0
#: IcePop's band (OpenRLHF ``is_correction_threshold``, verl ``*_token_icepop`` presets).
DEFAULT_ICEPOP_BAND = (0.5, 5.0)
#: Batch normalisation is skipped (divisor 1) when the mean weight is at most this (verl).
MIN_WEIGHT_MEAN = 1e-8

_WEIGHTING = ("tis", "mis", "icepop")
_TAKES = {
    "tis": ("cap", "batch_normalize"),
    "mis": ("low", "high", "batch_normalize"),
    "icepop": ("low", "high", "batch_normalize"),
    "rejection": ("statistic", "low", "high"),
    "opsm": ("delta", "behaviour"),
}
_BASE_KEYS = ("kind", "level", "cap", "low", "high", "max_log_ratio")
_WHERE = "mismatch_correction"


@dataclasses.dataclass(frozen=True, repr=False)
class MismatchCorrection:
    """One validated correction rule (build it with `mismatch_correction`).

    A frozen, hashable value object; pass it (or a `correction_chain` of several) as
    ``correction=`` to any policy term. Fields are the resolved hyperparameters (see
    `mismatch_correction`); construction validates them.

    Args:
      kind: one of `CORRECTION_KINDS`.
      level: one of ``KIND_LEVELS[kind]``.
      cap: the TIS cap ``C ≥ 1`` (``tis`` only).
      low: lower ratio bound in ``[0, 1]`` (``mis``, ``icepop``; ``rejection`` with ``k1``).
      high: upper ratio bound ``≥ 1`` (``mis``, ``icepop``, ``rejection`` ``k1``) or the upper
        bound ``≥ 0`` on a ``k2``/``k3`` statistic.
      max_log_ratio: clamp of ``old - sampling`` per token (the OPSM ratio diagnostics: of
        ``p - π_b``).
      statistic: ``"k1"``, ``"k2"`` or ``"k3"`` (``rejection`` only).
      delta: OPSM threshold ``δ ≥ 0`` on the mean divergence (``opsm`` only).
      behaviour: OPSM's ``π_b``: ``"sampling"`` or ``"old"`` logprobs (``opsm`` only).
      batch_normalize: divide the weights by their batch mean (``tis``/``mis``/``icepop``).

    Returns:
      The value object; ``weights(batch, valid, logprobs)`` computes the per-token weights and
      metrics, ``as_config()`` gives a plain dict that `mismatch_correction` accepts back.
    """

    kind: str
    level: str
    cap: float | None = None
    low: float | None = None
    high: float | None = None
    max_log_ratio: float = 20.0
    statistic: str | None = None
    delta: float | None = None
    behaviour: str | None = None
    batch_normalize: bool = False

    def __post_init__(self) -> None:
        where = _WHERE
        kind = self.kind
        check_choice(where, "kind", kind, CORRECTION_KINDS)
        check_choice(where, "level", self.level, CORRECTION_LEVELS)
        if self.level not in KIND_LEVELS[kind]:
            raise ValueError(
                f"{where}: kind={kind!r} takes level in {KIND_LEVELS[kind]}, got {self.level!r}"
            )
        check_number(where, "max_log_ratio", self.max_log_ratio, low=0.0, low_open=True)
        if not isinstance(self.batch_normalize, bool):
            raise ValueError(
                f"{where}: batch_normalize must be a bool, got {self.batch_normalize!r}"
            )
        if kind == "tis" and (self.low is not None or self.high is not None):
            raise ValueError(
                f"{where}: low/high are the bounds of kind='mis'; kind='tis' takes cap"
            )
        if kind == "mis" and self.cap is not None:
            raise ValueError(f"{where}: cap is the bound of kind='tis'; kind='mis' takes low/high")
        for name in ("cap", "low", "high", "statistic", "delta", "behaviour", "batch_normalize"):
            value = getattr(self, name)
            if value is not None and value is not False and name not in _TAKES[kind]:
                raise ValueError(
                    f"{where}: {name} does not apply to kind={kind!r} (it takes "
                    f"{', '.join(_TAKES[kind])})"
                )
        if kind == "tis":
            if self.cap is None:
                raise ValueError(f"{where}: kind='tis' needs cap")
            self._set("cap", check_number(where, "cap", self.cap, low=1.0))
        elif kind in ("mis", "icepop"):
            if self.low is None or self.high is None:
                raise ValueError(f"{where}: kind={kind!r} needs low and high")
            self._ratio_bounds()
        elif kind == "rejection":
            if self.statistic is None:
                raise ValueError(f"{where}: kind='rejection' needs statistic (k1, k2 or k3)")
            check_choice(where, "statistic", self.statistic, REJECTION_STATISTICS)
            if self.statistic == "k1":
                if self.low is None or self.high is None:
                    raise ValueError(
                        f"{where}: kind='rejection' with statistic='k1' needs low and high"
                    )
                self._ratio_bounds()
            else:
                if self.low is not None:
                    raise ValueError(
                        f"{where}: statistic={self.statistic!r} takes an upper bound only (high); "
                        "low is a ratio bound of statistic='k1'"
                    )
                if self.high is None:
                    raise ValueError(f"{where}: kind='rejection' needs high")
                self._set("high", check_number(where, "high", self.high, low=0.0))
        else:  # opsm
            if self.delta is None:
                raise ValueError(
                    f"{where}: kind='opsm' needs delta (TRL suggests 0.5, slime defaults to 1e-4)"
                )
            self._set("delta", check_number(where, "delta", self.delta, low=0.0))
            check_choice(where, "behaviour", self.behaviour, OPSM_BEHAVIOURS)
        self._set("max_log_ratio", float(self.max_log_ratio))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _ratio_bounds(self) -> None:
        self._set("low", check_number(_WHERE, "low", self.low, low=0.0, high=1.0))
        self._set("high", check_number(_WHERE, "high", self.high, low=1.0))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.as_config().items())
        return f"MismatchCorrection({body})"

    @property
    def rules(self) -> tuple[MismatchCorrection, ...]:
        """``(self,)``: the rules of this correction (a chain has several)."""
        return (self,)

    @property
    def requires(self) -> frozenset[str]:
        """The batch fields that must be present (besides the policy term's own)."""
        if self.kind == "opsm":
            return frozenset({"advantages", f"{self.behaviour}_logprobs"})
        return frozenset({"old_logprobs", "sampling_logprobs"})

    @property
    def reads(self) -> frozenset[str]:
        """The batch fields that can change the weights (``requires`` + ``is_weight_mean``)."""
        return self.requires | ({"is_weight_mean"} if self.batch_normalize else set())

    def as_config(self) -> dict[str, Any]:
        """A plain (JSON-friendly) dict; ``mismatch_correction(**d)`` rebuilds the rule.

        It holds ``kind``, ``level``, ``cap``, ``low``, ``high`` and ``max_log_ratio`` always,
        and ``statistic``, ``delta``, ``behaviour`` and ``batch_normalize`` when set.
        """
        out = {k: getattr(self, k) for k in _BASE_KEYS}
        for k in ("statistic", "delta", "behaviour"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.batch_normalize:
            out["batch_normalize"] = True
        return out

    def weights(
        self, batch: Batch, valid_BT: jax.Array, logprobs: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Per-token correction weights ``c[B, T]`` (stop-gradient, 0 off ``valid_BT``) and metrics.

        Args:
          batch: a `Batch` with ``old_logprobs`` and ``sampling_logprobs`` (``opsm``: its
            behaviour field and ``advantages``; with ``batch_normalize`` optionally
            ``is_weight_mean``).
          valid_BT: bool[B, T], the tokens the policy term reads (its action mask).
          logprobs: the current logprobs float[B, T]; needed by ``opsm`` only (stop-gradiented
            here; masked entries may hold inf/nan).

        Returns:
          ``(c, metrics)``: float[B, T] weights, and

          * ``mismatch_weight_mean``: mean ``c`` over valid tokens;
          * ``mismatch_ratio_mean``, ``mismatch_ratio_min``, ``mismatch_ratio_max``,
            ``mismatch_ratio_ess``: the token ratios ``ρ_t = exp(lr_t)`` over valid tokens (mean,
            min, max, effective sample size ``(Σρ)²/Σρ²``; 0 without valid tokens). For
            ``opsm`` the ratio is ``exp(clip(p - π_b, ±max_log_ratio))``;
          * ``mismatch_truncated_frac`` (``tis``) or ``mismatch_rejected_frac`` (the others): the
            fraction of valid tokens (token level, ``opsm``) or of rows with a valid token
            (sequence levels) whose weight was truncated or zeroed;
          * ``mismatch_is_weight_mean`` with ``batch_normalize``: the divisor used.
        """
        return _weights(self.rules, batch, valid_BT, logprobs, indexed=False)


@dataclasses.dataclass(frozen=True)
class CorrectionChain:
    """Several correction rules applied together: ``c = Π_r c_r`` (masks ANDed).

    Build it with `correction_chain`. At most one rule is a weighting rule (``tis``, ``mis``,
    ``icepop``); the others are masks (``rejection``, ``opsm``). A batch-normalised weighting
    rule is normalised on its own weights, before the masks of the other rules.

    Args:
      rules: the rules, at least two (a chain of one rule is that rule).

    Returns:
      The value object, with the interface of `MismatchCorrection` (``weights``,
      ``as_config`` — a list of rule dicts —, ``requires``, ``reads``, ``rules``).
    """

    rules: tuple[MismatchCorrection, ...]

    def __post_init__(self) -> None:
        rules = tuple(self.rules)
        if len(rules) < 2 or not all(isinstance(r, MismatchCorrection) for r in rules):
            raise ValueError(
                "correction_chain: a chain holds two or more losses.mismatch_correction rules"
            )
        weighting = [r.kind for r in rules if r.kind in _WEIGHTING]
        if len(weighting) > 1:
            raise ValueError(
                f"correction_chain: at most one weighting rule (tis, mis, icepop), got {weighting}; "
                "chain masks (rejection, opsm) with it instead"
            )
        object.__setattr__(self, "rules", rules)

    @property
    def requires(self) -> frozenset[str]:
        """The union of the rules' required fields."""
        return frozenset().union(*(r.requires for r in self.rules))

    @property
    def reads(self) -> frozenset[str]:
        """The union of the rules' read fields."""
        return frozenset().union(*(r.reads for r in self.rules))

    def as_config(self) -> list[dict[str, Any]]:
        """The rules' dicts, in order; ``correction=`` accepts the list back."""
        return [r.as_config() for r in self.rules]

    def weights(
        self, batch: Batch, valid_BT: jax.Array, logprobs: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Per-token weights ``Π_r c_r`` (stop-gradient, 0 off ``valid_BT``) and metrics.

        Args:
          batch: a `Batch` with the fields every rule requires.
          valid_BT: bool[B, T], the policy term's action mask.
          logprobs: the current logprobs float[B, T] (needed with an ``opsm`` rule).

        Returns:
          ``(c, metrics)``: ``mismatch_weight_mean`` and the ``mismatch_ratio_*`` diagnostics as
          for one rule (the ratio of the first non-``opsm`` rule), ``mismatch_is_weight_mean``
          when the weighting rule is batch-normalised, and per rule ``i`` its fraction as
          ``mismatch_{i}_truncated_frac`` / ``mismatch_{i}_rejected_frac``.
        """
        return _weights(self.rules, batch, valid_BT, logprobs, indexed=True)


Correction = MismatchCorrection | CorrectionChain


def mismatch_correction(
    *,
    kind: str = "tis",
    level: str | None = None,
    cap: float | None = None,
    low: float | None = None,
    high: float | None = None,
    max_log_ratio: float = 20.0,
    statistic: str | None = None,
    delta: float | None = None,
    behaviour: str | None = None,
    batch_normalize: bool = False,
) -> MismatchCorrection:
    """A rollout-mismatch correction or off-policy filter for any policy term (``correction=``).

    With ``lr_t = clip(old_logprobs - sampling_logprobs, ±max_log_ratio)`` on action tokens,
    ``ρ_t = exp(lr_t)``, ``ρ_i = exp(Σ_t m_t·lr_t)`` (the product of the token ratios), the
    policy term's per-token loss becomes ``sg(c_t)·ℓ_t`` (never the KL term)::

        tis,    token / sequence:  c_t = min(ρ_t, cap)              / min(ρ_i, cap)
        mis,    token / sequence:  c_t = ρ_t·1[low ≤ ρ_t ≤ high]    / ρ_i·1[low ≤ ρ_i ≤ high]
        icepop, token:             c_t = ρ_t·1[low ≤ ρ_t ≤ high]    (band [0.5, 5])
        rejection:                 c_t = 1[S within bounds]
        opsm:                      c_t = 0 if A_t < 0 and D_i > delta, else 1

    **Sources** (docs/sources.md#mismatch-corrections, docs/sources.md#mismatch-corrections): TIS — Yao et al. 2025,
    verl ``rollout_is`` with a float threshold, SkyRL ``tis_ratio_type``; MIS — TRL
    ``token_mask``/``sequence_mask``; IcePop — Ring-1T as OpenRLHF ``is_correction_type=
    "icepop"`` and verl ``rollout_is`` with a ``"lo_hi"`` threshold (``exp(old - roll)``, keep
    inclusive, zero outside, the PPO clip kept); rejection — verl ``rollout_rs``
    (``rollout_corr_helper.py``); OPSM — DeepSeek-V3.2 as TRL ``off_policy_mask_threshold`` and
    slime ``--use-opsm``.

    **Rejection** (``kind="rejection"``), on the per-token statistic of ``lr``: ``k1 = -lr`` (=
    log π_roll/π_old), ``k2 = lr²/2``, ``k3 = e^{lr} - 1 - lr``; ``S`` is the statistic per
    token (``level="token"``), or its masked sum / mean / max over the row (``"seq_sum"``,
    ``"seq_mean"``, ``"seq_max"``). ``k1`` takes **ratio bounds on π_roll/π_old** (the inverse
    of the IS ratio, as verl): keep iff ``log low ≤ S ≤ log high`` (``low`` defaults to
    ``1/high``; ``low = 0`` means no lower bound). ``k2``/``k3`` take an upper bound only: keep iff
    ``S ≤ high``. ``seq_max`` with ``k1`` (not in verl) keeps a row iff *every* token's ``k1`` is
    within the bounds: SkyRL's outlier mask, with mirrored bounds. Chain several rules with
    `correction_chain` (ANDed, like verl's comma-separated options).

    **OPSM** (``kind="opsm"``): ``D_i = Σ_t m_t·(π_b,t - sg(p_t)) / max(N_i, 1)`` with ``π_b``
    the ``sampling`` (default; TRL) or ``old`` (slime) logprobs; a token is dropped iff its
    advantage is negative and its row's ``D_i > delta`` (with per-row advantages: the whole
    sequence). ``A = 0`` is kept. It needs the current logprobs (``weights(..., logprobs=)``; the
    policy terms pass them).

    **Batch normalisation** (``batch_normalize=True``, ``tis``/``mis``/``icepop``; verl
    ``rollout_is_batch_normalize``): ``c ← c / μ`` with ``μ`` the mean weight over valid tokens
    (token level) or over rows with a valid token (sequence level), taken after truncation;
    skipped (``μ := 1``) when ``μ ≤ 1e-8``. ``μ`` is read from ``batch.is_weight_mean`` when set
    (compute it over the optimizer batch with `importance_weight_mean`); otherwise the term
    computes it from its own batch, and then `split_batch` micro-batches are **not** exact.
    Normalised weights can exceed ``cap``.

    **Denominators**: every kind folds into the weight — rejected tokens stay in the reduction's
    denominators (like IcePop, OPSM, SkyRL; unlike verl's rejection, which edits the mask).

    The weights are data (stop-gradient), finite, and exactly 0 on masked tokens whatever those
    hold (inf/nan). In *bypass* mode (``old_logprobs`` defaults to ``sampling_logprobs``) every
    ``lr`` is 0: TIS/MIS/IcePop/rejection are the identity (verl ``bypass_mode``). The Fireworks
    cookbook's client uses the geometric mean for its sequence ratio instead of the product.

    Args:
      kind: one of `CORRECTION_KINDS`: ``"tis"``, ``"mis"``, ``"icepop"``, ``"rejection"``,
        ``"opsm"``.
      level: one of ``KIND_LEVELS[kind]``; default ``"token"`` (``"sequence"`` for ``opsm``).
      cap: TIS cap ``C ≥ 1``; default 2.0 (token) / 5.0 (sequence), as in SkyRL. TIS only.
      low: lower ratio bound in ``[0, 1]`` (``mis``/``icepop``/``rejection`` ``k1``); default
        ``1/high`` (``icepop``: 0.5, whatever ``high``).
      high: upper ratio bound ``≥ 1``; default 2.0 (``mis``), 5.0 (``icepop``); required for
        ``rejection`` (``k2``/``k3``: the bound ``≥ 0`` on the statistic).
      max_log_ratio: clamp of each token's ``old - sampling`` before ``exp`` (default 20).
      statistic: ``"k1"``, ``"k2"`` or ``"k3"``; required for ``rejection``.
      delta: OPSM's ``δ ≥ 0``; required for ``opsm`` (TRL suggests 0.5, slime defaults to 1e-4).
      behaviour: OPSM's ``π_b``, ``"sampling"`` (default) or ``"old"``.
      batch_normalize: normalise the weights to batch mean 1 (``tis``/``mis``/``icepop``).

    Returns:
      A frozen `MismatchCorrection`.

    Example:
      >>> import losses
      >>> losses.mismatch_correction(kind="mis", level="sequence", high=4.0)
      MismatchCorrection(kind='mis', level='sequence', cap=None, low=0.25, high=4.0, max_log_ratio=20.0)
      >>> losses.mismatch_correction(kind="rejection", level="seq_mean", statistic="k3", high=0.01)
      MismatchCorrection(kind='rejection', level='seq_mean', cap=None, low=None, high=0.01, max_log_ratio=20.0, statistic='k3')
    """
    where = _WHERE
    check_choice(where, "kind", kind, CORRECTION_KINDS)
    if level is None:
        level = KIND_LEVELS[kind][0]
    check_choice(where, "level", level, CORRECTION_LEVELS)
    if kind == "tis":
        if cap is None and level in DEFAULT_TIS_CAP:
            cap = DEFAULT_TIS_CAP[level]
    elif kind == "icepop":
        low = DEFAULT_ICEPOP_BAND[0] if low is None else low
        high = DEFAULT_ICEPOP_BAND[1] if high is None else high
    elif kind == "mis" or (kind == "rejection" and statistic == "k1"):
        if high is None and kind == "mis":
            high = DEFAULT_MIS_HIGH
        if low is None and high is not None:
            high = check_number(where, "high", high, low=1.0)
            low = 1.0 / high
    elif kind == "opsm" and behaviour is None:
        behaviour = "sampling"
    return MismatchCorrection(
        kind=kind,
        level=level,
        cap=cap,
        low=low,
        high=high,
        max_log_ratio=max_log_ratio,
        statistic=statistic,
        delta=delta,
        behaviour=behaviour,
        batch_normalize=batch_normalize,
    )


def correction_chain(*rules: Any) -> Correction:
    """Several corrections applied together: the product of their weights (masks ANDed).

    ``c_t = Π_r c_{r,t}``. Examples: verl's ``decoupled_seq_is_rs`` preset is
    ``correction_chain(tis sequence cap 2, rejection seq_sum k1 [0.5, 2])``; SkyRL's masks are
    rejection rules with mirrored bounds chained with its TIS (the order does not matter: the
    weights multiply). Nested chains are flattened.

    Args:
      *rules: `mismatch_correction` rules, mappings of its keywords, or chains; at most one
        weighting rule (``tis``/``mis``/``icepop``).

    Returns:
      A `CorrectionChain`, or the rule itself when given one.

    Example:
      >>> import losses
      >>> chain = losses.correction_chain(
      ...     losses.mismatch_correction(kind="tis", level="sequence", cap=2.0),
      ...     dict(kind="rejection", level="seq_sum", statistic="k1", low=0.5, high=2.0))
      >>> [r.kind for r in chain.rules]
      ['tis', 'rejection']
    """
    flat: list[MismatchCorrection] = []
    for rule in rules:
        corr = as_correction(rule, "correction_chain")
        if corr is None:
            raise ValueError("correction_chain: a rule is None")
        flat.extend(corr.rules)
    if not flat:
        raise ValueError("correction_chain: give at least one rule")
    if len(flat) == 1:
        return flat[0]
    return CorrectionChain(rules=tuple(flat))


def as_correction(correction: Any, where: str) -> Correction | None:
    """``None``, a correction, a mapping of `mismatch_correction` keywords, or a list of those
    (a chain, as ``CorrectionChain.as_config()`` writes it)."""
    if correction is None or isinstance(correction, MismatchCorrection | CorrectionChain):
        return correction
    if isinstance(correction, Mapping):
        unknown = set(correction) - {f.name for f in dataclasses.fields(MismatchCorrection)}
        if unknown:
            raise ValueError(f"{where}: unknown correction keys {sorted(unknown)}")
        return mismatch_correction(**correction)
    if isinstance(correction, Sequence) and not isinstance(correction, str):
        return correction_chain(*correction)
    raise ValueError(
        f"{where}: correction must be None, losses.mismatch_correction(...), "
        f"losses.correction_chain(...) or a mapping (or list of mappings) of its keywords, got "
        f"{correction!r}"
    )


def importance_weight_mean(batch: Batch, correction: Any) -> jax.Array:
    """The divisor a batch-normalised correction uses, computed over ``batch``: set it as data.

    ``μ`` is the mean weight of the correction's batch-normalised rule before normalisation:
    over the valid (action) tokens at token level, over rows with an action token at sequence
    level; 1 when ``μ ≤ 1e-8`` (normalisation skipped). Compute it on the optimizer batch and
    pass it as ``Batch.is_weight_mean``, so that every `split_batch` micro-batch divides by the
    full batch's mean and the micro-batch losses sum to the full-batch loss exactly. Any
    ``is_weight_mean`` already in ``batch`` is ignored.

    Args:
      batch: the optimizer `Batch` (``action_mask``, ``old_logprobs``, ``sampling_logprobs``).
      correction: a correction (or chain, or its config) with a ``batch_normalize=True`` rule.

    Returns:
      A 0-d array (the batch's dtype).

    Example:
      >>> import numpy as np, losses
      >>> corr = losses.mismatch_correction(kind="tis", cap=2.0, batch_normalize=True)
      >>> b = losses.Batch(action_mask=np.ones((1, 3)), advantages=np.ones(1),
      ...                  sampling_logprobs=np.log([[0.5, 0.2, 0.1]]),
      ...                  old_logprobs=np.log([[0.5, 0.6, 0.04]]))
      >>> round(float(losses.importance_weight_mean(b, corr)), 5)
      1.13333
    """
    corr = as_correction(correction, "importance_weight_mean")
    rules = [] if corr is None else [r for r in corr.rules if r.batch_normalize]
    if not rules:
        raise ValueError("importance_weight_mean: the correction has no batch_normalize=True rule")
    batch = jax.lax.stop_gradient(batch)
    valid = jnp.asarray(batch.action_mask) > 0
    rule = rules[0]
    c_BT, _, c_row = _weighting(rule, _log_ratio(rule, batch, valid), valid)
    return _divisor(_raw_mean(rule, c_BT, c_row, valid))


# -- implementation ----------------------------------------------------------------------------


def _log_ratio(rule: MismatchCorrection, batch: Batch, valid_BT: jax.Array) -> jax.Array:
    """``clip(old - sampling, ±max_log_ratio)`` on valid tokens, 0 elsewhere."""
    old = jax.lax.stop_gradient(require(batch, "old_logprobs", _WHERE))
    sampling = jax.lax.stop_gradient(require(batch, "sampling_logprobs", _WHERE))
    return clamped_log_ratio(old, sampling, valid_BT, rule.max_log_ratio)


def _rows(valid_BT: jax.Array) -> jax.Array:
    return jnp.any(valid_BT, axis=1, keepdims=True)


def _row_frac(flagged_B1: jax.Array, valid_BT: jax.Array, dtype) -> jax.Array:
    rows = _rows(valid_BT)
    return jnp.sum((flagged_B1 & rows).astype(dtype)) / jnp.maximum(
        jnp.sum(rows.astype(dtype)), 1.0
    )


def _weighting(rule: MismatchCorrection, log_rho_BT: jax.Array, valid_BT: jax.Array):
    """TIS/MIS/IcePop before normalisation: ``(c_BT, frac, c_row)`` (``c_row``: the row weight
    ``[B, 1]`` at sequence level, 0 on rows without a valid token; None at token level)."""
    if rule.level == "sequence":
        log_rho = jnp.sum(log_rho_BT, axis=1, keepdims=True)  # [B, 1]
    else:
        log_rho = log_rho_BT
    if rule.kind == "tis":
        assert rule.cap is not None  # set for tis (MismatchCorrection's rules)
        log_cap = math.log(rule.cap)
        # exp never overflows (sequence sums reach ±T·max_log_ratio); min keeps C exact.
        rho = jnp.exp(jnp.minimum(log_rho, log_cap + 1.0))
        flagged = rho > rule.cap
        c = jnp.minimum(rho, rule.cap)
    else:
        assert rule.low is not None and rule.high is not None  # set for mis and icepop
        log_high = math.log(rule.high)
        rho = jnp.exp(jnp.minimum(log_rho, log_high + 1.0))
        accept = (rho >= rule.low) & (rho <= rule.high)
        flagged = ~accept
        c = jnp.where(accept, rho, jnp.zeros((), rho.dtype))
    c_BT = jnp.where(valid_BT, jnp.broadcast_to(c, valid_BT.shape), 0.0)
    c_BT = jax.lax.stop_gradient(c_BT)
    dtype = c_BT.dtype
    if rule.level == "sequence":
        frac = _row_frac(flagged, valid_BT, dtype)
        return c_BT, frac, jnp.where(_rows(valid_BT), c, 0.0)
    return c_BT, masked_mean(flagged.astype(dtype), valid_BT), None


def _raw_mean(rule, c_BT, c_row, valid_BT) -> jax.Array:
    dtype = c_BT.dtype
    if rule.level == "sequence":
        rows = _rows(valid_BT).astype(dtype)
        return jnp.sum(c_row) / jnp.maximum(jnp.sum(rows), 1.0)
    return jnp.sum(c_BT) / jnp.maximum(count(valid_BT.astype(dtype)), 1.0)


def _divisor(mean: jax.Array) -> jax.Array:
    return jnp.where(mean > MIN_WEIGHT_MEAN, mean, jnp.ones((), mean.dtype))


def _rejection(rule: MismatchCorrection, log_rho_BT: jax.Array, valid_BT: jax.Array):
    """verl rejection sampling: ``(keep_BT, frac)``."""
    lr = log_rho_BT  # 0 off valid
    dtype = lr.dtype
    if rule.statistic == "k1":
        stat = -lr
    elif rule.statistic == "k2":
        stat = 0.5 * jnp.square(lr)
    else:
        stat = jnp.expm1(lr) - lr
    stat = safe(stat, valid_BT)
    if rule.statistic == "k1":
        log_low = -math.inf if rule.low == 0.0 else math.log(rule.low)  # type: ignore[arg-type]
        log_high = math.log(rule.high)  # type: ignore[arg-type]

        def keep_fn(s_lo, s_hi):
            return (s_lo >= log_low) & (s_hi <= log_high)
    else:

        def keep_fn(s_lo, s_hi):
            return s_hi <= rule.high

    if rule.level == "token":
        keep = keep_fn(stat, stat) | ~valid_BT
        frac = masked_mean((~keep).astype(dtype), valid_BT)
    else:
        m = valid_BT.astype(dtype)
        if rule.level == "seq_sum":
            s = jnp.sum(stat, axis=1, keepdims=True)
            keep = keep_fn(s, s)
        elif rule.level == "seq_mean":
            n = jnp.sum(m, axis=1, keepdims=True)
            s = jnp.sum(stat, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
            keep = keep_fn(s, s)
        else:  # seq_max: the worst token (k1: both ends)
            s_hi = jnp.max(jnp.where(valid_BT, stat, -jnp.inf), axis=1, keepdims=True)
            s_lo = jnp.min(jnp.where(valid_BT, stat, jnp.inf), axis=1, keepdims=True)
            keep = keep_fn(s_lo, s_hi)
        frac = _row_frac(~keep, valid_BT, dtype)
        keep = jnp.broadcast_to(keep, valid_BT.shape)
    return keep, frac


def _opsm(rule: MismatchCorrection, batch: Batch, valid_BT: jax.Array, logprobs: Any):
    """Off-policy sequence masking: ``(keep_BT, frac, log ratio p - π_b for diagnostics)``."""
    if logprobs is None:
        raise ValueError(
            "mismatch_correction: kind='opsm' needs the current logprobs: "
            "weights(batch, valid, logprobs=lp)"
        )
    field = f"{rule.behaviour}_logprobs"
    behaviour = jax.lax.stop_gradient(require(batch, field, _WHERE))
    lp = jax.lax.stop_gradient(jnp.asarray(logprobs))
    adv = jax.lax.stop_gradient(jnp.asarray(require(batch, "advantages", _WHERE)))
    if adv.ndim == 1:
        adv = jnp.broadcast_to(adv[:, None], valid_BT.shape)
    adv = safe(adv, valid_BT)
    diff = safe(behaviour, valid_BT) - safe(lp, valid_BT)
    dtype = diff.dtype
    n = jnp.sum(valid_BT.astype(dtype), axis=1, keepdims=True)
    mean = jnp.sum(diff, axis=1, keepdims=True) / jnp.maximum(n, 1.0)  # [B, 1]
    assert rule.delta is not None  # set for opsm
    drop = valid_BT & (adv < 0) & (mean > rule.delta)
    frac = masked_mean(drop.astype(dtype), valid_BT)
    log_ratio = jnp.clip(-diff, -rule.max_log_ratio, rule.max_log_ratio)
    return ~drop, frac, log_ratio


def _weights(rules, batch, valid_BT, logprobs, *, indexed: bool):
    """The product of the rules' weights, and the metrics (see `MismatchCorrection.weights`)."""
    c_BT = None
    diag, diag_is_opsm = None, True  # the diagnostics' log-ratio: the first non-opsm rule's
    metrics: dict[str, jax.Array] = {}
    for i, rule in enumerate(rules):
        rule_c = None
        flag = "truncated" if rule.kind == "tis" else "rejected"
        if rule.kind == "opsm":
            keep, frac, log_ratio = _opsm(rule, batch, valid_BT, logprobs)
        else:
            log_ratio = _log_ratio(rule, batch, valid_BT)
            if rule.kind == "rejection":
                keep, frac = _rejection(rule, log_ratio, valid_BT)
            else:
                rule_c, frac, c_row = _weighting(rule, log_ratio, valid_BT)
                if rule.batch_normalize:
                    data = batch.is_weight_mean
                    if data is None:
                        mean = _raw_mean(rule, rule_c, c_row, valid_BT)
                    else:
                        mean = jax.lax.stop_gradient(jnp.asarray(data, rule_c.dtype))
                    divisor = _divisor(mean)
                    rule_c = rule_c / divisor
                    metrics["mismatch_is_weight_mean"] = divisor
        if diag is None or (diag_is_opsm and rule.kind != "opsm"):
            diag, diag_is_opsm = log_ratio, rule.kind == "opsm"
        if rule_c is None:
            rule_c = jnp.where(valid_BT & keep, 1.0, 0.0).astype(log_ratio.dtype)
        c_BT = rule_c if c_BT is None else c_BT * rule_c
        name = f"mismatch_{i}_{flag}_frac" if indexed else f"mismatch_{flag}_frac"
        metrics[name] = jax.lax.stop_gradient(frac)
    assert c_BT is not None and diag is not None  # at least one rule
    c_BT = jax.lax.stop_gradient(c_BT)
    rho = jax.lax.stop_gradient(jnp.exp(diag))
    dtype = rho.dtype
    zero = jnp.zeros((), dtype)
    s1 = jnp.sum(jnp.where(valid_BT, rho, zero))
    s2 = jnp.sum(jnp.where(valid_BT, jnp.square(rho), zero))
    any_valid = jnp.any(valid_BT)
    metrics.update(
        {
            "mismatch_weight_mean": masked_mean(c_BT, valid_BT),
            "mismatch_ratio_mean": masked_mean(rho, valid_BT),
            "mismatch_ratio_min": jnp.where(
                any_valid, jnp.min(jnp.where(valid_BT, rho, jnp.inf)), zero
            ),
            "mismatch_ratio_max": jnp.max(jnp.where(valid_BT, rho, zero)),
            "mismatch_ratio_ess": jnp.where(s2 > 0, s1 * s1 / jnp.where(s2 > 0, s2, 1.0), zero),
        }
    )
    return c_BT, metrics
