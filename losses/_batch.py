"""The `Batch` pytree and the `Term` type that every loss constructor returns.

Data conventions (docs/conventions.md#data-conventions): every per-token array is *target-aligned* and padded to
``[B, T]``; entry ``[i, t]`` describes target token ``t`` of row ``i``. Masks are 0/1 floats and
padding is never inferred from token ids. The only differentiable input of a term is
``logprobs``; everything in a `Batch` is data.

`Batch` is strict: its fields are the explicit dataclass fields below (`FIELDS`), and
user-defined arrays go only through the ``extra={...}`` mapping. A misspelt keyword fails at
construction with the closest known name (a silently ignored ``obs_masks`` would make ECHO a
zero loss).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any, Never

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Metrics = dict[str, Array]
TermFn = Callable[[Array, "Batch"], tuple[Array, Metrics]]

#: The per-token (or per-row) data fields a runner sequence may carry into a `Batch`; the one
#: list the runner imports.
DATA_FIELDS = (
    "action_mask",
    "obs_mask",
    "advantages",
    "sampling_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "weights",
    "teacher_logprobs",
    "old_values",
    "returns",
)
#: Per-row ``[B]`` fields (not carried per token by a runner sequence).
ROW_FIELDS = ("labels",)
#: Per-token top-K fields, ``[B, T, K]`` (any ``K ≥ 1``).
TOPK_FIELDS = ("teacher_topk_logprobs",)
#: Optional global normalizers: 0-d arrays that `split_batch` sets so that micro-batches carry
#: the full batch's denominators.
NORMALIZER_FIELDS = ("num_rows", "num_action_tokens", "num_obs_tokens")
#: Other 0-d batch-global statistics carried as data (never sliced by `split_batch`, so that
#: micro-batches see the full batch's value): KTO's KL baseline ``z0``, the batch mean of
#: importance weights used to normalise them to mean 1.
GLOBAL_FIELDS = ("kl_baseline", "is_weight_mean")
#: The 0-d fields `split_batch` passes to every micro-batch unchanged.
UNSLICED_FIELDS = NORMALIZER_FIELDS + GLOBAL_FIELDS
#: Every explicit field of a `Batch`, in pytree order (then the ``extra`` entries by name).
FIELDS = DATA_FIELDS + ROW_FIELDS + TOPK_FIELDS + NORMALIZER_FIELDS + GLOBAL_FIELDS
#: Backwards-compatible name of `FIELDS`.
CORE_FIELDS = FIELDS
#: Masks: 0/1 values, disjoint.
MASK_FIELDS = ("action_mask", "obs_mask")
#: Anchor / reference log-probabilities: ``≤ 0`` where read.
LOGPROB_FIELDS = ("sampling_logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs")
#: Real-valued per-token fields that must be finite on action tokens (critic targets).
VALUE_FIELDS = ("old_values", "returns")
#: What a term takes as its first argument (`Term.argument`): per-token logprobs float[B, T]
#: (``≤ 0``), top-K student logprobs float[B, T, K] (``≤ 0``, the top-K distillation terms) or
#: value predictions float[B, T] (any finite value, the critic).
ARGUMENTS = ("logprobs", "topk_logprobs", "values")
_PER_TOKEN_FIELDS = tuple(f for f in DATA_FIELDS if f not in ("action_mask", "advantages"))


class UnknownFieldError(TypeError, ValueError):
    """An unknown `Batch` keyword (a ``TypeError`` like any bad keyword, and a ``ValueError``
    like every other bad-input error of this package)."""


def unknown_field_message(where: str, name: str, known: tuple[str, ...]) -> str:
    """``"<where>: unknown field 'x'; did you mean 'y'? Known fields: ..."``."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (
        f"{where}: unknown field {name!r}{hint} (known fields: {', '.join(known)}; "
        "user-defined arrays go in extra={...})"
    )


def _as_array(name: str, value: Any) -> Any:
    """Keeps numpy and jax arrays (and tracers) as they are; converts lists; masks become float."""
    if value is None:
        return None
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        try:
            value = np.asarray(value)
        except Exception as exc:  # pragma: no cover - numpy gives a clear message already
            raise ValueError(f"Batch field '{name}' is not array-like: {exc}") from exc
    if value.dtype == object:
        raise ValueError(f"Batch field '{name}' has dtype object; expected a numeric array")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        value = value.astype(jnp.float32)
    return value


@dataclasses.dataclass(frozen=True, eq=False, init=False, repr=False)
class Batch:
    """A padded batch of target-aligned per-token arrays; a frozen dataclass and a JAX pytree.

    Args:
      action_mask: 1.0 on tokens the policy generated (policy-loss targets), else 0.0;
        float[B, T]. Required.
      obs_mask: 1.0 on environment-observation tokens (ECHO env-CE targets); float[B, T].
        ``None`` means no observation tokens.
      advantages: per-row float[B] or per-token float[B, T] advantages.
      sampling_logprobs: behaviour-policy (sampler) logprobs of the targets; float[B, T].
      old_logprobs: proximal anchor for importance ratios; float[B, T]. Defaults to
        ``sampling_logprobs``.
      ref_logprobs: KL-reference logprobs; float[B, T].
      weights: explicit per-token cross-entropy weights (any sign); float[B, T].
      teacher_logprobs: a distillation teacher's logprobs of the sampled targets; float[B, T].
      old_values: the critic's value predictions when the data was collected (the anchor of the
        clipped value loss); float[B, T].
      returns: value targets (e.g. GAE returns); float[B, T].
      labels: per-row 0/1 labels (KTO: 1 = desirable completion); float[B].
      teacher_topk_logprobs: the teacher's logprobs of its top-K tokens at each position;
        float[B, T, K].
      num_rows: optional 0-d count of the optimizer batch's rows that have at least one action
        or observation token (the ``N`` of the seq-mean reductions). ``None`` = count this batch.
      num_action_tokens: optional 0-d total of ``action_mask`` over the optimizer batch.
      num_obs_tokens: optional 0-d total of ``obs_mask`` over the optimizer batch.
      kl_baseline: optional 0-d KL baseline of KTO (``z0``), computed over the optimizer batch.
      is_weight_mean: optional 0-d batch mean of the importance weights that a correction
        normalises to mean 1.
      extra: user-defined fields by name (custom terms read them with ``batch.extra[name]``
        or ``batch.get(name)``); arrays with a leading ``[B]`` axis are split by `split_batch`.

    Any other keyword raises `UnknownFieldError` naming it and the closest known field. Shapes
    are validated eagerly (``ValueError`` naming the field); values are validated on the host by
    `check_batch`. Integer or bool masks are converted to float32.

    Returns:
      The immutable batch; ``batch.replace(...)`` makes a validated copy.
    """

    action_mask: Any
    obs_mask: Any = None
    advantages: Any = None
    sampling_logprobs: Any = None
    old_logprobs: Any = None
    ref_logprobs: Any = None
    weights: Any = None
    teacher_logprobs: Any = None
    old_values: Any = None
    returns: Any = None
    labels: Any = None
    teacher_topk_logprobs: Any = None
    num_rows: Any = None
    num_action_tokens: Any = None
    num_obs_tokens: Any = None
    kl_baseline: Any = None
    is_weight_mean: Any = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __init__(
        self,
        *,
        action_mask: Any,
        obs_mask: Any = None,
        advantages: Any = None,
        sampling_logprobs: Any = None,
        old_logprobs: Any = None,
        ref_logprobs: Any = None,
        weights: Any = None,
        teacher_logprobs: Any = None,
        old_values: Any = None,
        returns: Any = None,
        labels: Any = None,
        teacher_topk_logprobs: Any = None,
        num_rows: Any = None,
        num_action_tokens: Any = None,
        num_obs_tokens: Any = None,
        kl_baseline: Any = None,
        is_weight_mean: Any = None,
        extra: Mapping[str, Any] | None = None,
        **unknown: Never,
    ) -> None:
        if unknown:
            name = sorted(unknown)[0]
            raise UnknownFieldError(unknown_field_message("Batch", name, FIELDS + ("extra",)))
        if action_mask is None:
            raise ValueError("Batch field 'action_mask' is required")
        if old_logprobs is None:
            old_logprobs = sampling_logprobs
        values = dict(
            action_mask=action_mask,
            obs_mask=obs_mask,
            advantages=advantages,
            sampling_logprobs=sampling_logprobs,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            weights=weights,
            teacher_logprobs=teacher_logprobs,
            old_values=old_values,
            returns=returns,
            labels=labels,
            teacher_topk_logprobs=teacher_topk_logprobs,
            num_rows=num_rows,
            num_action_tokens=num_action_tokens,
            num_obs_tokens=num_obs_tokens,
            kl_baseline=kl_baseline,
            is_weight_mean=is_weight_mean,
        )
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ValueError(
                f"Batch field 'extra' must be a mapping of name -> array, got {extra!r}"
            )
        for key in extra:
            if not isinstance(key, str) or not key or key.startswith("_"):
                raise ValueError(
                    f"Batch extra field names must be non-empty strings not starting with '_': "
                    f"{key!r}"
                )
            if key in FIELDS or key == "extra":
                raise ValueError(
                    f"Batch extra field {key!r} shadows the explicit field of that name; pass it "
                    f"as {key}=..."
                )
        fields = {k: _as_array(k, v) for k, v in values.items()}
        extras = {k: _as_array(k, v) for k, v in sorted(extra.items())}
        _check_shapes(fields, extras)
        for k, v in fields.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "extra", extras)

    # -- field access ------------------------------------------------------------------------
    def get(self, name: str, default: Any = None) -> Any:
        """An explicit field or an ``extra`` entry by name (``default`` when absent or None)."""
        if name in FIELDS:
            value = getattr(self, name)
        else:
            value = self.extra.get(name)
        return default if value is None else value

    @property
    def fields(self) -> dict[str, Any]:
        """Explicit fields (including ``None`` ones) in pytree order, then the extra entries."""
        out = {k: getattr(self, k) for k in FIELDS}
        out.update(self.extra)
        return out

    @property
    def extra_fields(self) -> tuple[str, ...]:
        """Names of the ``extra`` entries."""
        return tuple(self.extra)

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, T)``."""
        return tuple(self.action_mask.shape)

    def replace(self, **changes: Any) -> Batch:
        """A copy with some fields replaced (validated like the constructor).

        ``extra=`` replaces the whole mapping. Replacing ``sampling_logprobs`` does not touch
        ``old_logprobs``: the default only applies at construction.
        """
        for name in changes:
            if name not in FIELDS and name != "extra":
                raise UnknownFieldError(
                    unknown_field_message("Batch.replace", name, FIELDS + ("extra",))
                )
        values = {k: getattr(self, k) for k in FIELDS}
        values["extra"] = dict(self.extra)
        values.update(changes)
        return Batch(**values)

    def __repr__(self) -> str:
        parts = []
        for k, v in self.fields.items():
            if v is not None:
                parts.append(f"{k}={getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', ()))}")
        return f"Batch({', '.join(parts)})"

    # -- pytree ------------------------------------------------------------------------------
    def _tree_flatten_with_keys(self):
        children = [(jax.tree_util.GetAttrKey(k), getattr(self, k)) for k in FIELDS]
        children += [(jax.tree_util.DictKey(k), v) for k, v in self.extra.items()]
        return children, tuple(self.extra)

    @classmethod
    def _tree_unflatten(cls, extra_keys, children) -> Batch:
        obj = object.__new__(cls)
        n = len(FIELDS)
        for k, v in zip(FIELDS, children[:n], strict=True):
            object.__setattr__(obj, k, v)
        object.__setattr__(obj, "extra", dict(zip(extra_keys, children[n:], strict=True)))
        return obj


jax.tree_util.register_pytree_with_keys(
    Batch,
    Batch._tree_flatten_with_keys,
    Batch._tree_unflatten,
)


def _check_shapes(fields: Mapping[str, Any], extras: Mapping[str, Any]) -> None:
    am = fields["action_mask"]
    if am.ndim != 2:
        raise ValueError(f"Batch field 'action_mask' must be rank 2 [B, T], got shape {am.shape}")
    bt = tuple(am.shape)
    for name in _PER_TOKEN_FIELDS:
        v = fields[name]
        if v is not None and tuple(v.shape) != bt:
            raise ValueError(
                f"Batch field '{name}' has shape {tuple(v.shape)}, expected {bt} like action_mask"
            )
    adv = fields["advantages"]
    if adv is not None and tuple(adv.shape) not in (bt, bt[:1]):
        raise ValueError(
            f"Batch field 'advantages' has shape {tuple(adv.shape)}, expected [B]={bt[:1]} "
            f"or [B, T]={bt}"
        )
    for name in ROW_FIELDS:
        v = fields[name]
        if v is not None and tuple(v.shape) != bt[:1]:
            raise ValueError(
                f"Batch field '{name}' has shape {tuple(v.shape)}, expected [B]={bt[:1]}"
            )
    for name in TOPK_FIELDS:
        v = fields[name]
        if v is not None and (v.ndim != 3 or tuple(v.shape[:2]) != bt or v.shape[2] < 1):
            raise ValueError(
                f"Batch field '{name}' has shape {tuple(v.shape)}, expected [B, T, K]="
                f"{bt + ('K',)} with K >= 1"
            )
    for name in UNSLICED_FIELDS:
        v = fields[name]
        if v is not None and tuple(v.shape) != ():
            raise ValueError(f"Batch field '{name}' must be a 0-d array, got shape {v.shape}")
    for name, v in extras.items():
        if v is not None and v.ndim >= 1 and v.shape[0] != bt[0]:
            raise ValueError(
                f"Batch extra field '{name}' has leading dimension {v.shape[0]}, expected B={bt[0]}"
            )


@dataclasses.dataclass(frozen=True)
class Twin:
    """The built-in server kernel that computes a term exactly (what `builtin_twin` returns).

    A runner runs the term on the server by folding the term's reduction weights into per-token
    advantages and calling ``forward_backward(datums, kernel, config)`` (see `builtin_twin`).

    Attributes:
      kernel: the kernel name (Fireworks/Tinker ``loss_fn``).
      config: its ``loss_fn_config`` (JSON-ready values).
      all_targets_actions: the kernel is exact only when every target of the datums is an
        action token (``dro``: its quadratic applies at every target position). A runner checks
        that on the data.
      provenance: ``"documented"``, ``"inferred"`` (from the cookbook's client twins) or
        ``"undocumented"`` — where the kernel's formula comes from.
    """

    kernel: str
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    all_targets_actions: bool = False
    provenance: str = "documented"


@dataclasses.dataclass(frozen=True, eq=False)
class PerDatum:
    """How a term decomposes into one loss per datum (row), summed (`Term.per_datum`).

    A term with this capability satisfies, for every batch ``b`` and logprobs ``lp`` of ``B``
    rows, ``term(lp, b) == Σ_i term(lp[i:i+1], c_i)`` where ``c_i`` is row ``i`` of
    ``b.replace(**constants(b))`` (0-d fields are shared by every row). ``constants`` computes,
    from the data of the whole batch, the 0-d fields the per-row losses need: the reduction's
    normalizers (``num_rows``, ``num_action_tokens``, ``num_obs_tokens``; Dr. GRPO's constant is a
    hyperparameter and needs nothing) and a batch-normalised correction's ``is_weight_mean``. A
    runner computes them on the host, once per optimizer batch, and ships them with each datum
    (a server-side custom loss: rank-0 inputs). Fields already set on ``b`` are kept.

    Terms coupled across rows through the current logprobs (Clip-Cov's batch-wide covariance
    selection, KL-Cov's top-k) have no such form: their ``per_datum`` is ``None``.

    Attributes:
      constants: ``batch -> {field: 0-d array}`` over `UNSLICED_FIELDS`.
    """

    constants: Callable[[Batch], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class Term:
    """A loss term: ``term(logprobs, batch) -> (loss, metrics)``, carrying its capabilities.

    Attributes:
      name: default name used by `fold` to namespace metrics.
      fn: the pure function.
      kind: which constructor built it (``"grpo"``, ``"echo_env"``, ``"fold"``, ...).
      config: the validated hyperparameters (read-only); ``getattr(losses, kind)(**config)``
        rebuilds the term.
      parts: for a fold, its ``(name, term)`` pairs.
      is_zero: the term's value is identically 0 for every input (e.g. ``echo_env(coef=0)``);
        `fold` then reports its metrics but leaves it out of the sum, so the fold equals the
        other terms bit for bit, and runners may skip it.
      reads: the batch fields whose values can change the term's value, gradient or metrics
        (``None``: not declared, e.g. a custom term).
      requires: the fields that must be present (not ``None``); calling the term on a batch
        without one raises ``ValueError`` naming the term and the field.
      twin: the exact built-in kernel (`Twin`), or ``None`` (run it as a client loss).
      data_weights: for a term whose gradient is a fixed per-token weight computed from the
        data alone (``L = Σ w·(-logp)``: ECHO, SFT and weighted cross-entropy), the function
        ``batch -> w[B, T]``; a runner can then run it as a server ``cross_entropy`` pass.
        ``None`` otherwise.
      per_datum: the term's per-datum form (`PerDatum`): it is a sum of one loss per row given
        batch constants the client computes from data, so a server can run it per datum
        (a Tinker custom loss). ``None``: coupled across rows, or not declared.
      validate: host-side data rules specific to the term, ``(batch, logprobs) -> None``
        raising ``ValueError`` (preference pairs: an even row count, no empty completion);
        `check_batch` runs it when given ``term=``. ``None``: no rules beyond the generic ones.
      argument: what the first argument is, one of `ARGUMENTS`: ``"logprobs"`` float[B, T]
        (default), ``"topk_logprobs"`` float[B, T, K] or ``"values"`` float[B, T] (value
        predictions: any finite number). `check_batch` and `any_violation` apply that
        argument's rules; a runner that computes per-token logprobs accepts only
        ``"logprobs"`` terms.
    """

    name: str
    fn: TermFn
    kind: str = "custom"
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    parts: tuple[tuple[str, Any], ...] = ()
    is_zero: bool = False
    reads: frozenset[str] | None = None
    requires: frozenset[str] = frozenset()
    twin: Twin | None = None
    data_weights: Callable[[Batch], Array] | None = None
    per_datum: PerDatum | None = None
    validate: Callable[[Batch, Any], None] | None = None
    argument: str = "logprobs"

    def __post_init__(self) -> None:
        if self.argument not in ARGUMENTS:
            raise ValueError(
                f"Term {self.name!r}: argument must be one of {ARGUMENTS}, got {self.argument!r}"
            )
        for attr in ("reads", "requires"):
            names = getattr(self, attr)
            if names is None:
                continue
            object.__setattr__(self, attr, frozenset(names))
        if self.reads is not None:
            missing = sorted(set(self.requires) - set(self.reads))
            if missing:
                raise ValueError(f"Term {self.name!r}: requires {missing} but does not read them")

    def __call__(self, logprobs: Any, batch: Batch) -> tuple[Array, Metrics]:
        check_fields(self, batch)
        return self.fn(logprobs, batch)

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.kind}({cfg})"


def _label(term: Any) -> str:
    kind = getattr(term, "kind", "custom")
    return kind if kind not in ("custom", "fold") else getattr(term, "name", kind)


def check_fields(term: Any, batch: Any) -> None:
    """Raises ``ValueError`` naming the term and the field when ``batch`` lacks a field that
    ``term.requires``, or when ``batch`` is not a `Batch`."""
    if not isinstance(batch, Batch):
        raise ValueError(
            f"{_label(term)}: batch must be a losses.Batch, got {type(batch).__name__}"
        )
    for field in sorted(getattr(term, "requires", ())):
        if batch.get(field) is None:
            raise ValueError(f"{_label(term)} needs batch field '{field}', which is None")


def reduction_reads(reduction: str, which: str) -> frozenset[str]:
    """The batch fields a reduction over the ``"action"`` or ``"obs"`` mask reads."""
    mask = "action_mask" if which == "action" else "obs_mask"
    if reduction == "token_sum":
        return frozenset({mask})
    if reduction == "token_mean":
        return frozenset({mask, f"num_{which}_tokens"})
    # seq-mean reductions: N counts rows with an action or observation token.
    return frozenset({mask, "num_rows", "action_mask", "obs_mask"})


def check_logprobs_shape(logprobs: Any, batch: Batch) -> Array:
    """Converts ``logprobs`` to a jax array and checks it has the batch's ``[B, T]`` shape."""
    lp = jnp.asarray(logprobs)
    if lp.ndim != 2 or tuple(lp.shape) != batch.shape:
        raise ValueError(
            f"logprobs has shape {tuple(lp.shape)}, expected {batch.shape} like batch.action_mask"
        )
    if not jnp.issubdtype(lp.dtype, jnp.floating):
        raise ValueError(f"logprobs must be floating point, got dtype {lp.dtype}")
    return lp


def require(batch: Batch, field: str, term: str) -> Any:
    value = batch.get(field)
    if value is None:
        raise ValueError(f"{term} needs batch field '{field}', which is None")
    return value


def count(x: Any) -> Array:
    """``Σ x`` accumulated in at least float32 (a float16 mask over > 65504 tokens would
    overflow its own dtype)."""
    x = jnp.asarray(x)
    return jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))
