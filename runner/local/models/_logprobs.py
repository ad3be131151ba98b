"""Per-token target logprobs of a linear unembedding, computed in chunks of tokens.

For final hidden states ``h[N, H]``, an unembedding ``W[V, H]`` and targets ``y[N]``:

    z_n = W h_n  (float32 or wider),   logprob_n = z_n[y_n] - logsumexp_v z_nv.

`token_logprobs` with ``chunk = 0`` materializes ``z[N, V]`` (and autodiff keeps it, plus its
softmax, for the backward: about 3·N·V floats). With ``chunk = C > 0`` it is a `jax.custom_vjp`
(docs/hf-models.md#memory-efficient-logprobs; the Liger / cut-cross-entropy idea, per token rather than summed):

- forward: `jax.lax.map` over ``⌈N/C⌉`` chunks of ``C`` tokens; each computes ``z[C, V]``, its
  ``lse`` and the target logit, and keeps only ``lse[N]`` (plus the inputs) as residuals;
- backward, for upstream ``g[N]``: an outer `jax.lax.scan` over blocks of ``Vb`` vocabulary rows
  ``W_b[Vb, H]`` and, inside it, a scan over the same token chunks, which recomputes the tile
  ``z[C, Vb]`` from the saved ``lse``, forms ``dz = g·(onehot(y) - exp(z - lse))`` and adds
  ``dz W_b`` into ``dh[N, H]`` and ``dzᵀ h`` into the block's ``dW_b[Vb, H]`` (float32 or wider).
  A finished block is cast to ``W``'s dtype and written into its rows of ``dW`` in place
  (``dynamic_update_slice`` on the scan carry, which XLA assigns to the output buffer), so no
  ``[V, H]`` temporary exists; ``dh`` is cast to ``h``'s dtype at the end.

If ``Vb`` does not divide ``V`` the last block is shifted back to end at row ``V``: the rows that
the previous block already covered are recomputed and overwritten in ``dW`` and masked out of the
``dz`` that goes into ``dh``, so ``W`` is never padded or copied. The default ``Vb`` is the
largest divisor of ``V`` in ``[2048, 4096]`` (Qwen's 151936 → 2374), else 4096; ``Vb = min(Vb,
V)``.

Compiled temporaries are ``O(C·V)`` in the forward and ``O(C·Vb + Vb·H + N·H)`` in the backward,
instead of ``O(N·V)``. N need not be a multiple of C (the last chunk is zero-padded and its padding
dropped). Value and gradient equal the materialized ones up to floating-point summation order.
With bfloat16 ``W`` on XLA:CPU, float normalization upcasts the operand of every bfloat16 dynamic
slice to float32 and hoists ``convert(W)`` out of the loop: one float32 ``[V, H]`` temporary there
(not on backends that slice bfloat16 natively).

`linear_loss` is the fused head of a loss linear in the logprobs, ``L = Σ_n g_n·logprob_n`` with
``g`` known before the forward (the trainer's ``cross_entropy``): one `jax.lax.scan` over chunks
of ``C`` tokens computes ``z = h_c Wᵀ``, ``lse``, the logprobs, ``dz = g·(onehot(y) - exp(z -
lse))``, ``dh_c = dz W`` and ``dW += dzᵀ h_c`` (a ``[V, H]`` carry in float32 or wider, the
product added ``Vb`` rows at a time in place, so no second ``[V, H]`` array exists): three
products per chunk instead of the five of `token_logprobs` differentiated (whose backward
recomputes the logits). Its temporaries are ``O(C·V + Vb·H + N·H)`` besides the gradient: at
T = 4096, V = 151936, H = 1024, C = 256, 298 MiB (both ``z`` and ``dz`` of a chunk) against
149 MiB for `token_logprobs` and 4748 MiB materialized (the ``dW`` product in one piece was
743 MiB). Time at N = 2048, V = 16384, H = 384: 390 ms at C = 256, 355 ms at C = 512, against
473 ms for the differentiated chunked head (the row blocks change it by less than 3%).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

#: The default vocabulary block: the largest divisor of V in [_BLOCK // 2, _BLOCK], else _BLOCK.
_BLOCK = 4096


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


def _vocab_block(V: int, vocab_block: int | None) -> int:
    """Rows of ``W`` per backward block: as asked (at most V), or the default rule above."""
    if vocab_block is not None:
        return min(vocab_block, V)
    if V <= _BLOCK:
        return V
    for b in range(_BLOCK, _BLOCK // 2 - 1, -1):
        if V % b == 0:
            return b
    return _BLOCK


def _forward(h_NH, w_VH, y_N, chunk):
    N = h_NH.shape[0]

    def one(args):
        h_c, y_c = args
        z = _logits(h_c, w_VH)
        lse = jax.nn.logsumexp(z, axis=-1)
        return jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0] - lse, lse

    lp, lse = jax.lax.map(one, (_chunks(h_NH, chunk), _chunks(y_N, chunk)))
    return lp.reshape(-1)[:N], lse.reshape(-1)[:N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(h_NH, w_VH, y_N, chunk, block):
    return _forward(h_NH, w_VH, y_N, chunk)[0]


def _chunked_fwd(h_NH, w_VH, y_N, chunk, block):
    lp, lse = _forward(h_NH, w_VH, y_N, chunk)
    return lp, (h_NH, w_VH, y_N, lse)


def _chunked_bwd(chunk, block, residuals, g_N):
    h_NH, w_VH, y_N, lse_N = residuals
    N, H = h_NH.shape
    V = w_VH.shape[0]
    acc = _acc(w_VH.dtype)
    xs = (_chunks(h_NH, chunk), _chunks(y_N, chunk), _chunks(lse_N, chunk), _chunks(g_N, chunk))

    shifted = V % block != 0  # the last block is shifted back to end at row V

    def vocab_block(carry, b):
        dh_nCH, dw_VH = carry
        start = jnp.minimum(b * block, V - block) if shifted else b * block
        w_b = jax.lax.dynamic_slice_in_dim(w_VH, start, block)
        v_1B = (start + jnp.arange(block))[None, :]  # vocabulary ids of the block's rows

        def token_chunk(dw_b, args):
            h_c, y_c, lse_c, g_c = args
            g_c = g_c.astype(acc)[:, None]
            z = _logits(h_c, w_b)
            dz = jnp.where(v_1B == y_c[:, None], g_c, 0.0) - g_c * jnp.exp(z - lse_c[:, None])
            dz = dz.astype(w_VH.dtype)
            # Rows an earlier block covered get their dW again (recomputed and overwritten) but
            # must not add to dh twice.
            dz_h = jnp.where(v_1B >= b * block, dz, jnp.zeros((), dz.dtype)) if shifted else dz
            dh_c = jnp.einsum("cv,vh->ch", dz_h, w_b, preferred_element_type=acc)
            dw_b = dw_b + jnp.einsum("cv,ch->vh", dz, h_c, preferred_element_type=acc)
            return dw_b, dh_c

        dw_b, dh_b = jax.lax.scan(token_chunk, jnp.zeros((block, H), acc), xs)
        dw_VH = jax.lax.dynamic_update_slice_in_dim(dw_VH, dw_b.astype(dw_VH.dtype), start, 0)
        return (dh_nCH + dh_b, dw_VH), None

    init = (jnp.zeros(xs[0].shape, acc), jnp.zeros(w_VH.shape, w_VH.dtype))
    (dh, dw), _ = jax.lax.scan(vocab_block, init, jnp.arange(-(-V // block)))
    dy = np.zeros(y_N.shape, jax.dtypes.float0)
    return dh.reshape(-1, H)[:N].astype(h_NH.dtype), dw, dy


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs(
    h_NH: jax.Array,
    w_VH: jax.Array,
    y_N: jax.Array,
    *,
    chunk: int,
    vocab_block: int | None = None,
) -> jax.Array:
    """``log softmax(W h_n)[y_n]`` for every token; differentiable in ``h`` and ``W``.

    Args:
      h_NH: final hidden states (after the last norm), float[N, H].
      w_VH: the unembedding (``lm_head.weight`` or the tied embedding), float[V, H].
      y_N: int target ids in ``[0, V)``.
      chunk: tokens per chunk; ``0`` materializes the ``[N, V]`` logits (module docstring).
      vocab_block: rows of ``W`` per block of the chunked backward (need not divide V; more than
        V means V); ``None`` picks a divisor of V near 4096 (module docstring). Ignored when
        the logits are materialized.

    Returns:
      float[N] logprobs in ``promote_types(W.dtype, float32)``.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"token_logprobs: chunk must be an int >= 0, got {chunk!r}")
    if vocab_block is not None and (
        isinstance(vocab_block, bool) or not isinstance(vocab_block, int) or vocab_block < 1
    ):
        raise ValueError(
            f"token_logprobs: vocab_block must be None or an int >= 1, got {vocab_block!r}"
        )
    if h_NH.ndim != 2 or w_VH.ndim != 2 or h_NH.shape[1] != w_VH.shape[1]:
        raise ValueError(
            f"token_logprobs: expected h[N, H] and W[V, H], got {h_NH.shape} and {w_VH.shape}"
        )
    if y_N.shape != h_NH.shape[:1]:
        raise ValueError(f"token_logprobs: targets {y_N.shape} do not match h {h_NH.shape}")
    if chunk == 0 or chunk >= h_NH.shape[0]:
        return _materialized(h_NH, w_VH, y_N)
    return _chunked(h_NH, w_VH, y_N, chunk, _vocab_block(w_VH.shape[0], vocab_block))


# -- fused head of a loss linear in the logprobs -------------------------------------------------


def _fused_pass(h_NH, w_VH, y_N, g_N, chunk, block, with_dh, with_dw):
    """``(lp[N], dh[N, H] | None, dW[V, H] | None)`` of ``L = Σ_n g_n·lp_n`` in one pass.

    Per chunk of ``C`` tokens: ``z = h_c Wᵀ [C, V]``, ``lse``, ``lp = z[y] - lse``,
    ``dz = g·(onehot(y) - exp(z - lse))`` (cast to ``W``'s dtype), ``dh_c = dz W`` and
    ``dW += dzᵀ h_c`` (a ``[V, H]`` carry in ``promote_types(W.dtype, float32)``, updated
    ``block`` rows at a time by `_add_dz_h`): three products per chunk, the logits never
    recomputed. ``dh`` and ``dW`` are in that accumulation dtype.
    """
    N, H = h_NH.shape
    V = w_VH.shape[0]
    acc = _acc(w_VH.dtype)
    v_1V = jnp.arange(V)[None, :]

    def one(dw_VH, args):
        h_c, y_c, g_c = args
        z = _logits(h_c, w_VH)
        lse = jax.nn.logsumexp(z, axis=-1)
        lp = jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0] - lse
        if not (with_dh or with_dw):
            return dw_VH, (lp, None)
        g = g_c.astype(acc)[:, None]
        dz = jnp.where(v_1V == y_c[:, None], g, 0.0) - g * jnp.exp(z - lse[:, None])
        dz = dz.astype(w_VH.dtype)
        dh_c = jnp.einsum("cv,vh->ch", dz, w_VH, preferred_element_type=acc) if with_dh else None
        if with_dw:
            dw_VH = _add_dz_h(dw_VH, dz, h_c, block, acc)
        return dw_VH, (lp, dh_c)

    dw0 = jnp.zeros((V, H), acc) if with_dw else None
    xs = (_chunks(h_NH, chunk), _chunks(y_N, chunk), _chunks(g_N, chunk))
    if xs[0].shape[0] == 1:  # one chunk: no loop
        dw, (lp, dh) = one(dw0, tuple(x[0] for x in xs))
    else:
        dw, (lp, dh) = jax.lax.scan(one, dw0, xs)
    lp = lp.reshape(-1)[:N]
    return lp, (None if dh is None else dh.reshape(-1, H)[:N]), dw


def _add_dz_h(dw_VH, dz_CV, h_CH, block, acc):
    """``dW + dzᵀ h`` added in place, ``block`` vocabulary rows at a time.

    A single ``[V, H]`` product would be a second ``[V, H]`` temporary beside the carry (594 MiB
    at Qwen3's V = 151936, H = 1024); block by block, each ``[Vb, H]`` product is added into its
    rows with ``dynamic_update_slice`` (in place on the loop carry). A block that does not divide
    ``V`` is shifted back to end at row ``V`` (as in `_chunked_bwd`), its rows an earlier block
    covered masked out of ``dz``.
    """
    V = dw_VH.shape[0]
    if block >= V:
        return dw_VH + jnp.einsum("cv,ch->vh", dz_CV, h_CH, preferred_element_type=acc)
    shifted = V % block != 0

    def add_block(b, dw):
        start = jnp.minimum(b * block, V - block) if shifted else b * block
        dz_b = jax.lax.dynamic_slice_in_dim(dz_CV, start, block, axis=1)
        if shifted:
            v_1B = (start + jnp.arange(block))[None, :]
            dz_b = jnp.where(v_1B >= b * block, dz_b, jnp.zeros((), dz_b.dtype))
        rows = jax.lax.dynamic_slice_in_dim(dw, start, block, axis=0)
        rows = rows + jnp.einsum("cv,ch->vh", dz_b, h_CH, preferred_element_type=acc)
        return jax.lax.dynamic_update_slice_in_dim(dw, rows, start, 0)

    return jax.lax.fori_loop(0, -(-V // block), add_block, dw_VH)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(h_NH, w_VH, y_N, g_N, chunk, block):
    """``(Σ g·lp, lp[N])``; only the sum may be differentiated (`linear_loss` stops ``lp``)."""
    lp = _fused_pass(h_NH, w_VH, y_N, g_N, chunk, block, False, False)[0]
    return jnp.sum(g_N.astype(lp.dtype) * lp), lp


def _fused_fwd(h_NH, w_VH, y_N, g_N, chunk, block):
    # symbolic_zeros: the arguments are `CustomVJPPrimal`s; an input nothing differentiates
    # (a LoRA trainer's frozen unembedding) gets no dW pass.
    h, w, y, g = h_NH.value, w_VH.value, y_N.value, g_N.value
    lp, dh, dw = _fused_pass(h, w, y, g, chunk, block, h_NH.perturbed, w_VH.perturbed)
    dh = None if dh is None else dh.astype(h.dtype)
    dw = None if dw is None else dw.astype(w.dtype)
    out = (jnp.sum(g.astype(lp.dtype) * lp), lp)
    return out, (dh, dw, lp if g_N.perturbed else None)


def _fused_bwd(chunk, block, residuals, cts):
    # The cotangent of lp is zero: `linear_loss` returns lp through `jax.lax.stop_gradient`.
    dh, dw, lp = residuals
    ct = cts[0]
    return (
        None if dh is None else ct.astype(dh.dtype) * dh,
        None if dw is None else ct.astype(dw.dtype) * dw,
        None,
        None if lp is None else ct * lp,
    )


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def linear_loss(
    h_NH: jax.Array,
    w_VH: jax.Array,
    y_N: jax.Array,
    g_N: jax.Array,
    *,
    chunk: int,
    vocab_block: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(L, lp)`` with ``lp_n = log softmax(W h_n)[y_n]`` and ``L = Σ_n g_n·lp_n`` for fixed
    weights ``g``: the head of a loss linear in the logprobs, whose gradient is
    ``dL/dlp = g`` before any logit exists.

    ``L`` is differentiable in ``h`` and ``W`` (and ``g``: ``dL/dg = lp``); its forward runs
    `_fused_pass` once — ``z``, ``lse``, ``lp``, ``dz``, ``dh`` and ``dW`` per chunk of tokens,
    three products instead of the five of `token_logprobs` differentiated (its backward
    recomputes the logits) — and keeps ``dh`` and ``dW`` as residuals. ``lp`` is returned through
    `jax.lax.stop_gradient`. Temporaries: ``O(C·V + Vb·H + N·H)`` besides the ``[V, H]``
    gradient itself; ``chunk = 0`` (or ``≥ N``) is one chunk of all ``N`` tokens (``[N, V]``,
    like the materialized logits).

    Args:
      h_NH: final hidden states, float[N, H].
      w_VH: the unembedding, float[V, H].
      y_N: int target ids in ``[0, V)``.
      g_N: the loss weights ``dL/dlp`` (0 on padding), float[N].
      chunk: tokens per chunk (``0``: all of them).
      vocab_block: rows of ``dW`` per in-place update (`_add_dz_h`; need not divide V); ``None``
        picks the rule of `token_logprobs`.

    Returns:
      ``(L, lp)``: a scalar and float[N], in ``promote_types(W.dtype, float32)``; the values of
      `token_logprobs` and, for ``L``, its gradient up to floating-point summation order.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"linear_loss: chunk must be an int >= 0, got {chunk!r}")
    if h_NH.ndim != 2 or w_VH.ndim != 2 or h_NH.shape[1] != w_VH.shape[1]:
        raise ValueError(
            f"linear_loss: expected h[N, H] and W[V, H], got {h_NH.shape} and {w_VH.shape}"
        )
    if vocab_block is not None and (
        isinstance(vocab_block, bool) or not isinstance(vocab_block, int) or vocab_block < 1
    ):
        raise ValueError(
            f"linear_loss: vocab_block must be None or an int >= 1, got {vocab_block!r}"
        )
    if y_N.shape != h_NH.shape[:1] or g_N.shape != h_NH.shape[:1]:
        raise ValueError(
            f"linear_loss: targets {y_N.shape} and weights {g_N.shape} must be [N] for h "
            f"{h_NH.shape}"
        )
    N = h_NH.shape[0]
    chunk = N if chunk == 0 else min(chunk, N)
    loss, lp = _fused(h_NH, w_VH, y_N, g_N, chunk, _vocab_block(w_VH.shape[0], vocab_block))
    return loss, jax.lax.stop_gradient(lp)
