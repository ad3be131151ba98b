"""Memory-bounded logprobs (`runner.local.models._logprobs`): chunked == materialized in value
and gradient for several chunk sizes (including ones that do not divide N) and vocabulary blocks
of the backward (including ones that do not divide V, and ones larger than V), against a NumPy
reference; the chunked form's compiled temporary memory is a fraction of the materialized one,
and its backward keeps no ``[V, H]`` temporary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.local import models
from runner.local.models import _logprobs, chunked_token_logprobs

N, H, V = 30, 8, 50
CHUNKS = (0, 1, 4, 7, 16, 29, 64)  # 4, 7, 16, 29 do not divide N = 30; 64 > N
BLOCKS = (1, 7, 16, 25, 49, 50, 64, None)  # 7, 16, 49 do not divide V = 50; 64 > V; None: V


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


@pytest.mark.parametrize("chunk", (4, 7))
@pytest.mark.parametrize("vocab_block", BLOCKS)
def test_vocab_blocked_gradient_equals_materialized_in_float64(data, chunk, vocab_block):
    h, w, y, g = data

    @jax.jit
    def value_and_grads(h, w):
        def f(h, w, chunk, vocab_block):
            lp = chunked_token_logprobs(h, w, y, chunk=chunk, vocab_block=vocab_block)
            return jnp.sum(g * lp), lp

        grad = jax.grad(f, argnums=(0, 1), has_aux=True)
        return grad(h, w, 0, None), grad(h, w, chunk, vocab_block)

    ((dh0, dw0), lp0), ((dh, dw), lp) = value_and_grads(jnp.asarray(h), jnp.asarray(w))
    assert dh.dtype == dw.dtype == lp.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dh), np.asarray(dh0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw0), rtol=0, atol=1e-12)
    ref_dh, ref_dw = numpy_grads(h, w, y, g)
    np.testing.assert_allclose(np.asarray(dh), ref_dh, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dw), ref_dw, rtol=0, atol=1e-12)


def test_bfloat16_vocab_blocked_gradient_matches_the_reference(data):
    """bfloat16 weights, a shifted last block (50 = 3·16 + 2): gradients in bfloat16, close to
    the float64 reference on the same rounded inputs and to the materialized bfloat16 ones."""
    h, w, y, g = data
    hh, ww = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)

    @jax.jit
    def grads(a, b):
        def f(a, b, chunk):
            return jnp.sum(g * chunked_token_logprobs(a, b, y, chunk=chunk, vocab_block=16))

        return jax.grad(f, argnums=(0, 1))(a, b, 0), jax.grad(f, argnums=(0, 1))(a, b, 7)

    (dh0, dw0), (dh, dw) = grads(hh, ww)
    assert dh.dtype == dw.dtype == jnp.bfloat16
    ref_dh, ref_dw = numpy_grads(np.asarray(hh, np.float64), np.asarray(ww, np.float64), y, g)
    for got, full, ref in ((dh, dh0, ref_dh), (dw, dw0, ref_dw)):
        got, full = np.asarray(got, np.float64), np.asarray(full, np.float64)
        tol = 2e-2 * np.abs(ref).max()
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
        np.testing.assert_allclose(got, full, rtol=0, atol=tol)


@pytest.mark.parametrize(
    "vocab, vocab_block, expected",
    [
        (50, None, 50),  # V below the default block: one block
        (4096, None, 4096),
        (151936, None, 2374),  # Qwen2/3: 2^7 · 1187
        (128256, None, 4008),  # Llama-3: 2^8 · 3 · 167
        (4099, None, 4096),  # prime: no divisor in [2048, 4096], a shifted last block
        (50, 64, 50),  # asked for more than V
        (50, 16, 16),  # asked for a non-divisor: kept
    ],
)
def test_vocab_block_rule(vocab, vocab_block, expected):
    assert _logprobs._vocab_block(vocab, vocab_block) == expected


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.float64, jnp.bfloat16))
@pytest.mark.parametrize("vocab_block", (512, 1000))  # 1000 does not divide V = 16384
def test_chunked_backward_keeps_no_vocab_sized_temporary(dtype, vocab_block):
    """dW is written block by block into the output: the compiled temporaries stay well below
    one ``[V, H]`` buffer of ``W``'s dtype (summing per-chunk ``dzᵀ h`` over all V rows did not).

    With bfloat16 XLA:CPU's float normalization upcasts the operand of every bfloat16 dynamic
    slice to float32, and hoists ``convert(W)`` out of the loop: one float32 copy of ``W`` is
    allowed for it, and nothing else of that size.
    """
    n, hdim, vocab = 128, 1024, 16384
    S = jax.ShapeDtypeStruct
    acc = jnp.promote_types(dtype, jnp.float32)
    shapes = (S((n, hdim), dtype), S((vocab, hdim), dtype), S((n,), jnp.int32), S((n,), acc))

    def f(h, w, y, g):
        lp, vjp = jax.vjp(
            lambda h, w: chunked_token_logprobs(h, w, y, chunk=32, vocab_block=vocab_block), h, w
        )
        return lp, vjp(g)

    temp = jax.jit(f).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    dw_bytes = vocab * hdim * jnp.dtype(dtype).itemsize
    cpu_upcast = vocab * hdim * 4 if dtype == jnp.bfloat16 else 0
    assert temp < cpu_upcast + dw_bytes / 2, (temp, dw_bytes)


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
        (dict(chunk=2, vocab_block=0), "vocab_block must be None or an int >= 1"),
        (dict(chunk=2, vocab_block=4.0), "vocab_block must be None or an int >= 1"),
        (dict(chunk=2, vocab_block=True), "vocab_block must be None or an int >= 1"),
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
