"""Rotary position embeddings in the rotate-half convention of `transformers` (docs/hf-models.md#architecture).

``inv_freq[j] = 1 / θ^(2j/d)`` (j < d/2), rescaled per ``rope_type`` exactly as
``transformers.modeling_rope_utils`` does (in float32, the same operation order):

- ``linear``: ``inv_freq / factor``.
- ``dynamic`` (NTK): equal to ``default`` for positions below ``max_position_embeddings``; the
  trainer never runs past it (``max_seq_len ≤ max_position_embeddings`` is enforced), so no
  re-scaling is ever needed.
- ``llama3``: with ``λ = 2π / inv_freq``, ``λ_lo = orig / low_freq_factor``, ``λ_hi = orig /
  high_freq_factor``: λ < λ_hi keeps inv_freq, λ > λ_lo uses inv_freq / factor, in between
  ``(1 - s)·inv/factor + s·inv`` with ``s = (orig/λ - low) / (high - low)``.
- ``yarn``: a linear ramp between the interpolated ``1 / (factor·θ^(2j/d))`` and the
  extrapolated ``1 / θ^(2j/d)`` over ``find_correction_range(beta_fast, beta_slow)``; cos and sin
  are multiplied by ``attention_factor`` (default ``0.1·ln(factor) + 1``).

Application: ``x' = x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = concat(-x[d/2:],
x[:d/2])`` and ``cos = cos(concat(p·inv_freq, p·inv_freq))``, computed in float32 (float64 for a
float64 model) and cast to the activation dtype before use (docs/hf-models.md#parity).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from runner.local.models._config import RopeConfig


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    base = rope.theta
    omp = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_pos / omp  # type: ignore[operator]

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(omp / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' singularity guard
    ramp = np.clip(
        (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
    ).astype(np.float32)
    extrapolation_factor = np.float32(1) - ramp
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv.astype(np.float32), float(attention_factor)


def inv_freq(rope: RopeConfig, head_dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    """``(inv_freq float32[d/2], attention_scaling)`` of a `RopeConfig` (module docstring)."""
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, max_pos)
    inv = _default_inv_freq(rope.theta, head_dim)
    if rope.rope_type == "linear":
        inv = (inv / np.float32(rope.factor)).astype(np.float32)
    elif rope.rope_type == "llama3":
        factor = np.float32(rope.factor)
        low, high = rope.low_freq_factor, rope.high_freq_factor
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / low, old / high  # type: ignore[operator]
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
        smooth = ((np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)).astype(
            np.float32
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv, 1.0


def cos_sin(
    positions_BT: jax.Array, inv_freq_K: np.ndarray, scaling: float, dtype
) -> tuple[jax.Array, jax.Array]:
    """``cos, sin``: ``[B, T, d]`` in ``dtype`` for int positions ``[B, T]`` (K = d/2)."""
    acc = jnp.promote_types(dtype, jnp.float32)
    freqs = positions_BT.astype(acc)[:, :, None] * jnp.asarray(inv_freq_K, acc)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scaling != 1.0:
        cos, sin = cos * jnp.asarray(scaling, acc), sin * jnp.asarray(scaling, acc)
    return cos.astype(dtype), sin.astype(dtype)


def apply(x_BTND: jax.Array, cos_BTD: jax.Array, sin_BTD: jax.Array) -> jax.Array:
    """``x·cos + rotate_half(x)·sin`` over the last axis of ``x[B, T, heads, d]``."""
    half = x_BTND.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTND[..., half:], x_BTND[..., :half]], axis=-1)
    return x_BTND * cos_BTD[:, :, None, :] + rotated * sin_BTD[:, :, None, :]
