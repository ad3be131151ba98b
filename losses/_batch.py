"""The `Batch` pytree and the `Term` type that every loss constructor returns.

Data conventions (DESIGN.md §3): every per-token array is *target-aligned* and padded to
``[B, T]``; entry ``[i, t]`` describes target token ``t`` of row ``i``. Masks are 0/1 floats and
padding is never inferred from token ids. The only differentiable input of a term is
``logprobs``; everything in a `Batch` is data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Metrics = dict[str, Array]
TermFn = Callable[[Array, "Batch"], tuple[Array, Metrics]]

#: Fields every `Batch` has, in pytree order. ``num_*`` are optional global normalizers: 0-d
#: arrays that `split_batch` sets so that micro-batches carry the full batch's denominators.
CORE_FIELDS = (
    "action_mask",
    "obs_mask",
    "advantages",
    "sampling_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "weights",
    "num_rows",
    "num_action_tokens",
    "num_obs_tokens",
)
NORMALIZER_FIELDS = ("num_rows", "num_action_tokens", "num_obs_tokens")
_PER_TOKEN_FIELDS = ("obs_mask", "sampling_logprobs", "old_logprobs", "ref_logprobs", "weights")


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


class Batch:
    """A padded batch of target-aligned per-token arrays; a JAX pytree.

    ``Batch(*, action_mask, obs_mask=None, advantages=None, sampling_logprobs=None,
    old_logprobs=None, ref_logprobs=None, weights=None, num_rows=None, num_action_tokens=None,
    num_obs_tokens=None, **extra)``

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
      num_rows: optional 0-d count of the optimizer batch's rows that have at least one action
        or observation token (the ``N`` of the seq-mean reductions). ``None`` = count this batch.
      num_action_tokens: optional 0-d total of ``action_mask`` over the optimizer batch.
      num_obs_tokens: optional 0-d total of ``obs_mask`` over the optimizer batch.
      **extra: more fields; arrays with a leading ``[B]`` axis are split by `split_batch`.

    Shapes are validated eagerly (``ValueError`` naming the field); values are validated on the
    host by `check_batch`. Integer or bool masks are converted to float32.
    """

    __slots__ = ("_fields",)

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
        num_rows: Any = None,
        num_action_tokens: Any = None,
        num_obs_tokens: Any = None,
        **extra: Any,
    ) -> None:
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
            num_rows=num_rows,
            num_action_tokens=num_action_tokens,
            num_obs_tokens=num_obs_tokens,
        )
        for key in extra:
            if key.startswith("_"):
                raise ValueError(f"Batch field names may not start with '_': {key!r}")
        fields = {k: _as_array(k, v) for k, v in values.items()}
        fields.update({k: (_as_array(k, v) if v is not None else None) for k, v in extra.items()})
        _check_shapes(fields)
        object.__setattr__(self, "_fields", fields)

    # -- field access ------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        try:
            return fields[name]
        except KeyError:
            raise AttributeError(f"Batch has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Batch is immutable; use batch.replace(...)")

    def get(self, name: str, default: Any = None) -> Any:
        return self._fields.get(name, default)

    @property
    def fields(self) -> Mapping[str, Any]:
        """All fields (including ``None`` ones) in pytree order."""
        return dict(self._fields)

    @property
    def extra_fields(self) -> tuple[str, ...]:
        return tuple(k for k in self._fields if k not in CORE_FIELDS)

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, T)``."""
        return tuple(self._fields["action_mask"].shape)  # type: ignore[return-value]

    def replace(self, **changes: Any) -> Batch:
        """A copy with some fields replaced (validated like the constructor).

        Replacing ``sampling_logprobs`` does not touch ``old_logprobs``: the default only applies
        at construction.
        """
        fields = dict(self._fields)
        unknown = [k for k in changes if k.startswith("_")]
        if unknown:
            raise ValueError(f"Batch field names may not start with '_': {unknown}")
        fields.update(changes)
        return Batch(**fields)

    def __iter__(self) -> Iterator[str]:  # pragma: no cover - convenience
        return iter(self._fields)

    def __repr__(self) -> str:
        parts = []
        for k, v in self._fields.items():
            if v is not None:
                parts.append(f"{k}={getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', ()))}")
        return f"Batch({', '.join(parts)})"

    # -- pytree ------------------------------------------------------------------------------
    def _tree_flatten_with_keys(self):
        keys = tuple(self._fields)
        children = [(jax.tree_util.GetAttrKey(k), self._fields[k]) for k in keys]
        return children, keys

    @classmethod
    def _tree_unflatten(cls, keys, children) -> Batch:
        obj = object.__new__(cls)
        object.__setattr__(obj, "_fields", dict(zip(keys, children, strict=True)))
        return obj


jax.tree_util.register_pytree_with_keys(
    Batch,
    Batch._tree_flatten_with_keys,
    Batch._tree_unflatten,
)


def _check_shapes(fields: Mapping[str, Any]) -> None:
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
    for name in NORMALIZER_FIELDS:
        v = fields[name]
        if v is not None and tuple(v.shape) != ():
            raise ValueError(f"Batch field '{name}' must be a 0-d array, got shape {v.shape}")
    for name, v in fields.items():
        if name in CORE_FIELDS or v is None:
            continue
        if v.ndim >= 1 and v.shape[0] != bt[0]:
            raise ValueError(
                f"Batch extra field '{name}' has leading dimension {v.shape[0]}, expected B={bt[0]}"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class Term:
    """A loss term: ``term(logprobs, batch) -> (loss, metrics)``.

    Attributes:
      name: default name used by `fold` to namespace metrics.
      fn: the pure function.
      kind: which constructor built it (``"grpo"``, ``"echo_env"``, ``"fold"``, ...); runners use
        it with ``config`` to decide whether a server kernel expresses the term exactly.
      config: the validated hyperparameters (read-only).
      parts: for a fold, its ``(name, term)`` pairs.
      is_zero: the term's value is identically 0 for every input (e.g. ``echo_env(coef=0)``);
        `fold` then reports its metrics but leaves it out of the sum, so the fold equals the
        other terms bit for bit, and runners may skip it.
    """

    name: str
    fn: TermFn
    kind: str = "custom"
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    parts: tuple[tuple[str, Any], ...] = ()
    is_zero: bool = False

    def __call__(self, logprobs: Any, batch: Batch) -> tuple[Array, Metrics]:
        return self.fn(logprobs, batch)

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.kind}({cfg})"


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
