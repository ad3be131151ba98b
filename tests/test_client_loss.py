"""Client-loss adapter and step planning on a tiny bigram trainer (fast, float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses
from runner import AdamParams, Seq
from runner._client_loss import ClientLoss
from runner._padding import normalizers
from runner._step import StepRunner, plan_step
from tests.fakes import BigramTrainer


def make_seqs(rng, n=6, vocab=8, lengths=(5, 12), with_ref=True):
    seqs = []
    for _ in range(n):
        length = int(rng.integers(*lengths))
        tokens = rng.integers(0, vocab, length)
        t = length - 1
        kind = rng.integers(0, 3, t)  # 0 prompt/pad-like, 1 action, 2 observation
        kind[: min(2, t)] = 0
        action = (kind == 1).astype(float)
        obs = (kind == 2).astype(float)
        sampling = np.where(action > 0, -rng.uniform(0.1, 3.0, t), 0.0)
        inputs = dict(
            action_mask=action,
            obs_mask=obs,
            advantages=np.full(t, rng.normal()) * (action > 0),
            sampling_logprobs=sampling,
        )
        if with_ref:
            inputs["ref_logprobs"] = np.where(action > 0, sampling - 0.2, 0.0)
        seqs.append(Seq(tokens.astype(np.int64), inputs))
    return seqs


def direct_grad(trainer, term, seqs):
    """jax.grad of the term through the model, with no adapter in between."""
    client = ClientLoss(term, dtype=np.float64)
    batch = client.batch(seqs)
    rows, length = batch.shape

    def loss(params):
        lp = jnp.zeros((rows, length), params.dtype)
        for i, s in enumerate(seqs):
            lp = lp.at[i, : s.num_targets].set(
                trainer.token_logprobs(params, jnp.asarray(s.tokens))
            )
        return term(lp, batch)[0]

    return jax.value_and_grad(loss)(trainer.params)


SFT = losses.sft_cross_entropy()
FOLD_KL = losses.fold(losses.grpo(kl_coef=0.1, clip_high=0.28), losses.echo_env(coef=0.05))


@pytest.mark.parametrize(
    "term",
    [
        FOLD_KL,
        losses.fold(losses.grpo(reduction="seq_mean_token_mean"), losses.echo_env(coef=0.5)),
        SFT,
    ],
)
def test_fused_client_pass_equals_direct_gradient(term):
    rng = np.random.default_rng(0)
    seqs = make_seqs(rng)
    trainer = BigramTrainer()
    value_direct, g_direct = direct_grad(trainer, term, seqs)
    value, metrics = ClientLoss(term, dtype=np.float64)(trainer, seqs)
    np.testing.assert_allclose(
        np.asarray(trainer.grad), np.asarray(g_direct), rtol=1e-10, atol=1e-13
    )
    assert value == pytest.approx(float(value_direct), rel=1e-12)
    assert metrics["loss"] == pytest.approx(value, rel=1e-12)
    if term is not SFT:  # for a loss linear in logp the surrogate Σ -g·p equals the loss itself
        assert metrics["surrogate_loss"] != pytest.approx(value)  # never reported as the loss
    # One forward with tokens only, then one linear CE pass carrying only weights.
    assert trainer.calls[0] == ("forward", len(seqs), ())
    assert trainer.calls[1][:2] == ("forward_backward", "cross_entropy")


def test_precomputed_forward_skips_the_forward_pass():
    rng = np.random.default_rng(1)
    seqs = make_seqs(rng)
    t1, t2 = BigramTrainer(), BigramTrainer()
    runner = StepRunner(FOLD_KL, dtype=np.float64)
    m1 = runner.accumulate(t1, seqs)
    fwd = t2.forward([s.with_inputs() for s in seqs])
    t2.counters = {"forward": 0, "backward": 0, "optim_step": 0}
    m2 = runner.accumulate(t2, seqs, forward=fwd)
    np.testing.assert_array_equal(np.asarray(t1.grad), np.asarray(t2.grad))
    assert (m1["passes/forwards"], m1["passes/backwards"]) == (2, 1)
    assert (m2["passes/forwards"], m2["passes/backwards"]) == (1, 1)
    assert t2.counters["forward"] == 1 and t2.counters["backward"] == 1
    assert m1["loss"] == m2["loss"]


@pytest.mark.parametrize("k", [2, 3, 6])
def test_microbatched_accumulation_equals_one_pass(k):
    rng = np.random.default_rng(2)
    seqs = make_seqs(rng)
    t1, tk = BigramTrainer(), BigramTrainer()
    runner = StepRunner(FOLD_KL, dtype=np.float64)
    m1 = runner.accumulate(t1, seqs)
    mk = runner.accumulate(tk, seqs, num_microbatches=k)
    np.testing.assert_allclose(np.asarray(tk.grad), np.asarray(t1.grad), rtol=1e-10, atol=1e-13)
    assert mk["loss"] == pytest.approx(m1["loss"], rel=1e-10)
    assert mk["passes/backwards"] == k and mk["passes/forwards"] == 2 * k


def test_compiles_once_per_bucket_not_per_step():
    rng = np.random.default_rng(3)
    trainer = BigramTrainer()
    runner = StepRunner(FOLD_KL, dtype=np.float64, length_buckets=(8, 16, 32))
    shapes = set()
    for _ in range(50):
        n = int(rng.integers(2, 9))
        seqs = make_seqs(rng, n=n, lengths=(3, 30))
        shapes.add(runner.client.shapes(seqs))
        runner.step(trainer, seqs, AdamParams(learning_rate=1e-3))
    assert runner.client.compile_count == len(shapes)
    assert len(shapes) <= 4 * 3  # row buckets {2,4,8} x length buckets {8,16,32}, at most


def test_plan_choices():
    supported = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
    assert plan_step(FOLD_KL, supported=supported).path == "client"
    assert plan_step(losses.grpo(kl_coef=0.1), supported=supported).path == "client"
    assert plan_step(losses.sft_cross_entropy(), supported=supported).path == "client"
    assert plan_step(losses.grpo(), supported=supported, mode="client").path == "client"
    with pytest.raises(ValueError, match="unknown step mode"):
        plan_step(losses.grpo(), supported=supported, mode="fast")
    with pytest.raises(ValueError, match="builtin path requested"):
        plan_step(FOLD_KL, supported=supported, mode="builtin")
    with pytest.raises(ValueError, match="two_pass needs exactly one policy term"):
        plan_step(
            losses.fold(losses.grpo(kl_coef=0.1), losses.echo_env()),
            supported=supported,
            mode="two_pass",
        )


def test_normalizers_count_rows_with_actions_or_observations():
    seqs = [
        Seq(np.arange(4), dict(action_mask=np.array([0.0, 1, 1]), obs_mask=np.zeros(3))),
        Seq(np.arange(4), dict(action_mask=np.zeros(3), obs_mask=np.array([1.0, 0, 0]))),
        Seq(np.arange(4), dict(action_mask=np.zeros(3), obs_mask=np.zeros(3))),
    ]
    assert normalizers(seqs) == {"num_rows": 2, "num_action_tokens": 2.0, "num_obs_tokens": 1.0}


def test_adapter_errors_name_sequence_and_field():
    trainer = BigramTrainer()
    client = ClientLoss(FOLD_KL)
    seqs = make_seqs(np.random.default_rng(4), n=2)
    with pytest.raises(ValueError, match="empty batch"):
        client(trainer, [])
    bad = [
        seqs[0],
        Seq(seqs[1].tokens, {k: v for k, v in seqs[1].inputs.items() if k != "action_mask"}),
    ]
    with pytest.raises(ValueError, match="sequence 1: missing required field 'action_mask'"):
        client(trainer, bad)
    short = [seqs[0], Seq(seqs[1].tokens, dict(seqs[1].inputs, obs_mask=np.zeros(2)))]
    with pytest.raises(ValueError, match=r"sequence 1: field 'obs_mask' has shape \(2,\)"):
        client(trainer, short)
    nan = [
        Seq(seqs[0].tokens, dict(seqs[0].inputs, advantages=np.full(seqs[0].num_targets, np.nan)))
    ]
    with pytest.raises(ValueError, match="sequence 0: field 'advantages' has a non-finite value"):
        client(trainer, nan)
    with pytest.raises(ValueError, match="precomputed forward has 1 entries for 2 sequences"):
        client(trainer, seqs, forward=[np.zeros(3)])
    with pytest.raises(ValueError, match=r"sequence 0: logprobs have shape \(3,\)"):
        client(trainer, seqs, forward=[np.zeros(3), np.zeros(3)])
    partial = [
        seqs[0],
        Seq(seqs[1].tokens, {k: v for k, v in seqs[1].inputs.items() if k != "ref_logprobs"}),
    ]
    with pytest.raises(ValueError, match="sequence 1: missing field 'ref_logprobs'"):
        client(trainer, partial)
    with pytest.raises(ValueError, match="term must be callable"):
        ClientLoss(3)


def test_value_and_weights_rejects_what_check_batch_rejects():
    """``ClientLoss`` on ``action_mask=[0, .5, 1, 0]`` returned 0.029; every value rule of
    `losses.check_batch` now holds inside the jitted call, and the error names the entry."""
    client = ClientLoss(losses.grpo())
    tokens = np.arange(5)
    good = dict(
        action_mask=np.array([0.0, 1, 1, 0]),
        advantages=np.array([0.0, 1, 1, 0]),
        sampling_logprobs=np.array([0.0, -0.5, -1, 0]),
    )
    lp = [np.array([-1.0, -0.4, -1.2, -2.0], np.float32)]
    value, _, _ = client.value_and_weights(lp, [Seq(tokens, good)])
    assert np.isfinite(value)
    cases = [
        (
            dict(action_mask=np.array([0.0, 0.5, 1, 0])),
            r"action_mask\[sequence 0, target 1\] = 0.5",
        ),
        (dict(obs_mask=np.array([0.0, 1, 0, 0])), "overlap at sequence 0, target 1"),
        (
            dict(sampling_logprobs=np.array([0.0, 0.2, -1, 0])),
            r"sampling_logprobs\[sequence 0, target 1\] = 0.2 > 0",
        ),
        (
            dict(advantages=np.array([0.0, 1e39, 1, 0])),
            r"advantages\[sequence 0, target 1\] = 1e\+39: advantages overflows float32",
        ),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            client.value_and_weights(lp, [Seq(tokens, dict(good, **change))])
    with pytest.raises(ValueError, match=r"logprobs\[sequence 0, target 2\] = 0.7 > 0"):
        client.value_and_weights(
            [np.array([-1.0, -0.4, 0.7, -2.0], np.float32)], [Seq(tokens, good)]
        )
    with pytest.raises(ValueError, match="num_rows = -1.0: normalizers"):
        client.value_and_weights(
            lp,
            [Seq(tokens, good)],
            {"num_rows": -1.0, "num_action_tokens": 2.0, "num_obs_tokens": 0.0},
        )


def test_terms_over_values_or_top_k_logprobs_are_refused_by_the_client_loss():
    for term in (losses.value_loss(), losses.fold(losses.value_loss())):
        with pytest.raises(ValueError, match="takes values as its first argument"):
            ClientLoss(term)


def test_a_misspelt_seq_field_is_refused_not_a_silent_zero_term():
    """Issue #23 item 6: ``make_seq(..., obs_masks=om)`` gave ``echo_env/num_obs_tokens 0``."""

    import runner
    from runner._types import SEQ_FIELDS

    toks, n = [1, 2, 3, 4, 5], 4
    act = np.array([0, 1, 1, 0], np.float32)
    obs = np.array([0, 0, 0, 1], np.float32)
    with pytest.raises(losses.UnknownFieldError, match="'obs_masks'; did you mean 'obs_mask'"):
        runner.make_seq(toks, action_mask=act, obs_masks=obs, sampling_logprobs=-np.ones(n))
    with pytest.raises(ValueError, match="sequence 3: unknown field 'Advantages'"):
        runner.make_seq(toks, 3, action_mask=act, Advantages=np.ones(n))
    # One list: every Batch data field and every kernel datum input is accepted.
    assert set(losses.DATA_FIELDS) <= set(SEQ_FIELDS)
    seq = runner.make_seq(toks, **{f: np.zeros(n) for f in SEQ_FIELDS})
    assert set(seq.inputs) == set(SEQ_FIELDS)
