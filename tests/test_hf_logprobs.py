"""Memory-bounded logprobs (`runner.local.models._logprobs`): chunked == materialized in value
and gradient for several chunk sizes (including ones that do not divide N), against a NumPy
reference; the chunked form's compiled temporary memory is a fraction of the materialized one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.local import models
from runner.local.models import chunked_token_logprobs

N, H, V = 30, 8, 50
CHUNKS = (0, 1, 4, 7, 16, 29, 64)  # 4, 7, 16, 29 do not divide N = 30; 64 > N


def numpy_logprobs(h, w, y):
    z = h.astype(np.float64) @ w.astype(np.float64).T
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return logp[np.arange(len(y)), y]


def numpy_grads(h, w, y, g):
    """d/dh, d/dW of sum_n g_n logprob_n: dz = g (onehot - softmax)."""
    z = h @ w.T
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dz = -g[:, None] * p
    dz[np.arange(len(y)), y] += g
    return dz @ w, dz.T @ h


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(N, H)) * 2
    w = rng.normal(size=(V, H))
    y = rng.integers(0, V, N)
    g = rng.normal(size=N) * (rng.random(N) < 0.8)
    return h, w, y, g


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_value_and_gradient_equal_the_reference(data, chunk):
    h, w, y, g = data

    @jax.jit
    def run(h, w):
        def f(h, w):
            return jnp.sum(g * chunked_token_logprobs(h, w, jnp.asarray(y), chunk=chunk))

        lp = chunked_token_logprobs(h, w, jnp.asarray(y), chunk=chunk)
        return lp, jax.grad(f, argnums=(0, 1))(h, w)

    lp, (dh, dw) = run(jnp.asarray(h), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(lp), numpy_logprobs(h, w, y), rtol=0, atol=1e-12)
    ref_dh, ref_dw = numpy_grads(h, w, y, g)
    np.testing.assert_allclose(np.asarray(dh), ref_dh, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dw), ref_dw, rtol=0, atol=1e-12)


def test_float32_and_bfloat16_chunked_match_materialized(data):
    h, w, y, _ = data
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-5)):
        hh, ww = jnp.asarray(h, dtype), jnp.asarray(w, dtype)
        full = chunked_token_logprobs(hh, ww, jnp.asarray(y), chunk=0)

        @jax.jit
        def part_and_grads(a, b):
            lp, vjp = jax.vjp(lambda a, b: chunked_token_logprobs(a, b, y, chunk=7), a, b)
            return lp, vjp(jnp.ones((N,), jnp.float32))

        part, (dh, dw) = part_and_grads(hh, ww)
        assert full.dtype == part.dtype == jnp.float32  # accumulated in float32
        np.testing.assert_allclose(np.asarray(part), np.asarray(full), rtol=0, atol=tol)
        assert dh.dtype == dw.dtype == dtype


def test_chunked_temporary_memory_is_a_fraction_of_the_materialized():
    n, hdim, vocab = 1024, 32, 8192
    h = jax.ShapeDtypeStruct((n, hdim), jnp.float32)
    w = jax.ShapeDtypeStruct((vocab, hdim), jnp.float32)
    y = jax.ShapeDtypeStruct((n,), jnp.int32)
    g = jax.ShapeDtypeStruct((n,), jnp.float32)

    def temp_bytes(chunk):
        def f(h, w, y, g):
            return jax.grad(
                lambda h, w: jnp.sum(g * chunked_token_logprobs(h, w, y, chunk=chunk)),
                argnums=(0, 1),
            )(h, w)

        return jax.jit(f).lower(h, w, y, g).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = n * vocab * 4
    materialized, chunked = temp_bytes(0), temp_bytes(64)
    assert materialized >= logits_bytes  # at least one [N, V] float32 buffer
    assert chunked < materialized / 8, (chunked, materialized)


def test_decoder_chunked_logprobs_equal_materialized_with_tied_embeddings():
    """Through a tied decoder (the unembedding gradient sums the gather and the logits term)."""
    cfg = models.DecoderConfig(
        family="llama",
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
    )
    params = jax.tree.map(jnp.asarray, models.init_params(cfg, seed=1, dtype="float64"))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 40, (3, 12)))
    lengths = jnp.asarray([12, 7, 0])
    g = jnp.asarray(rng.normal(size=(3, 11)))

    def loss(p, chunk):
        lp = models.token_logprobs(cfg, p, tokens, lengths, chunk=chunk)
        return jnp.sum(g * lp), lp

    run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (v0, lp0), g0 = run(params, 0)
    (v5, lp5), g5 = run(params, 5)
    np.testing.assert_allclose(np.asarray(lp5), np.asarray(lp0), rtol=0, atol=1e-12)
    assert np.all(np.asarray(lp0)[2] == 0) and np.all(np.asarray(lp0)[1, 6:] == 0)  # padding
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g5), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-11)
    assert float(jnp.max(jnp.abs(g5["embed"]))) > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chunk=-1), "chunk must be an int >= 0"),
        (dict(chunk=2.0), "chunk must be an int >= 0"),
        (dict(chunk=2, w=np.zeros((V, H + 1))), "expected h"),
        (dict(chunk=2, y=np.zeros((N + 1,), int)), "targets"),
    ],
)
def test_bad_arguments(data, kwargs, message):
    h, w, y, _ = data
    w = kwargs.pop("w", w)
    y = kwargs.pop("y", y)
    with pytest.raises(ValueError, match=message):
        chunked_token_logprobs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), **kwargs)
