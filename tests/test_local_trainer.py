"""runner.local.LocalTrainer: kernels vs `losses` terms, accumulation, AdamW, sampling, DP, errors.

Every trainer here shares one tiny float64 config, so the jitted functions compile once per
length bucket for the whole module (x64 is enabled by conftest).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import losses
from runner import BUILTIN_LOSSES, AdamParams, Seq, Trainer
from runner.local import (
    KERNELS,
    LocalTrainer,
    LocalTrainerConfig,
    kernels,
    length_bucket,
    model,
    row_bucket,
)
from runner.local.trainer import TRACE_COUNTS

V, MAX_LEN = 16, 32
CFG = LocalTrainerConfig(
    vocab_size=V, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=MAX_LEN, dtype="float64"
)
#: Test-only references: compile fast (XLA backend optimization level 0), run slower.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
REF_ROWS, REF_T = 8, 16  # the reference's fixed padded shape (one compile per term)

KERNEL_CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {"ratio_log_cap": 1.5}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}),
    ("dro", {"beta": 0.3}),
    # Fireworks-only kernels with inferred formulas (named by losses.builtin_twin)
    ("dapo", {"eps_clip_c": 2.0}),
    ("gspo", {"clip_low_threshold": 0.9, "seq_ratio_log_cap": 0.5}),
    ("dppo", {"divergence": "binary_kl", "threshold": 0.05}),
]


def make_trainer(**overrides) -> LocalTrainer:
    return LocalTrainer(CFG, **overrides)


def rand_seqs(rng, lengths, kernel="cross_entropy"):
    """Random sequences with the kernel's inputs (q in [-4, -1]: many clipped PPO tokens)."""
    seqs = []
    for n in lengths:
        toks = rng.integers(0, V, size=n)
        if kernel == "cross_entropy":
            w = rng.normal(size=n - 1) * (rng.random(n - 1) < 0.8)
            inputs = {"weights": w}
        else:
            adv = rng.normal(size=n - 1) * (rng.random(n - 1) < 0.8)
            inputs = {"logprobs": rng.uniform(-4.0, -1.0, size=n - 1), "advantages": adv}
        seqs.append(Seq(toks, inputs))
    return seqs


def term_for(kernel: str, cfg: dict) -> losses.Term:
    """The `losses` term a kernel should equal, built independently of runner.local."""
    cfg = dict(cfg)
    if kernel == "cross_entropy":
        return losses.weighted_cross_entropy()
    if kernel == "dro":
        return losses.dro(beta=cfg.get("beta", 0.05), reduction="token_sum")
    mlr = cfg.pop("ratio_log_cap", 20.0)
    if kernel == "cispo":  # the Tinker tutorial's defaults
        cfg.setdefault("clip_low_threshold", 0.0)
        cfg.setdefault("clip_high_threshold", 4.0)
    return getattr(losses, kernel)(reduction="token_sum", max_log_ratio=mlr, **cfg)


def ref_batch(kernel, seqs):
    """Independent padding to [REF_ROWS, REF_T]: tokens, lengths and the losses.Batch."""
    tokens = np.zeros((REF_ROWS, REF_T + 1), np.int64)
    lengths = np.zeros((REF_ROWS,), np.int64)
    mask = np.zeros((REF_ROWS, REF_T))
    per = {k: np.zeros((REF_ROWS, REF_T)) for k in ("weights", "logprobs", "advantages")}
    for i, s in enumerate(seqs):
        n = s.num_targets
        tokens[i, : n + 1] = s.tokens
        lengths[i] = n + 1
        mask[i, :n] = 1.0
        for k, v in s.inputs.items():
            per[k][i, :n] = v
    if kernel == "cross_entropy":
        batch = losses.Batch(action_mask=mask, weights=per["weights"])
    else:
        batch = losses.Batch(
            action_mask=mask, advantages=per["advantages"], sampling_logprobs=per["logprobs"]
        )
    return jnp.asarray(tokens), jnp.asarray(lengths), batch


@functools.cache
def reference_fn(kernel: str, frozen: tuple):
    """jit of (value, d/dparams of term∘token_logprobs, logprobs, d/dlogprobs of term)."""
    term = term_for(kernel, dict(frozen))
    lp_fn = functools.partial(model.token_logprobs, n_heads=CFG.n_heads)

    def ref(params, tokens, lengths, batch):
        value, grads = jax.value_and_grad(lambda p: term(lp_fn(p, tokens, lengths), batch)[0])(
            params
        )
        lp = lp_fn(params, tokens, lengths)
        g_lp = jax.grad(lambda x: term(x, batch)[0])(lp)
        return value, grads, lp, g_lp

    return jax.jit(ref, compiler_options=FAST_COMPILE)


def assert_trees_close(a, b, rtol=1e-10):
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    scale = max(float(np.max(np.abs(np.asarray(x)))) for x in leaves_b) or 1.0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol * scale)


@pytest.fixture(scope="module")
def trainer():
    return make_trainer()


def test_protocol_and_config_defaults():
    tr = make_trainer()
    assert isinstance(tr, Trainer)
    default = LocalTrainerConfig()
    assert default.vocab_size == 64 and default.dtype == "float32"
    assert tr.counters == {"forward": 0, "backward": 0, "optim_step": 0, "sample": 0}
    assert tr.accumulated_grads() is None
    with pytest.raises(ValueError, match="divisible"):
        LocalTrainerConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        LocalTrainerConfig(dtype="bfloat16")


def test_the_jit_factories_are_bounded_caches():
    """A long-lived server meets new (model, kernel configuration) keys for as long as it runs:
    every memoized factory of the trainer and the kernel table keeps at most `JIT_CACHE_SIZE`."""
    from runner.local import kernels
    from runner.local import trainer as trainer_module

    factories = [
        f
        for module in (trainer_module, kernels)
        for f in vars(module).values()
        if callable(getattr(f, "cache_parameters", None))
    ]
    assert len(factories) >= 9  # the trainer's eight jit factories and linear_gradient
    for f in factories:
        assert f.cache_parameters()["maxsize"] == kernels.JIT_CACHE_SIZE, f.__name__


def test_kernel_table_covers_builtin_losses_and_twins():
    # the local trainer runs the whole kernel table (runner._kernels)
    assert LocalTrainer.builtin_losses == tuple(BUILTIN_LOSSES) == tuple(KERNELS)
    for term in (
        losses.grpo(clip_low=0.2, clip_high=0.28),
        losses.grpo(dual_clip=3.0),
        losses.cispo(),
        losses.gspo(),
        losses.dppo(),
        losses.dro(reduction="token_sum"),
    ):
        name, cfg = losses.builtin_twin(term)
        assert name in KERNELS
        kernels.resolve(name, cfg)  # the twin's config is accepted as is


def test_buckets():
    assert [length_bucket(n, 256) for n in (1, 16, 17, 100, 129, 256)] == [
        16,
        16,
        32,
        128,
        256,
        256,
    ]
    assert length_bucket(150, 200) == 200
    assert [row_bucket(n, 1, 8) for n in (1, 8, 9, 32, 33)] == [8, 8, 16, 32, 64]
    assert row_bucket(3, 2, 1) == 4 and row_bucket(1, 2, 1) == 2 and row_bucket(5, 3, 8) == 9
    # Long rows lower the floor of 8 (at most 2048 padded positions of empty rows' floor)...
    assert [row_bucket(2, 1, 8, width) for width in (16, 256, 512, 1024, 2048, 4096)] == [
        8,
        8,
        4,
        2,
        2,
        2,
    ]
    assert [row_bucket(1, 1, 8, width) for width in (1024, 2048, 8192)] == [2, 1, 1]
    assert row_bucket(3, 2, 8, 4096) == 4  # ... still a multiple of the device count


def test_two_long_sequences_are_padded_to_two_rows_and_the_client_loss_shares_the_bucket(
    monkeypatch,
):
    # Two long sequences pad to 2 rows, not 8 (4x the work of a real decoder); the client
    # loss's bucket is the trainer's, so a forward's padded logprobs are its input as they are.
    # The toy model's lengths stand in for real ones: MIN_ROW_TOKENS is set to MAX_LEN here
    # (2048 = 2 rows of 1024 in the runner).
    import runner._padding as padding
    from runner import ClientLoss
    from runner._padding import CheckedSeqs

    tr = make_trainer()
    seqs = rand_seqs(np.random.default_rng(11), [MAX_LEN - 20, MAX_LEN])
    monkeypatch.setattr(padding, "MIN_ROW_TOKENS", 2 * MAX_LEN)
    lp = tr.forward(CheckedSeqs(seqs))
    assert lp.padded.shape == (2, MAX_LEN)
    assert ClientLoss(losses.sft_cross_entropy()).shapes(seqs) == lp.padded.shape
    monkeypatch.setattr(padding, "MIN_ROW_TOKENS", 8 * MAX_LEN)  # the floor of 8 rows again
    lp8 = tr.forward(CheckedSeqs(seqs))
    assert lp8.padded.shape == (8, MAX_LEN)
    for a, b in zip(lp, lp8, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)  # padding rows change no logprob


# -- kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,cfg", KERNEL_CASES, ids=lambda x: str(x))
@settings(max_examples=5)
@given(data_seed=st.integers(0, 2**31 - 1), n_rows=st.integers(1, REF_ROWS))
def test_kernel_matches_losses_term_and_direct_grad(trainer, kernel, cfg, data_seed, n_rows):
    rng = np.random.default_rng(data_seed)
    seqs = rand_seqs(rng, rng.integers(2, REF_T + 2, size=n_rows), kernel)
    trainer.reset_grads()
    result = trainer.forward_backward(seqs, kernel, cfg)
    tokens, lengths, batch = ref_batch(kernel, seqs)
    value, grads, lp, g_lp = reference_fn(kernel, tuple(sorted(cfg.items())))(
        trainer.params, tokens, lengths, batch
    )
    np.testing.assert_allclose(result.metrics["loss:sum"], float(value), rtol=1e-10, atol=1e-12)
    assert_trees_close(trainer.accumulated_grads(), grads)
    for i, s in enumerate(seqs):
        assert result.logprobs[i].dtype == np.dtype(trainer.config.dtype)  # the model dtype
        assert result.logprobs[i].shape == (s.num_targets,)
        np.testing.assert_allclose(
            result.logprobs[i], np.asarray(lp[i, : s.num_targets]), rtol=1e-6
        )
    nonzero = np.asarray(g_lp != 0)
    assert result.metrics["num_nonzero_grad_tokens:sum"] == nonzero.sum()
    assert result.metrics["num_nonzero_grad_sequences:sum"] == nonzero.any(axis=1).sum()
    assert trainer.grad_counts == {
        "num_loss_tokens": int(nonzero.sum()),
        "num_sequences": int(nonzero.any(axis=1).sum()),
    }
    assert all(":" in k for k in result.metrics)
    trainer.reset_grads()


def test_kernel_defaults_and_metrics(trainer):
    rng = np.random.default_rng(1)
    seqs = rand_seqs(rng, [5, 9], "cispo")
    trainer.reset_grads()
    explicit = trainer.forward_backward(
        seqs, "cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0, "ratio_log_cap": 20}
    )
    default = trainer.forward_backward(seqs, "cispo")
    assert explicit.metrics == default.metrics
    assert default.metrics["num_tokens:sum"] == 4 + 8
    assert "clip_frac:mean" in default.metrics and "ratio_max:max" in default.metrics
    ppo = trainer.forward_backward(rand_seqs(rng, [6], "ppo"), "ppo")
    assert {"clip_frac_low:mean", "clip_frac_high:mean"} <= set(ppo.metrics)
    trainer.reset_grads()


def test_counters_and_forward_matches_forward_backward_logprobs():
    tr = make_trainer()
    rng = np.random.default_rng(2)
    seqs = rand_seqs(rng, [3, 17, 8])
    lps = tr.forward(seqs)
    res = tr.forward_backward(seqs, "cross_entropy")
    for a, b in zip(lps, res.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.all(a <= 0)
    tr.optim_step(AdamParams())
    tr.sample([[1, 2]], num_samples=1, max_tokens=2)
    assert tr.counters == {"forward": 2, "backward": 1, "optim_step": 1, "sample": 1}
    assert tr.step == 1


def test_forward_is_padding_invariant():
    tr = make_trainer()
    rng = np.random.default_rng(3)
    seqs = rand_seqs(rng, [4, 9, 20])  # width bucket 32
    together = tr.forward(seqs)
    alone = [tr.forward([s])[0] for s in seqs]  # buckets 16/16/32
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# -- accumulation and the optimizer step --------------------------------------------------------


def test_two_calls_then_step_equal_one_call_with_both():
    rng = np.random.default_rng(4)
    s1, s2 = rand_seqs(rng, [5, 12], "ppo"), rand_seqs(rng, [7, 3, 16], "ppo")
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.01)
    a, b = make_trainer(), make_trainer()
    r1 = a.forward_backward(s1, "ppo")
    r2 = a.forward_backward(s2, "ppo")
    r12 = b.forward_backward(s1 + s2, "ppo")
    assert_trees_close(a.accumulated_grads(), b.accumulated_grads())
    np.testing.assert_allclose(
        r1.metrics["loss:sum"] + r2.metrics["loss:sum"], r12.metrics["loss:sum"], rtol=1e-12
    )
    assert a.grad_counts == b.grad_counts
    ma = a.optim_step(adam, "num_loss_tokens")
    mb = b.optim_step(adam, "num_loss_tokens")
    assert ma["num_loss_tokens"] == mb["num_loss_tokens"]
    np.testing.assert_allclose(ma["grad_norm"], mb["grad_norm"], rtol=1e-10)
    assert_trees_close(a.params, b.params, rtol=1e-9)
    assert a.accumulated_grads() is None and a.grad_counts == {
        "num_loss_tokens": 0,
        "num_sequences": 0,
    }


def _np_tree(tree):
    return {k: np.asarray(v) for k, v in model.flatten(jax.device_get(tree)).items()}


def test_optim_step_matches_numpy_adamw():
    tr = make_trainer()
    rng = np.random.default_rng(5)
    seqs = rand_seqs(rng, [9, 14, 6])
    p = _np_tree(tr.params)
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    steps = [
        (AdamParams(0.05, 0.8, 0.9, 1e-3, 0.1, grad_clip_norm=0.05), "num_loss_tokens"),
        (AdamParams(0.02, 0.85, 0.99, 1e-8, 0.0, grad_clip_norm=0.0), None),
        (AdamParams(0.01, 0.9, 0.95, 1e-12, 0.3, grad_clip_norm=1e6), "num_sequences"),
    ]
    for t, (adam, norm_mode) in enumerate(steps, start=1):
        tr.forward_backward(seqs, "cross_entropy")
        g = _np_tree(tr.accumulated_grads())
        counts = tr.grad_counts
        denom = {None: 1, "num_loss_tokens": counts["num_loss_tokens"]}.get(
            norm_mode, counts["num_sequences"]
        )
        g = {k: x / denom for k, x in g.items()}
        gnorm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        if adam.grad_clip_norm > 0 and gnorm > adam.grad_clip_norm:
            g = {k: x * (adam.grad_clip_norm / gnorm) for k, x in g.items()}
        if t == 1:
            assert gnorm > adam.grad_clip_norm  # clipping binds on the first step
        b1, b2 = adam.beta1, adam.beta2
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mhat, vhat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            p[k] = p[k] - adam.learning_rate * (
                mhat / (np.sqrt(vhat) + adam.eps) + adam.weight_decay * p[k]
            )
        metrics = tr.optim_step(adam, norm_mode)
        np.testing.assert_allclose(metrics["grad_norm"], gnorm, rtol=1e-10)
        assert metrics["normalization_denominator"] == denom
        got = _np_tree(tr.params)
        for k in p:
            np.testing.assert_allclose(got[k], p[k], rtol=1e-9, atol=1e-12, err_msg=k)


def test_a_non_finite_update_is_not_applied():
    """Issue #23 item 4: ``optim.eps = 0`` (0/0 on a zero second moment) and a learning rate of
    1e30 trained NaN weights; now the update is refused and the state kept exactly."""
    from runner import NonFiniteUpdateError

    tr = make_trainer()
    seqs = rand_seqs(np.random.default_rng(6), [9, 14])
    p0, step0 = _np_tree(tr.params), tr.step
    tr.forward_backward(seqs, "cross_entropy")
    with pytest.raises(NonFiniteUpdateError, match=r"not finite; it was not applied .*eps=0"):
        tr.optim_step(AdamParams(1e-3, 0.9, 0.95, 0.0, 0.0))
    assert tr.step == step0 and tr.accumulated_grads() is None
    for k, v in _np_tree(tr.params).items():
        np.testing.assert_array_equal(v, p0[k], err_msg=k)
    tr.forward_backward(seqs, "cross_entropy")  # an update that overflows
    with pytest.raises(NonFiniteUpdateError, match=r"learning_rate=1e\+300"):
        tr.optim_step(AdamParams(1e300, 0.9, 0.95, 1e-8, 0.0))
    tr.forward_backward(seqs, "cross_entropy")  # the same gradient then applies as usual
    assert tr.optim_step(AdamParams(1e-3, 0.9, 0.95, 1e-8, 0.0))["step"] == step0 + 1
    assert any(not np.array_equal(v, p0[k]) for k, v in _np_tree(tr.params).items())


def test_normalization_counts_with_exactly_zero_gradient_tokens():
    tr = make_trainer()
    rng = np.random.default_rng(6)
    toks = [rng.integers(0, V, size=n) for n in (9, 7, 6)]
    p = tr.forward([Seq(t) for t in toks])
    # seq 0: first 4 tokens on-policy with A=1 (gradient), last 4 have r=e>1.2 with A>0 (clipped).
    q0 = p[0].astype(np.float64).copy()
    q0[4:] -= 1.0
    a0 = np.ones(8)
    # seq 1: A=0 everywhere (no gradient at all).
    # seq 2: A<0 with r=1/e<0.8 (clipped) except target 2, which is on-policy.
    q2 = p[2].astype(np.float64) + 1.0
    q2[2] = p[2][2]
    seqs = [
        Seq(toks[0], {"logprobs": q0, "advantages": a0}),
        Seq(toks[1], {"logprobs": p[1].astype(np.float64), "advantages": np.zeros(6)}),
        Seq(toks[2], {"logprobs": q2, "advantages": -np.ones(5)}),
    ]
    expected = {None: 1, "none": 1, "num_loss_tokens": 4 + 1, "num_sequences": 2}
    frozen = AdamParams(learning_rate=0.0)  # params never change: same gradient every time
    norms = {}
    for mode, denom in expected.items():
        res = tr.forward_backward(seqs, "ppo")
        assert res.metrics["num_nonzero_grad_tokens:sum"] == 5
        assert res.metrics["num_nonzero_grad_sequences:sum"] == 2
        raw = float(optax_global_norm(tr.accumulated_grads()))
        metrics = tr.optim_step(frozen, mode)
        assert metrics["num_loss_tokens"] == 5 and metrics["num_sequences"] == 2
        np.testing.assert_allclose(metrics["grad_norm"], raw / denom, rtol=1e-12)
        norms[mode] = metrics["grad_norm"]
    # cross_entropy: tokens with zero weight have zero gradient
    w = [np.array([0.0, 1.0, -2.0, 0.0, 0.0, 0.5, 0.0, 0.0]), np.zeros(6), np.zeros(5)]
    res = tr.forward_backward(
        [Seq(t, {"weights": x}) for t, x in zip(toks, w, strict=True)], "cross_entropy"
    )
    assert res.metrics["num_nonzero_grad_tokens:sum"] == 3
    assert res.metrics["num_nonzero_grad_sequences:sum"] == 1
    assert res.metrics["num_weighted_tokens:sum"] == 3
    tr.reset_grads()


def optax_global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(tree)))


def test_optimizer_state_survives_changing_adam_params():
    a, b = make_trainer(), make_trainer()
    seqs = rand_seqs(np.random.default_rng(7), [10, 6])
    for tr, lrs in ((a, (1e-2, 3e-2)), (b, (1e-2, 3e-2))):
        for lr in lrs:
            tr.forward_backward(seqs, "cross_entropy")
            tr.optim_step(AdamParams(learning_rate=lr))
    assert_trees_close(a.params, b.params, rtol=0)
    assert a.step == 2


# -- compile counts -----------------------------------------------------------------------------


def test_no_recompile_within_a_bucket():
    tr = make_trainer()
    rng = np.random.default_rng(8)
    tr.forward(rand_seqs(rng, [5]))
    tr.forward_backward(rand_seqs(rng, [5]), "cross_entropy")
    tr.optim_step(AdamParams())
    before = dict(TRACE_COUNTS)
    for n_rows in range(1, 9):
        lengths = rng.integers(2, 18, size=n_rows)  # ≤ 16 targets: one length bucket
        tr.forward(rand_seqs(rng, lengths))
        tr.forward_backward(rand_seqs(rng, lengths), "cross_entropy")
        tr.optim_step(AdamParams(learning_rate=float(rng.uniform(1e-4, 1e-2)), weight_decay=0.1))
    assert dict(TRACE_COUNTS) == before
    tr.forward(rand_seqs(rng, [30]))  # a new length bucket (32) traces once more at most
    tr.forward(rand_seqs(rng, [25, 19]))
    assert TRACE_COUNTS["forward"] - before["forward"] <= 1
    tr.sample([[1, 2, 3]], num_samples=2, max_tokens=5, seed=0)
    sample_before = TRACE_COUNTS["sample"]
    tr.sample([[4], [5, 6]], num_samples=1, max_tokens=9, temperature=0.5, seed=3)
    assert TRACE_COUNTS["sample"] == sample_before  # same buckets, traced scalars


# -- sampling -----------------------------------------------------------------------------------

PROMPTS = [[1], [2, 3, 4], [5, 6, 7, 8, 9]]


@functools.cache
def _logits_fn():
    return jax.jit(
        functools.partial(model.logits, n_heads=CFG.n_heads), compiler_options=FAST_COMPILE
    )


def full_logits(tr, prompt, completion):
    """Model logits for prompt+completion[:-1] inputs, padded to one shape."""
    seq = np.concatenate([prompt, completion]).astype(np.int64)
    inputs = np.zeros((1, MAX_LEN), np.int64)
    inputs[0, : len(seq) - 1] = seq[:-1]
    return np.asarray(_logits_fn()(tr.params, inputs))[0, : len(seq) - 1]


def test_sampling_is_deterministic_and_seeded(trainer):
    a = trainer.sample(PROMPTS, num_samples=3, max_tokens=8, seed=11)
    b = trainer.sample(PROMPTS, num_samples=3, max_tokens=8, seed=11)
    c = trainer.sample(PROMPTS, num_samples=3, max_tokens=8, seed=12)
    flat = lambda out: [s.tokens.tolist() for row in out for s in row]  # noqa: E731
    assert flat(a) == flat(b)
    assert flat(a) != flat(c)
    assert len(set(map(tuple, flat(a)))) > 1  # samples of a prompt differ
    for row_a, row_b in zip(a, b, strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
    # a completion depends only on (seed, its row i*n + j, prompt, weights): fewer prompts
    # leave the first rows' completions as they were
    fewer = trainer.sample(PROMPTS[:2], num_samples=3, max_tokens=8, seed=11)
    assert flat(fewer) == flat(a[:2])


def test_sampling_logprobs_equal_forward_logprobs(trainer):
    out = trainer.sample(PROMPTS, num_samples=2, max_tokens=12, seed=5)
    seqs, spans = [], []
    for prompt, row in zip(PROMPTS, out, strict=True):
        for s in row:
            assert s.tokens.dtype == np.int64 and s.logprobs.dtype == np.float32
            assert len(s.tokens) == 12 and s.stop_reason == "length"
            seqs.append(Seq(np.concatenate([prompt, s.tokens])))
            spans.append((len(prompt) - 1, s.logprobs))
    for lp, (start, sample_lp) in zip(trainer.forward(seqs), spans, strict=True):
        np.testing.assert_allclose(lp[start:], sample_lp, rtol=1e-6, atol=1e-6)


def test_sampling_temperature_logprobs(trainer):
    temp = 0.6
    out = trainer.sample(PROMPTS[1:], num_samples=2, max_tokens=6, temperature=temp, seed=2)
    for prompt, row in zip(PROMPTS[1:], out, strict=True):
        for s in row:
            logits = full_logits(trainer, prompt, s.tokens)[len(prompt) - 1 :]
            logp = jax.nn.log_softmax(logits / temp, axis=-1)
            expected = np.take_along_axis(np.asarray(logp), s.tokens[:, None], axis=1)[:, 0]
            np.testing.assert_allclose(s.logprobs, expected, rtol=1e-6, atol=1e-6)


def test_sampling_stop_tokens(trainer):
    stops = {3, 7}
    out = trainer.sample(PROMPTS, num_samples=4, max_tokens=8, seed=0, stop_token_ids=[3, 7])
    reasons = []
    for row in out:
        for s in row:
            toks = s.tokens.tolist()
            assert len(s.logprobs) == len(toks)
            assert not stops & set(toks[:-1])
            if s.stop_reason == "stop":
                assert toks[-1] in stops and len(toks) <= 8
            else:
                assert s.stop_reason == "length" and len(toks) == 8 and toks[-1] not in stops
            reasons.append(s.stop_reason)
    assert "stop" in reasons


def test_greedy_sampling(trainer):
    out = trainer.sample(PROMPTS, num_samples=2, max_tokens=7, temperature=0.0, seed=0)
    other = trainer.sample(PROMPTS, num_samples=1, max_tokens=7, temperature=0, seed=99)
    for prompt, row, row2 in zip(PROMPTS, out, other, strict=True):
        assert row[0].tokens.tolist() == row[1].tokens.tolist() == row2[0].tokens.tolist()
        logits = full_logits(trainer, prompt, row[0].tokens)[len(prompt) - 1 :]
        np.testing.assert_array_equal(np.argmax(logits, axis=-1), row[0].tokens)
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        expected = np.take_along_axis(logp, row[0].tokens[:, None], axis=1)[:, 0]
        np.testing.assert_allclose(row[0].logprobs, expected, rtol=1e-6, atol=1e-6)


# -- bad input ----------------------------------------------------------------------------------


def _seq(n=5, **inputs):
    return Seq(np.arange(n) % V, inputs)


BAD_FB = [
    ([_seq(weights=np.ones(4)), Seq(np.arange(5), {"weights": np.ones(3)})], "cross_entropy", None, r"sequence 1.*'weights'.*shape"),
    ([], "cross_entropy", None, "empty batch"),
    ([_seq(weights=np.ones(4))], "grpo", None, "unknown loss 'grpo'"),
    ([_seq(weights=np.ones(4))], "cross_entropy", {"beta": 1.0}, r"unknown loss_fn_config key.*beta"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "ppo", {"clip_low": 0.2}, "clip_low"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "ppo", {"clip_low_threshold": 1.5}, "clip_low_threshold"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "cispo", {"ratio_log_cap": 0}, r"'ratio_log_cap' must be a number > 0"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "ppo", {"ratio_log_cap": 20}, r"unknown loss_fn_config key 'ratio_log_cap'"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "dro", {"ratio_log_cap": 5}, "ratio_log_cap"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "ppo", {"target_logprob_support": "sampling_support"}, "full-vocabulary logprobs only"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "reinforce", {"score_centering": True}, "score_centering"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "dppo", {"divergence": 1.0}, "divergence"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "dppo", {"divergence": "l2"}, "divergence"),
    ([_seq(logprobs=-np.ones(4), advantages=np.ones(4))], "ppo", {"clip_low_threshold": "0.8"}, "must be a number"),
    ([_seq(weights=np.array([1.0, np.nan, 0, 0]))], "cross_entropy", None, r"sequence 0.*'weights'.*non-finite.*target 1"),
    ([_seq(weights=np.ones(4)), _seq(weights=np.array([0, 0, np.inf, 0]))], "cross_entropy", None, r"sequence 1.*'weights'.*non-finite"),
    ([Seq(np.array([1, 2, 99]), {"weights": np.ones(2)})], "cross_entropy", None, r"sequence 0.*token 99.*vocabulary"),
    ([Seq(np.array([1, -1, 2]), {"weights": np.ones(2)})], "cross_entropy", None, r"sequence 0.*outside the vocabulary"),
    ([_seq(MAX_LEN + 2, weights=np.ones(MAX_LEN + 1))], "cross_entropy", None, r"sequence 0.*max_seq_len"),
    ([_seq(logprobs=-np.ones(4))], "ppo", None, r"sequence 0.*missing required field 'advantages'"),
    ([_seq()], "cross_entropy", None, r"sequence 0.*missing required field 'weights'"),
    ([_seq(weights=np.ones(4), advantages=np.ones(4))], "cross_entropy", None, r"sequence 0.*'advantages'.*not an input"),
    ([_seq(weights=np.ones(4), target_tokens=np.array([1, 2, 3, 5]))], "cross_entropy", None, r"sequence 0.*'target_tokens'"),
    ([_seq(logprobs=np.array([-1, 0.5, -1, -1]), advantages=np.ones(4))], "ppo", None, r"sequence 0.*'logprobs'.*positive"),
    ([Seq(np.array([3]), {})], "cross_entropy", None, r"sequence 0.*at least 2"),
    ([Seq(np.array([1.0, 2.0]), {"weights": np.ones(1)})], "cross_entropy", None, r"sequence 0.*integers"),
]  # fmt: skip


@pytest.mark.parametrize("seqs,loss,cfg,match", BAD_FB)
def test_forward_backward_rejects_bad_input(trainer, seqs, loss, cfg, match):
    trainer.reset_grads()
    with pytest.raises(ValueError, match=match):
        trainer.forward_backward(seqs, loss, cfg)
    assert trainer.accumulated_grads() is None


def test_forward_rejects_bad_input_and_accepts_target_tokens(trainer):
    with pytest.raises(ValueError, match="empty batch"):
        trainer.forward([])
    with pytest.raises(ValueError, match=r"sequence 0.*max_seq_len"):
        trainer.forward([_seq(MAX_LEN + 2)])
    with pytest.raises(ValueError, match="sequence of runner.Seq"):
        trainer.forward(_seq())
    seq = _seq(weights=np.ones(4), target_tokens=np.arange(1, 5))  # == tokens[1:]: accepted
    assert trainer.forward_backward([seq], "cross_entropy").metrics["loss:sum"] > 0
    trainer.reset_grads()


def test_optim_step_rejects_bad_calls():
    tr = make_trainer()
    with pytest.raises(ValueError, match="no gradient accumulated"):
        tr.optim_step(AdamParams())
    tr.forward_backward([_seq(weights=np.ones(4))], "cross_entropy")
    with pytest.raises(ValueError, match="unknown normalization"):
        tr.optim_step(AdamParams(), "mean")
    tr.optim_step(AdamParams(), "none")
    with pytest.raises(ValueError, match="no gradient accumulated"):
        tr.optim_step(AdamParams())


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([], {}, "empty batch"),
        ([[1, 2], []], {}, "prompt 1"),
        ([[1, 16]], {}, r"prompt 0.*token 16.*vocabulary"),
        ([[1] * 30], {"max_tokens": 4}, "max_seq_len"),
        ([[1]], {"temperature": -1.0}, "temperature"),
        ([[1]], {"temperature": float("nan")}, "temperature"),
        ([[1]], {"num_samples": 0}, "num_samples"),
        ([[1]], {"max_tokens": 0}, "max_tokens"),
        ([[1]], {"stop_token_ids": [V]}, "stop token"),
        ([[1.5]], {}, "integers"),
    ],
)
def test_sample_rejects_bad_input(trainer, prompts, kwargs, match):
    kwargs = {"num_samples": 1, "max_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        trainer.sample(prompts, **kwargs)


def test_float64_needs_x64():
    code = textwrap.dedent(
        """
        import pytest
        from runner.local import LocalTrainer, LocalTrainerConfig
        with pytest.raises(ValueError, match="jax_enable_x64"):
            LocalTrainer(LocalTrainerConfig(d_model=16, n_layers=1, dtype="float64"))
        """
    )
    env = dict(os.environ, JAX_ENABLE_X64="0", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# -- data parallel ------------------------------------------------------------------------------

_DP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    import numpy as np
    from tests.test_local_trainer import CFG, dp_workload
    from runner.local import LocalTrainer
    tr = LocalTrainer(CFG)
    assert tr.num_devices == jax.device_count() == 2, jax.devices()
    out = dp_workload(tr)
    np.savez(sys.argv[1], **out)
    """
)


def dp_workload(tr: LocalTrainer) -> dict[str, np.ndarray]:
    """Forward, a PPO forward_backward and a step, and a sample; flattened to arrays."""
    rng = np.random.default_rng(9)
    seqs = rand_seqs(rng, [5, 17, 9], "ppo")  # 3 rows: padded to 8, split 4+4 on 2 devices
    out = {f"lp{i}": x for i, x in enumerate(tr.forward(seqs))}
    res = tr.forward_backward(seqs, "ppo")
    out["loss"] = np.asarray(res.metrics["loss:sum"])
    for k, g in _np_tree(tr.accumulated_grads()).items():
        out[f"grad.{k}"] = g
    batch_sharding = tr._put_rows(np.zeros((8, 4))).sharding
    out["n_shards"] = np.asarray(len(batch_sharding.device_set))
    tr.optim_step(AdamParams(learning_rate=1e-2), "num_loss_tokens")
    for k, p in _np_tree(tr.params).items():
        out[f"param.{k}"] = p
    samples = tr.sample(PROMPTS, num_samples=2, max_tokens=6, seed=4)
    out["sample"] = np.concatenate([s.tokens for row in samples for s in row])
    return out


def test_data_parallel_two_devices_match_one(tmp_path):
    path = tmp_path / "dp.npz"
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    subprocess.run(
        [sys.executable, "-c", _DP_SCRIPT, str(path)], check=True, env=env, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    two = dict(np.load(path))
    one = dp_workload(make_trainer())
    assert int(two.pop("n_shards")) == 2
    one.pop("n_shards")
    assert set(one) == set(two)
    for key in one:
        if key == "sample":
            np.testing.assert_array_equal(one[key], two[key])
        elif key.startswith("lp"):  # float32 outputs of float64 values
            np.testing.assert_allclose(one[key], two[key], rtol=1e-6, err_msg=key)
        else:
            np.testing.assert_allclose(one[key], two[key], rtol=1e-9, atol=1e-12, err_msg=key)


def test_set_params():
    a, b = make_trainer(), make_trainer(seed=1)
    s = rand_seqs(np.random.default_rng(10), [6, 9])
    b.forward_backward(s, "cross_entropy")
    b.set_params(jax.device_get(a.params))
    assert b.accumulated_grads() is None
    for x, y in zip(a.forward(s), b.forward(s), strict=True):
        np.testing.assert_array_equal(x, y)
    bad = jax.device_get(a.params)
    bad["embed"] = bad["embed"][:-1]
    with pytest.raises(ValueError, match="'embed' has shape"):
        b.set_params(bad)
    with pytest.raises(ValueError, match="structure"):
        b.set_params({"embed": bad["embed"]})
    wrong_dtype = jax.tree.map(lambda x: x.astype(np.float16), jax.device_get(a.params))
    with pytest.raises(ValueError, match="dtype float16"):
        b.set_params(wrong_dtype)


def test_set_params_takes_jax_arrays_without_deprecation_warnings():
    a, b = make_trainer(), make_trainer(seed=1)
    s = rand_seqs(np.random.default_rng(11), [5, 7])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        b.set_params(a.params)  # jax arrays, as the Fireworks stand-in passes them
    for x, y in zip(a.forward(s), b.forward(s), strict=True):
        np.testing.assert_array_equal(x, y)
