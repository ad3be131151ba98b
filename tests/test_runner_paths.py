"""On the local model, every way of running fold(grpo, echo_env) gives the same parameter gradient.

Paths: direct ``jax.grad`` through the model; the fused client pass; the fused pass with a
precomputed forward; builtin ``ppo`` plus a separate accumulated ``cross_entropy`` pass with the
ECHO weights (two-pass); micro-batched accumulation. float64: ≤ 1e-10 relative; float32: ≤ 1e-5.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses
from runner import Seq, StepRunner
from runner.local import LocalTrainer, LocalTrainerConfig
from tests.helpers import multi_turn_seqs

VOCAB = 24


@functools.cache
def _trainer_config(dtype: str) -> LocalTrainerConfig:
    return LocalTrainerConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        max_seq_len=64,
        seed=3,
        dtype=dtype,
    )


def make_trainer(dtype: str) -> LocalTrainer:
    return LocalTrainer(_trainer_config(dtype))


def make_seqs(trainer: LocalTrainer, seed: int = 0, n: int = 6) -> list[Seq]:
    """Prompt / action / observation turns with sampling logprobs near the current policy."""
    return multi_turn_seqs(
        trainer,
        np.random.default_rng(seed),
        n=n,
        vocab=VOCAB,
        lengths=(14, 40),
        obs_max=5,
        with_ref=True,
    )


def direct_grad(trainer: LocalTrainer, term, seqs, dtype):
    """jax.grad of the term through the model, without the runner."""
    rows = len(seqs)
    width = max(s.tokens.shape[0] for s in seqs)
    tokens = np.zeros((rows, width), np.int64)
    lengths = np.array([s.tokens.shape[0] for s in seqs])
    for i, s in enumerate(seqs):
        tokens[i, : s.tokens.shape[0]] = s.tokens
    fields = {}
    for name in ("action_mask", "obs_mask", "advantages", "sampling_logprobs", "ref_logprobs"):
        arr = np.zeros((rows, width - 1), dtype)
        for i, s in enumerate(seqs):
            arr[i, : s.num_targets] = s.inputs[name]
        fields[name] = arr
    batch = losses.Batch(**fields)

    @jax.jit
    def value_and_grad(params, tokens, lengths, batch):
        return jax.value_and_grad(
            lambda p: term(trainer.token_logprobs(p, tokens, lengths), batch)[0]
        )(params)

    return value_and_grad(trainer.params, tokens, lengths, batch)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


TERMS = {
    "grpo+echo": losses.fold(losses.grpo(clip_high=0.28), losses.echo_env(coef=0.05)),
    "grpo_kl+echo": losses.fold(
        losses.grpo(kl_coef=0.05, reduction="seq_mean_token_mean"), losses.echo_env(coef=0.5)
    ),
}


def _paths(dtype: str, term_name: str):
    term = TERMS[term_name]
    np_dtype = np.float64 if dtype == "float64" else np.float32
    out = {}
    trainer = make_trainer(dtype)
    seqs = make_seqs(trainer)
    value, g = direct_grad(trainer, term, seqs, np_dtype)
    out["direct"] = (_flat(g), float(value), None)

    def run(mode, **kw):
        t = make_trainer(dtype)
        runner = StepRunner(term, mode=mode, dtype=np_dtype)
        if kw.pop("precompute", False):
            kw["forward"] = t.forward([s.with_inputs() for s in seqs])
        m = runner.accumulate(t, seqs, **kw)
        return _flat(t.accumulated_grads()), m["loss"], m

    out["client"] = run("client")
    out["client_precomputed"] = run("client", precompute=True)
    out["client_microbatched"] = run("client", num_microbatches=3)
    if term_name == "grpo+echo":
        out["two_pass"] = run("two_pass")
        out["two_pass_microbatched"] = run("two_pass", num_microbatches=2)
    return out


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-10), ("float32", 1e-5)])
@pytest.mark.parametrize("term_name", list(TERMS))
def test_every_path_gives_the_direct_gradient(dtype, tol, term_name):
    paths = _paths(dtype, term_name)
    g_direct, v_direct, _ = paths.pop("direct")
    assert np.max(np.abs(g_direct)) > 0
    for name, (g, value, _metrics) in paths.items():
        assert _rel(g, g_direct) <= tol, (name, _rel(g, g_direct))
        assert value == pytest.approx(v_direct, rel=max(tol, 1e-6), abs=1e-7), name
    # Pass counts per path (forwards, backwards) as the step reports them.
    expected = {
        "client": (2, 1),
        "client_precomputed": (1, 1),
        "client_microbatched": (6, 3),
        "two_pass": (2, 2),
        "two_pass_microbatched": (4, 4),
    }
    for name, (_, _, metrics) in paths.items():
        assert (metrics["passes/forwards"], metrics["passes/backwards"]) == expected[name], name


def test_builtin_path_for_policy_only_grpo_matches_direct_gradient():
    term = losses.grpo(clip_low=0.2, clip_high=0.28, reduction="seq_mean_token_mean")
    trainer = make_trainer("float64")
    seqs = make_seqs(trainer, seed=5)
    value, g = direct_grad(trainer, term, seqs, np.float64)
    runner = StepRunner(term, dtype=np.float64)
    assert runner.plan(trainer).path == "builtin" and runner.plan(trainer).kernel == "ppo"
    m = runner.accumulate(trainer, seqs)
    assert _rel(_flat(trainer.accumulated_grads()), _flat(g)) <= 1e-10
    assert (m["passes/forwards"], m["passes/backwards"]) == (1, 1)
    assert m["loss"] == pytest.approx(float(value), rel=1e-10)
    assert m["server_loss"] == pytest.approx(float(value), rel=1e-10)


def test_zero_coef_echo_plans_the_builtin_kernel():
    trainer = make_trainer("float32")
    term = losses.fold(losses.grpo(), losses.echo_env(coef=0.0))
    assert StepRunner(term).plan(trainer).path == "builtin"
    assert StepRunner(losses.fold(losses.grpo(), losses.echo_env())).plan(trainer).path == "client"
    assert StepRunner(losses.grpo(kl_coef=0.1)).plan(trainer).path == "client"


def test_fifty_random_length_steps_compile_once_per_bucket():
    trainer = make_trainer("float32")
    runner = StepRunner(TERMS["grpo+echo"], length_buckets=(16, 32, 64))
    rng = np.random.default_rng(7)
    shapes = set()
    for step in range(50):
        seqs = make_seqs(trainer, seed=100 + step, n=int(rng.integers(3, 9)))
        shapes.add(runner.client.shapes(seqs))
        runner.accumulate(trainer, seqs)
        trainer.reset_grads()
    assert runner.client.compile_count == len(shapes) <= 2 * 2  # rows {4, 8} x lengths {32, 64}


def test_float64_path_gradient_helper_is_not_vacuous():
    # The float64 comparison above would pass trivially if both sides were zero or identical by
    # construction; perturbing the ECHO coefficient must change the fused gradient.
    trainer = make_trainer("float64")
    seqs = make_seqs(trainer, seed=9)
    g1 = direct_grad(trainer, TERMS["grpo+echo"], seqs, np.float64)[1]
    other = losses.fold(losses.grpo(clip_high=0.28), losses.echo_env(coef=0.06))
    g2 = direct_grad(trainer, other, seqs, np.float64)[1]
    assert _rel(_flat(g2), _flat(g1)) > 1e-6
    assert jnp.asarray(_flat(g1)).dtype == jnp.float64
