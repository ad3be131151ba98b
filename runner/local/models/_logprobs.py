"""Per-token target logprobs of a linear unembedding, computed in chunks of tokens.

For final hidden states ``h[N, H]``, an unembedding ``W[V, H]`` and targets ``y[N]``:

    z_n = W h_n  (float32 or wider),   logprob_n = z_n[y_n] - logsumexp_v z_nv.

`token_logprobs` with ``chunk = 0`` materializes ``z[N, V]`` (and autodiff keeps it, plus its
softmax, for the backward: about 3·N·V floats). With ``chunk = C > 0`` it is a `jax.custom_vjp`
(reference/hf-models.md §6.2; the Liger / cut-cross-entropy idea, per token rather than summed):

- forward: `jax.lax.map` over ``⌈N/C⌉`` chunks of ``C`` tokens; each computes ``z[C, V]``, its
  ``lse`` and the target logit, and keeps only ``lse[N]`` (plus the inputs) as residuals;
- backward, for upstream ``g[N]``: `jax.lax.scan` over the same chunks recomputes ``z``, forms
  ``dz = g·(onehot(y) - exp(z - lse))`` and accumulates ``dh = dz W`` (per chunk) and
  ``dW += dzᵀ h`` in float32 (or wider), cast to ``W``'s dtype at the end.

Only ``[C, V]`` logits exist at a time, so peak memory is ``O(C·V + V·H)`` instead of
``O(N·V)``. N need not be a multiple of C (the last chunk is zero-padded and its padding
dropped). The value equals the materialized one up to floating-point summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _acc(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _logits(h_CH: jax.Array, w_VH: jax.Array) -> jax.Array:
    return jnp.einsum("ch,vh->cv", h_CH, w_VH, preferred_element_type=_acc(w_VH.dtype))


def _materialized(h_NH, w_VH, y_N):
    z = _logits(h_NH, w_VH)
    lse = jax.nn.logsumexp(z, axis=-1)
    return jnp.take_along_axis(z, y_N[:, None], axis=-1)[:, 0] - lse


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``x[N, ...]`` zero-padded to a multiple of ``chunk`` and reshaped ``[n, chunk, ...]``."""
    n = x.shape[0]
    pad = -n % chunk
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((x.shape[0] // chunk, chunk) + x.shape[1:])


def _forward(h_NH, w_VH, y_N, chunk):
    N = h_NH.shape[0]

    def one(args):
        h_c, y_c = args
        z = _logits(h_c, w_VH)
        lse = jax.nn.logsumexp(z, axis=-1)
        return jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0] - lse, lse

    lp, lse = jax.lax.map(one, (_chunks(h_NH, chunk), _chunks(y_N, chunk)))
    return lp.reshape(-1)[:N], lse.reshape(-1)[:N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked(h_NH, w_VH, y_N, chunk):
    return _forward(h_NH, w_VH, y_N, chunk)[0]


def _chunked_fwd(h_NH, w_VH, y_N, chunk):
    lp, lse = _forward(h_NH, w_VH, y_N, chunk)
    return lp, (h_NH, w_VH, y_N, lse)


def _chunked_bwd(chunk, residuals, g_N):
    h_NH, w_VH, y_N, lse_N = residuals
    N, H = h_NH.shape
    acc = _acc(w_VH.dtype)
    g_N = g_N.astype(acc)

    def body(dw_VH, args):
        h_c, y_c, lse_c, g_c = args
        z = _logits(h_c, w_VH)
        dz = -g_c[:, None] * jnp.exp(z - lse_c[:, None])
        dz = dz.at[jnp.arange(chunk), y_c].add(g_c)
        dz_w = dz.astype(w_VH.dtype)
        dh_c = jnp.einsum("cv,vh->ch", dz_w, w_VH, preferred_element_type=acc)
        dw_VH = dw_VH + jnp.einsum("cv,ch->vh", dz_w, h_c, preferred_element_type=acc)
        return dw_VH, dh_c.astype(h_NH.dtype)

    xs = (_chunks(h_NH, chunk), _chunks(y_N, chunk), _chunks(lse_N, chunk), _chunks(g_N, chunk))
    dw, dh = jax.lax.scan(body, jnp.zeros(w_VH.shape, acc), xs)
    dy = np.zeros(y_N.shape, jax.dtypes.float0)
    return dh.reshape(-1, H)[:N], dw.astype(w_VH.dtype), dy


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs(h_NH: jax.Array, w_VH: jax.Array, y_N: jax.Array, *, chunk: int) -> jax.Array:
    """``log softmax(W h_n)[y_n]`` for every token; differentiable in ``h`` and ``W``.

    Args:
      h_NH: final hidden states (after the last norm), float[N, H].
      w_VH: the unembedding (``lm_head.weight`` or the tied embedding), float[V, H].
      y_N: int target ids in ``[0, V)``.
      chunk: tokens per chunk; ``0`` materializes the ``[N, V]`` logits (module docstring).

    Returns:
      float[N] logprobs in ``promote_types(W.dtype, float32)``.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"token_logprobs: chunk must be an int >= 0, got {chunk!r}")
    if h_NH.ndim != 2 or w_VH.ndim != 2 or h_NH.shape[1] != w_VH.shape[1]:
        raise ValueError(
            f"token_logprobs: expected h[N, H] and W[V, H], got {h_NH.shape} and {w_VH.shape}"
        )
    if y_N.shape != h_NH.shape[:1]:
        raise ValueError(f"token_logprobs: targets {y_N.shape} do not match h {h_NH.shape}")
    if chunk == 0 or chunk >= h_NH.shape[0]:
        return _materialized(h_NH, w_VH, y_N)
    return _chunked(h_NH, w_VH, y_N, chunk)
