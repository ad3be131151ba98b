"""The fused head of losses linear in the logprobs (`runner.local.models._logprobs.linear_loss`)
and the trainer's one-call path for them (``cross_entropy``).

``L = Σ g·lp`` with ``g`` fixed: the fused head forms the logits once per chunk and returns the
gradient of ``L`` without recomputing them. In float64 its logprobs, ``L`` and gradients must
equal those of the chunked head differentiated (`token_logprobs`, vocabulary blocks that do and
do not divide V), of plain autodiff through the materialized logits and of a NumPy reference;
through Llama / Qwen2 / Qwen3 decoders (tied and untied, LoRA with a frozen base, padding rows,
N not a multiple of the chunk); and in the trainer, ``forward_backward(…, "cross_entropy")``
must give the generic three-call path's result, accumulated gradient and step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from runner import AdamParams, Seq
from runner.local import LocalTrainer, LocalTrainerConfig, models
from runner.local import trainer as trainer_module
from runner.local.models import DecoderArch, _decoder, _logprobs
from runner.local.trainer import TRACE_COUNTS

N, H, V = 30, 8, 50
CHUNKS = (0, 1, 4, 7, 16, 29, 30, 64)  # 4, 7, 16, 29 do not divide N = 30; 64 > N
TOL = 1e-12


def numpy_reference(h, w, y, g):
    """``(lp, L, dL/dh, dL/dW)`` of ``L = Σ g·log softmax(W h)[y]`` in float64."""
    z = h @ w.T
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    lp = logp[np.arange(len(y)), y]
    dz = -g[:, None] * np.exp(logp)
    dz[np.arange(len(y)), y] += g
    return lp, float(np.sum(g * lp)), dz @ w, dz.T @ h


def _close(got, want, tol=TOL):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(N, H)) * 2
    w = rng.normal(size=(V, H))
    y = rng.integers(0, V, N)
    g = rng.normal(size=N) * (rng.random(N) < 0.7)  # weights with zeros
    return h, w, y, g


def fused(chunk, vocab_block=None):
    """``((L, lp), (dL/dh, dL/dW))`` of the fused head."""

    def f(h, w, y, g):
        return jax.value_and_grad(
            lambda h, w: _logprobs.linear_loss(h, w, y, g, chunk=chunk, vocab_block=vocab_block),
            (0, 1),
            has_aux=True,
        )(h, w)

    return jax.jit(f)


def differentiated(chunk, vocab_block=None):
    """The same from `token_logprobs` (chunked custom VJP, or materialized autodiff)."""

    def f(h, w, y, g):
        def loss(h, w):
            lp = _logprobs.token_logprobs(h, w, y, chunk=chunk, vocab_block=vocab_block)
            return jnp.sum(g * lp), lp

        return jax.value_and_grad(loss, (0, 1), has_aux=True)(h, w)

    return jax.jit(f)


# -- the head -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
def test_fused_head_equals_the_differentiated_heads_and_the_reference(data, chunk):
    h, w, y, g = (jnp.asarray(a) for a in data)
    got = fused(chunk)(h, w, y, g)
    (loss, lp), (dh, dw) = got
    assert loss.dtype == lp.dtype == dh.dtype == dw.dtype == jnp.float64
    for want in (
        differentiated(0)(h, w, y, g),  # autodiff of the materialized logits
        differentiated(max(chunk, 1))(h, w, y, g),  # the chunked custom VJP, one block
        differentiated(max(chunk, 1), vocab_block=7)(h, w, y, g),  # 7 does not divide V
        differentiated(max(chunk, 1), vocab_block=25)(h, w, y, g),
    ):
        _close(got, want)
    ref_lp, ref_loss, ref_dh, ref_dw = numpy_reference(*data)
    _close((lp, loss, dh, dw), (ref_lp, ref_loss, ref_dh, ref_dw))


@pytest.mark.parametrize("vocab_block", (1, 7, 10, 25, 49, 50, 64))
def test_the_gradient_rows_added_block_by_block_equal_one_product(data, vocab_block):
    # 10 and 25 divide V = 50; 1, 7 and 49 do not (the last block is shifted back and its
    # rows already covered are masked); 50 and 64 are one block.
    h, w, y, g = (jnp.asarray(a) for a in data)
    for chunk in (7, 30):
        _close(fused(chunk, vocab_block)(h, w, y, g), differentiated(0)(h, w, y, g))


@settings(deadline=None, max_examples=12)
@given(
    n=st.sampled_from((1, 17, 40)),
    vocab=st.sampled_from((2, 33, 60)),
    hidden=st.sampled_from((1, 6)),
    chunk=st.sampled_from((0, 5, 17, 45)),
    vocab_block=st.sampled_from((None, 8)),
    seed=st.integers(0, 2**16),
)
def test_fused_head_equals_autodiff_on_random_shapes(n, vocab, hidden, chunk, vocab_block, seed):
    rng = np.random.default_rng(seed)
    h, w = rng.normal(size=(n, hidden)) * 2, rng.normal(size=(vocab, hidden))
    y = rng.integers(0, vocab, n)
    g = rng.normal(size=n) * (rng.random(n) < 0.6)
    args = tuple(jnp.asarray(a) for a in (h, w, y, g))
    _close(fused(chunk, vocab_block)(*args), differentiated(0)(*args))


def test_zero_weights_give_zero_gradients_and_the_logprobs(data):
    h, w, y, _ = (jnp.asarray(a) for a in data)
    (loss, lp), (dh, dw) = fused(7)(h, w, y, jnp.zeros((N,)))
    assert float(loss) == 0 and not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))
    _close(lp, numpy_reference(*data)[0])


def test_a_frozen_unembedding_skips_the_dw_product(data):
    """Differentiating ``h`` only (a LoRA trainer's frozen head): the same ``dh`` from a pass
    with two products per chunk instead of three."""
    h, w, y, g = (jnp.asarray(a) for a in data)

    def loss_h(h):
        return _logprobs.linear_loss(h, w, y, g, chunk=7)[0]

    def loss_hw(h, w):
        return _logprobs.linear_loss(h, w, y, g, chunk=7)[0]

    def dots(fn, *args):
        return str(jax.make_jaxpr(fn)(*args)).count("dot_general")

    assert dots(jax.grad(loss_h), h) == 2
    assert dots(jax.grad(loss_hw, (0, 1)), h, w) == 3
    _close(jax.grad(loss_h)(h), jax.grad(loss_hw)(h, w))


def test_the_weights_gradient_is_the_logprobs_and_logprobs_are_not_differentiated(data):
    h, w, y, g = (jnp.asarray(a) for a in data)
    lp_ref = numpy_reference(*data)[0]
    _close(jax.grad(lambda g: _logprobs.linear_loss(h, w, y, g, chunk=4)[0])(g), lp_ref)
    dh = jax.grad(lambda h: jnp.sum(_logprobs.linear_loss(h, w, y, g, chunk=4)[1]))(h)
    assert not np.any(np.asarray(dh))  # lp is returned through stop_gradient


def test_bfloat16_fused_head_matches_the_chunked_one(data):
    h, w, y, g = data
    args = (jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(y))
    g32 = jnp.asarray(g, jnp.float32)
    (loss, lp), (dh, dw) = fused(7)(*args, g32)
    (loss0, lp0), (dh0, dw0) = differentiated(7, vocab_block=16)(*args, g32)
    assert lp.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp0), rtol=0, atol=1e-5)
    for got, want in ((dh, dh0), (dw, dw0)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_fused_head_temporary_memory_is_bounded():
    """Chunked, the fused head's compiled temporaries are ``O(C·V + V·H + N·H)``: no ``[N, V]``
    buffer (the materialized form has several)."""
    n, hdim, vocab = 1024, 32, 8192
    S = jax.ShapeDtypeStruct
    shapes = (S((n, hdim), jnp.float32), S((vocab, hdim), jnp.float32))
    shapes += (S((n,), jnp.int32), S((n,), jnp.float32))

    def temp_bytes(chunk):
        lowered = fused(chunk).lower(*shapes)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    logits_bytes = n * vocab * 4
    materialized, chunked = temp_bytes(0), temp_bytes(64)
    assert materialized >= logits_bytes
    bound = 4 * (3 * 64 * vocab + 2 * vocab * hdim + 2 * n * hdim)
    assert chunked < min(bound, logits_bytes / 4), (chunked, bound, materialized)


def test_the_unembedding_gradient_has_no_second_full_size_buffer():
    """With ``H`` large against the chunk, one extra ``[V, H]`` temporary (the gradient's
    product formed in one piece beside the carry) would exceed the bound: the rows are added
    ``Vb`` at a time in place."""
    n, hdim, vocab, chunk, block = 256, 256, 8192, 16, 1024
    S = jax.ShapeDtypeStruct
    shapes = (S((n, hdim), jnp.float32), S((vocab, hdim), jnp.float32))
    shapes += (S((n,), jnp.int32), S((n,), jnp.float32))
    temp = fused(chunk, block).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    bound = 4 * (3 * chunk * vocab + block * hdim + 2 * n * hdim)
    assert bound < 4 * vocab * hdim  # the bound leaves no room for a second [V, H] array
    assert temp < bound, (temp, bound)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(vocab_block=0), "vocab_block must be None or an int >= 1"),
        (dict(vocab_block=True), "vocab_block must be None or an int >= 1"),
        (dict(chunk=-1), "chunk must be an int >= 0"),
        (dict(chunk=True), "chunk must be an int >= 0"),
        (dict(chunk=2.0), "chunk must be an int >= 0"),
        (dict(w=np.zeros((V, H + 1))), "expected h"),
        (dict(y=np.zeros((N + 1,), int)), "targets"),
        (dict(g=np.zeros((N, 1))), "weights"),
    ],
)
def test_bad_arguments(data, kwargs, message):
    h, w, y, g = data
    args = {"h": h, "w": w, "y": y, "g": g}
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    kwargs.setdefault("chunk", 2)
    with pytest.raises(ValueError, match=message):
        _logprobs.linear_loss(*(jnp.asarray(args[k]) for k in "hwyg"), **kwargs)


# -- through the decoders -----------------------------------------------------------------------

VOCAB = 37


def decoder(family, tied):
    return models.DecoderConfig(
        family=family,
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=tied,
        mlp_bias=family == "llama" and not tied,
    )


def batch(seed):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (4, 12)))
    lengths = jnp.asarray([12, 7, 0, 2])  # a padding row and a one-target row
    g = rng.normal(size=(4, 11)) * (rng.random((4, 11)) < 0.7)
    return tokens, lengths, jnp.asarray(g)


#: Every pair of (family, tied), (family, lora) and (tied, lora) values once: a covering array
#: of the 12 combinations in 6 (each case compiles four jitted gradients, ~20 s on 2 cores).
DECODER_CASES = [
    ("llama", True, False),
    ("llama", False, True),
    ("qwen2", True, True),
    ("qwen2", False, False),
    ("qwen3", True, False),
    ("qwen3", False, True),
]


def test_the_decoder_cases_cover_every_pair_of_values():
    for i, j in ((0, 1), (0, 2), (1, 2)):
        pairs = {(c[i], c[j]) for c in DECODER_CASES}
        first = {c[i] for c in DECODER_CASES}
        second = {c[j] for c in DECODER_CASES}
        assert pairs == {(a, b) for a in first for b in second}
    assert {c[0] for c in DECODER_CASES} == {"llama", "qwen2", "qwen3"}


@pytest.mark.parametrize("family,tied,lora", DECODER_CASES)
def test_decoder_linear_loss_equals_the_differentiated_logprobs(family, tied, lora):
    cfg = decoder(family, tied)
    weights = jax.tree.map(jnp.asarray, models.init_params(cfg, seed=1, dtype="float64"))
    tokens, lengths, g = batch(2)
    if lora:  # the adapters are trained, the base (with its unembedding) is frozen
        lcfg = models.LoraConfig(rank=2, alpha=3.0, targets=("q_proj", "v_proj", "up_proj"))
        adapters = models.init_lora(cfg, lcfg, dtype="float64")
        params = jax.tree.map(lambda a: jnp.asarray(a) + 0.1, adapters)  # B ≠ 0
        kw = dict(lora_scale=lcfg.scale)

        def split(p):
            return weights, {"lora": p, **kw}
    else:
        params = weights

        def split(p):
            return p, {}

    def via_logprobs(chunk):
        def loss(p):
            w, kw = split(p)
            lp = _decoder.token_logprobs(cfg, w, tokens, lengths, chunk=chunk, **kw)
            return jnp.sum(g * lp), lp

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    def via_fused(chunk):
        def loss(p):
            w, kw = split(p)
            return _decoder.linear_loss(cfg, w, tokens, lengths, g, chunk=chunk, **kw)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    got = via_fused(5)  # 44 tokens: 5 does not divide them
    (_, lp), grads = got
    assert np.all(np.asarray(lp)[2] == 0) and np.all(np.asarray(lp)[1, 6:] == 0)  # padding
    if not lora and tied:
        assert float(jnp.max(jnp.abs(grads["embed"]))) > 0
    _close(got, via_logprobs(5), 1e-11)
    _close(got, via_logprobs(0), 1e-11)
    _close(via_fused(0), via_logprobs(0), 1e-11)


def test_decoder_linear_loss_rejects_misshapen_weights():
    cfg = decoder("llama", True)
    params = jax.tree.map(jnp.asarray, models.init_params(cfg, seed=1, dtype="float64"))
    tokens, lengths, g = batch(0)
    with pytest.raises(ValueError, match="weights"):
        _decoder.linear_loss(cfg, params, tokens, lengths, g[:, :-1], chunk=4)


# -- the trainer ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GenericArch(DecoderArch):
    """A decoder without the fused head: the trainer runs its generic three-call path."""

    fused_linear_loss: ClassVar[bool] = False


def trainer_pair(**kw):
    cfg = LocalTrainerConfig(decoder=decoder("qwen3", True), max_seq_len=32, seed=4, **kw)
    fused_t, generic_t = LocalTrainer(cfg), LocalTrainer(cfg)
    generic_t.arch = GenericArch(
        **{f.name: getattr(fused_t.arch, f.name) for f in dataclasses.fields(fused_t.arch)}
    )
    return fused_t, generic_t


def seqs(seed, lengths=(11, 20, 6)):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        w = rng.normal(size=n - 1) * (rng.random(n - 1) < 0.7)  # weights with zeros
        out.append(Seq(rng.integers(0, VOCAB, n), {"weights": w}))
    return out


def _assert_same_result(a, b):
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        np.testing.assert_allclose(a.metrics[key], b.metrics[key], rtol=TOL, atol=TOL)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=TOL)


@pytest.mark.parametrize(
    "kw",
    [
        dict(dtype="float64"),
        dict(dtype="float64", logprob_chunk=0),
        dict(dtype="float64", logprob_chunk=7, unroll_layers=True),
        dict(dtype="float64", lora=models.LoraConfig(rank=2, alpha=4.0)),
    ],
    ids=["chunked", "materialized", "chunk7-unrolled", "lora"],
)
def test_trainer_fused_cross_entropy_equals_the_generic_path(kw):
    fused_t, generic_t = trainer_pair(**kw)
    before = dict(TRACE_COUNTS)
    for seed, lengths in ((0, (11, 20, 6)), (1, (21, 3, 17))):  # two calls, one bucket
        data = seqs(seed, lengths)
        a = fused_t.forward_backward(data, "cross_entropy")
        b = generic_t.forward_backward(data, "cross_entropy")
        _assert_same_result(a, b)
        assert a.metrics["num_nonzero_grad_tokens:sum"] > 0
        _close(fused_t.accumulated_grads(), generic_t.accumulated_grads())
    assert fused_t.grad_counts == generic_t.grad_counts
    key = "linear_forward_backward:cross_entropy"
    assert TRACE_COUNTS[key] - before.get(key, 0) <= 1  # one bucket: at most one compile
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
    ma = fused_t.optim_step(adam, "num_loss_tokens")
    mb = generic_t.optim_step(adam, "num_loss_tokens")
    assert ma.keys() == mb.keys()
    for k in ma:
        np.testing.assert_allclose(ma[k], mb[k], rtol=1e-10)
    _close(fused_t.params, generic_t.params, 1e-10)
    _assert_same_result(
        fused_t.forward_backward(seqs(2), "cross_entropy"),
        generic_t.forward_backward(seqs(2), "cross_entropy"),
    )


def test_trainer_paths_by_kernel_and_model(monkeypatch):
    """``cross_entropy`` on a decoder runs the fused call; a kernel not linear in the logprobs,
    and every kernel of the GPT-2 default (no fused head), run the generic three calls. Either
    compiles once per bucket, shared by trainers of the same shape."""
    calls = []
    for name in ("_linear_forward_backward_jit", "_model_vjp_jit"):
        original = getattr(trainer_module, name)

        def spy(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(trainer_module, name, spy)
    fused_t, _ = trainer_pair(dtype="float64")
    data = seqs(3)
    rl = [
        Seq(s.tokens, {"logprobs": -np.ones(len(s.tokens) - 1), "advantages": s.inputs["weights"]})
        for s in data
    ]
    gpt2 = LocalTrainer(LocalTrainerConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32))
    runs = [
        (fused_t, data, "cross_entropy", "_linear_forward_backward_jit"),
        (fused_t, rl, "importance_sampling", "_model_vjp_jit"),
        (gpt2, data, "cross_entropy", "_model_vjp_jit"),
    ]
    for trainer, batch_seqs, kernel, path in runs:
        calls.clear()
        trainer.forward_backward(batch_seqs, kernel)  # compiled
        assert calls == [path]
        before = dict(TRACE_COUNTS)
        new_seqs = [Seq(s.tokens[::-1].copy(), s.inputs) for s in batch_seqs]  # same bucket
        trainer.forward_backward(new_seqs, kernel)
        LocalTrainer(trainer.config).forward_backward(new_seqs, kernel)  # a second trainer
        assert dict(TRACE_COUNTS) == before, kernel
