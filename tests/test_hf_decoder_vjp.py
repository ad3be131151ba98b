"""The decoder's hand-written backward passes (`runner.local.models._decoder`) against autodiff.

`_attention` (probabilities recomputed from the kept row statistics; causal query blocks),
`_norm_linear` (RMSNorm + projections, with and without biases) and `_swiglu` must give the
values and gradients of the plain formulas; the unrolled layer loop must give the scan's
gradient. float64, so the comparisons are tight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.local.models import DecoderConfig, _decoder

F64 = jnp.float64


def _rand(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), F64)


def _reference_attend(q_BTND, k_BSKD, v_BSKD, mask_BTS):
    B, T, N, D = q_BTND.shape
    K = k_BSKD.shape[2]
    q = q_BTND.reshape(B, T, K, N // K, D)
    scores = jnp.einsum("btkrd,bskd->bkrts", q, k_BSKD) * (D**-0.5)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, jnp.finfo(F64).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkrts,bskd->btkrd", probs, v_BSKD).reshape(B, T, N * D)


def _close(a, b, tol=1e-10):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [8, 128, 256, 192])
def test_causal_attention_matches_autodiff(T):
    rng = np.random.default_rng(T)
    B, N, K, D = 2, 4, 2, 8
    q, k, v = _rand(rng, B, T, N, D), _rand(rng, B, T, K, D), _rand(rng, B, T, K, D)
    w = _rand(rng, B, T, N * D)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))

    def loss(f, **kw):
        return lambda q, k, v: jnp.sum(w * f(q, k, v, mask, **kw))

    want = jax.value_and_grad(loss(_reference_attend), argnums=(0, 1, 2))(q, k, v)
    for causal in (False, True):
        got = jax.value_and_grad(loss(_decoder._attend, causal=causal), argnums=(0, 1, 2))(q, k, v)
        _close(want, got)


def test_attention_with_a_general_mask_and_a_fully_masked_row():
    rng = np.random.default_rng(0)
    B, T, S, N, K, D = 2, 5, 7, 6, 3, 4
    q, k, v = _rand(rng, B, T, N, D), _rand(rng, B, S, K, D), _rand(rng, B, S, K, D)
    w = _rand(rng, B, T, N * D)
    mask = jnp.asarray(rng.random((B, T, S)) < 0.6).at[1, 2, :].set(False)

    def loss(f):
        return lambda q, k, v: jnp.sum(w * f(q, k, v, mask))

    want = jax.value_and_grad(loss(_reference_attend), argnums=(0, 1, 2))(q, k, v)
    _close(want, jax.value_and_grad(loss(_decoder._attend), argnums=(0, 1, 2))(q, k, v))


@pytest.mark.parametrize("bias", [False, True])
def test_norm_linear_and_swiglu_match_autodiff(bias):
    rng = np.random.default_rng(1)
    n, H, outs, eps = 6, 8, (8, 4, 4), 1e-6
    x, wn = _rand(rng, n, H), 1 + 0.1 * _rand(rng, H)
    ws = tuple(_rand(rng, o, H) for o in outs)
    bs = tuple(_rand(rng, o) if bias else None for o in outs)
    cot = tuple(_rand(rng, n, o) for o in outs)

    def fused(x, wn, ws, bs):
        ys = _decoder._norm_linear(eps, x, wn, ws, bs)
        return sum(jnp.sum(c * y) for c, y in zip(cot, ys, strict=True))

    def plain(x, wn, ws, bs):
        m = _decoder.rms_norm(x, wn, eps)
        ys = [m @ w.T + (0 if b is None else b[None, :]) for w, b in zip(ws, bs, strict=True)]
        return sum(jnp.sum(c * y) for c, y in zip(cot, ys, strict=True))

    argnums = (0, 1, 2, 3) if bias else (0, 1, 2)
    _close(
        jax.value_and_grad(plain, argnums)(x, wn, ws, bs),
        jax.value_and_grad(fused, argnums)(x, wn, ws, bs),
    )

    g, u, wd, dy = _rand(rng, n, 16), _rand(rng, n, 16), _rand(rng, H, 16), _rand(rng, n, H)
    _close(
        jax.value_and_grad(
            lambda *a: jnp.sum(dy * ((jax.nn.silu(a[0]) * a[1]) @ a[2].T)), (0, 1, 2)
        )(g, u, wd),
        jax.value_and_grad(lambda *a: jnp.sum(dy * _decoder._swiglu(*a)), (0, 1, 2))(g, u, wd),
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_unrolled_layers_give_the_scanned_gradient(family):
    cfg = DecoderConfig(
        family=family,
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        mlp_bias=family == "llama",
    )
    params = jax.tree.map(jnp.asarray, _decoder.init_params(cfg, seed=0, dtype="float64"))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 37, (2, 129)))  # 128 inputs: two causal query blocks
    lengths = jnp.asarray([129, 61])
    g = _rand(rng, 2, 128)

    def loss(unroll):
        def f(p):
            lp = _decoder.token_logprobs(cfg, p, tokens, lengths, chunk=64, unroll=unroll)
            return jnp.sum(g * lp)

        return f

    _close(jax.value_and_grad(loss(False))(params), jax.value_and_grad(loss(True))(params), 1e-9)
