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
from benchmarks.synthetic import multi_turn_seqs
from runner import Seq, StepRunner
from runner.local import LocalTrainer, LocalTrainerConfig

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
    seqs, _ = multi_turn_seqs(
        np.random.default_rng(seed),
        n,
        lengths=(14, 40),
        obs_turn=(1, 5),
        gap=1,  # one wrapper token after each observation
        vocab=VOCAB,
        trainer=trainer,
        with_ref=True,
    )
    return seqs


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


# -- one boundary per step: the same value rules on every path, validated once -------------------

from runner import ClientLoss  # noqa: E402
from runner._types import VALIDATIONS  # noqa: E402

GRPO = losses.grpo(clip_low=0.2, clip_high=0.28)
FOLD = losses.fold(GRPO, losses.echo_env(coef=0.05))
#: (path, mode, term) of every step path; "direct" is ClientLoss called by the user.
PATHS = [
    ("client", "client", FOLD),
    ("builtin", "auto", GRPO),
    ("two_pass", "two_pass", FOLD),
    ("direct", None, FOLD),
]


def _run(path, mode, term, trainer, seqs):
    if mode is None:
        return ClientLoss(term)(trainer, seqs)
    metrics = StepRunner(term, mode=mode).accumulate(trainer, seqs)
    assert metrics[f"plan/{path}"] == 1.0
    return metrics


def _edit(seqs, i, **fields):
    out = list(seqs)
    out[i] = Seq(seqs[i].tokens, dict(seqs[i].inputs, **fields))
    return out


def _bad_cases(seqs):
    s = seqs[1]
    a = np.asarray(s.inputs["action_mask"])
    o = np.asarray(s.inputs["obs_mask"])
    t_act = int(np.flatnonzero(a)[0])
    t_obs = int(np.flatnonzero(o)[0])
    half = a.copy()
    half[t_act] = 0.5
    two = o.copy()
    two[t_obs] = 2.0
    overlap = o.copy()
    overlap[t_act] = 1.0
    positive = np.asarray(s.inputs["sampling_logprobs"]).copy()
    positive[t_act] = 0.3
    huge = np.asarray(s.inputs["advantages"]).copy()
    huge[t_act] = 1e39
    yield (
        "half mask",
        _edit(seqs, 1, action_mask=half),
        rf"action_mask\[sequence 1, target {t_act}\] = 0.5: masks must hold only 0 or 1",
    )
    yield (
        "mask of 2",
        _edit(seqs, 1, obs_mask=two),
        rf"obs_mask\[sequence 1, target {t_obs}\] = 2: masks",
    )
    yield "overlap", _edit(seqs, 1, obs_mask=overlap), rf"overlap at sequence 1, target {t_act}"
    yield (
        "positive logprob",
        _edit(seqs, 1, sampling_logprobs=positive),
        rf"sampling_logprobs\[sequence 1, target {t_act}\] = 0.3 > 0",
    )
    yield (
        "float32 overflow",
        _edit(seqs, 1, advantages=huge),
        rf"sequence 1: field 'advantages' value 1e\+39 at target {t_act} overflows float32",
    )


@pytest.mark.parametrize("path, mode, term", PATHS, ids=[p for p, _, _ in PATHS])
def test_every_path_rejects_the_values_check_batch_rejects(path, mode, term):
    """Masks of 0.5 or 2, overlapping masks, positive sampling logprobs and values that overflow
    float32 were computed silently by the fused path; now every path stops before the trainer
    accumulates anything, naming sequence, target and rule."""
    trainer = make_trainer("float32")
    seqs = make_seqs(trainer, seed=5)
    for label, bad, message in _bad_cases(seqs):
        with pytest.raises(ValueError, match=message):
            _run(path, mode, term, trainer, bad)
        assert trainer.accumulated_grads() is None, label
    _run(path, mode, term, trainer, seqs)  # the good batch runs
    assert trainer.accumulated_grads() is not None


def test_direct_trainer_calls_reject_values_that_overflow_float32():
    """Weights or advantages of 1e39 (finite in float64) became inf in the float32 cast and one
    optim_step made every parameter NaN, even with grad_clip_norm=1."""
    trainer = make_trainer("float32")
    seq = Seq(np.arange(6) % VOCAB, dict(weights=np.array([0.0, 1e39, 0, 0, 0])))
    with pytest.raises(
        ValueError, match="field 'weights' value 1e\\+39 at target 1 overflows float32"
    ):
        trainer.forward_backward([seq], "cross_entropy")
    rl = Seq(
        np.arange(6), dict(logprobs=np.full(5, -1.0), advantages=np.array([0, 0, -1e39, 0, 0]))
    )
    with pytest.raises(ValueError, match="field 'advantages' value -1e\\+39 at target 2 overflows"):
        trainer.forward_backward([rl], "importance_sampling")
    assert trainer.accumulated_grads() is None


@pytest.mark.parametrize("path, mode, term", PATHS[:3], ids=[p for p, _, _ in PATHS[:3]])
def test_one_validation_per_step_on_the_runner_path(path, mode, term):
    trainer = make_trainer("float32")
    seqs = make_seqs(trainer, seed=6)
    runner = StepRunner(term, mode=mode)
    adam = __import__("runner").AdamParams(learning_rate=1e-3)
    runner.step(trainer, seqs, adam)  # compile outside the count
    before = VALIDATIONS["validate_seqs"]
    for _ in range(3):
        runner.step(trainer, seqs, adam)
    assert VALIDATIONS["validate_seqs"] - before == 3
    before = VALIDATIONS["validate_seqs"]
    runner.step(trainer, seqs, adam, num_microbatches=3)
    assert VALIDATIONS["validate_seqs"] - before == 1
    # A direct trainer call validates its own input (once).
    before = VALIDATIONS["validate_seqs"]
    trainer.forward([s.with_inputs() for s in seqs])
    assert VALIDATIONS["validate_seqs"] - before == 1


def test_float16_masks_give_the_float64_loss_on_the_client_path():
    trainer = make_trainer("float32")
    seqs = make_seqs(trainer, seed=7)
    half = [
        Seq(
            s.tokens,
            {k: (v.astype(np.float16) if k.endswith("_mask") else v) for k, v in s.inputs.items()},
        )
        for s in seqs
    ]
    lps = trainer.forward([s.with_inputs() for s in seqs])
    client = ClientLoss(FOLD)
    v64, m64, w64 = client.value_and_weights(lps, seqs)
    v16, m16, w16 = client.value_and_weights(lps, half)
    assert v16 == v64 and m16 == m64
    for a, b in zip(w64, w16, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "key, how",
    [
        ("loss", "sum"),
        ("grpo/loss", "sum"),
        ("echo_env/num_obs_tokens", "sum"),
        ("weight_sum", "sum"),
        ("rows_valid", "sum"),
        ("grpo/ratio_max", "max"),
        ("grpo/clip_frac_high", "mean"),
        ("echo_env/nll", "mean"),
    ],
)
def test_one_rule_says_how_a_metric_combines(key, how):
    """The step runner's micro-batch merge and the local kernels' ``name:reduction`` keys read
    one rule (`runner._metrics.reduction`); they were two, a suffix guess and a table."""
    from runner._metrics import reduction
    from runner._step import _combine
    from runner.local.kernels import server_metrics

    assert reduction(key) == how
    assert server_metrics({key: 1.0}) == {f"{key}:{how}": 1.0}
    merged = _combine([{key: 1.0}, {key: 3.0}], [1, 3])[key]
    assert merged == {"sum": 4.0, "max": 3.0, "mean": 2.5}[how]
