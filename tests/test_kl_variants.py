"""KL variants (docs/sources.md#kl-variants): the §2.3 per-token golden table, the §2.1
exact-enumeration test (which estimator descends which divergence), the importance-weight and
score-function keywords of `grpo` / `reinforce`, the standalone `losses.kl_loss`, and the
sampler-KL forms of prime-rl and rllm.

The generic properties of `kl_loss` (NumPy reference, NaN safety, split_batch, permutation,
padding, jit, vmap) run over the ``kl*`` cases of tests/cases.py in tests/test_term_properties.py.
"""

from __future__ import annotations

import inspect
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses
from tests import numpy_ref_policy as ref
from tests.cases import CASES, over

KL_CASES = [c for c in CASES if c.group == "kl"]


def assert_golden(actual, golden):
    """Equal to the reference's 5-significant-digit (or 5-decimal) rounding."""
    np.testing.assert_allclose(actual, golden, rtol=2e-5, atol=6e-6)


def kl_grad(term, lp, batch):
    """(per-token values via token_sum, gradient) of a KL term."""
    value, grad = jax.value_and_grad(lambda x: term(x, batch)[0])(jnp.asarray(lp))
    return float(value), np.asarray(grad)


# -- 1. the §2.3 worked example -------------------------------------------------------------------

LP = np.log([[0.5, 0.2]])
REF = np.log([[0.4, 0.4]])
ROLL = np.log([[0.4, 0.25]])  # old = roll
EXAMPLE = losses.Batch(
    action_mask=np.ones((1, 2)),
    advantages=np.zeros(1),
    sampling_logprobs=ROLL,
    ref_logprobs=REF,
)

#: (kl_loss keywords, value per token, ∂/∂lp per token) from the §2.3 table.
TABLE = [
    (dict(estimator="k1"), [0.22314, -0.69315], [1.0, 1.0]),
    (dict(estimator="k2"), [0.02490, 0.24023], [0.22314, -0.69315]),
    (dict(estimator="k3"), [0.02314, 0.30685], [0.2, -1.0]),
    # TRL use_bias_correction_kl / slime --use-unbiased-kl with k3 (DeepSeek-V3.2).
    (dict(estimator="k3", importance_weight=True), [0.02893, 0.24548], [0.27893, -0.55452]),
    # verl k3+: value k3, straight-through gradient δ.
    (dict(estimator="k3", score_function=True), [0.02314, 0.30685], [0.22314, -0.69315]),
    # slime r·k1.
    (dict(estimator="k1", importance_weight=True), [0.27893, -0.55452], [1.52893, 0.24548]),
    # prime-rl (log r)² (× kl_tau = 1) toward the sampler.
    (
        dict(estimator="sq_log_ratio", target="sampling_logprobs"),
        [0.04979, 0.04979],
        [0.44629, -0.44629],
    ),
    # rllm kl_approx=True: backward, forward.
    (dict(estimator="rllm_bwd", target="sampling_logprobs"), [0.02686, 0.02314], [0.25, -0.2]),
    (
        dict(estimator="rllm_fwd", target="sampling_logprobs"),
        [0.02893, 0.02149],
        [0.27893, -0.17851],
    ),
]


def _per_token(term_kwargs):
    """Values and gradients token by token (one-token masks), via `kl_loss` with token_sum."""
    term = losses.kl_loss(reduction="token_sum", **term_kwargs)
    values, grads = [], []
    for t in range(2):
        mask = np.zeros((1, 2))
        mask[0, t] = 1.0
        v, g = kl_grad(term, LP, EXAMPLE.replace(action_mask=mask))
        values.append(v)
        grads.append(g[0, t])
    return values, grads


@pytest.mark.parametrize("kwargs, values, grads", TABLE, ids=[json.dumps(k) for k, _, _ in TABLE])
def test_section_2_3_table(kwargs, values, grads):
    v, g = _per_token(kwargs)
    assert_golden(v, values)
    assert_golden(g, grads)


def test_section_2_3_openrlhf_1309_gradient_for_every_estimator():
    # OpenRLHF PR #1309: k1, k2, k3 share the gradient sg(r)·δ; the value is r·k here (theirs: k).
    for est in losses.KL_ESTIMATORS:
        v, g = _per_token(dict(estimator=est, score_function=True, importance_weight=True))
        assert_golden(g, [0.27893, -0.55452])
        k, _ = _per_token(dict(estimator=est))
        np.testing.assert_allclose(v, np.array(k) * [1.25, 0.8], rtol=1e-12)


def test_rllm_score_function_backward_form():
    # rllm kl_approx=False: KL_bwd has gradient -1 (its value is -lp in rllm; here the KL
    # estimate ρ - 1 - δ, the same as the approx form).
    v, g = _per_token(dict(estimator="rllm_bwd_sf", target="sampling_logprobs"))
    np.testing.assert_array_equal(g, [-1.0, -1.0])
    assert_golden(v, [0.02686, 0.02314])


@pytest.mark.parametrize(
    "estimator, score, iw",
    [(e, s, w) for e in losses.KL_ESTIMATORS for s in (False, True) for w in (False, True)],
)
def test_policy_term_keywords_give_the_same_kl(estimator, score, iw):
    # grpo / reinforce with A = 0 (no policy gradient) give exactly the kl_loss per-token table.
    kw = dict(kl_coef=1.0, kl_estimator=estimator, kl_score_function=score)
    kw["kl_importance_weight"] = iw
    standalone = losses.kl_loss(
        estimator=estimator, score_function=score, importance_weight=iw, reduction="token_sum"
    )
    v0, g0 = kl_grad(standalone, LP, EXAMPLE)
    for term in (
        losses.grpo(reduction="token_sum", **kw),
        losses.reinforce(reduction="token_sum", **kw),
    ):
        v, g = kl_grad(term, LP, EXAMPLE)
        assert v == v0
        np.testing.assert_array_equal(g, g0)
        metrics = term(jnp.asarray(LP), EXAMPLE)[1]
        assert float(metrics["kl"]) == float(standalone(jnp.asarray(LP), EXAMPLE)[1]["kl"])


# -- 2. §2.1 exact enumeration (vocabulary of 3) --------------------------------------------------

P = np.array([0.5, 0.3, 0.2])  # = softmax(z)
Q = np.array([0.2, 0.5, 0.3])  # the reference
MU = np.array([0.4, 0.4, 0.2])  # the sampler


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _kl(a, b):
    return float(np.sum(a * np.log(a / b)))


def _fd_grad(f, z, h=1e-6):
    """Central finite difference of ``f(softmax(z))`` in NumPy."""
    g = np.zeros_like(z)
    for k in range(z.size):
        e = np.zeros_like(z)
        e[k] = h
        g[k] = (f(_softmax(z + e)) - f(_softmax(z - e))) / (2 * h)
    return g


Z = np.log(P)
GRAD_KL_PQ = _fd_grad(lambda p: _kl(p, Q), Z)  # ∇KL(p‖q)
GRAD_KL_QP = _fd_grad(lambda p: _kl(Q, p), Z)  # ∇KL(q‖p) = p - q
GRAD_KL_P_MU = _fd_grad(lambda p: _kl(p, MU), Z)
GRAD_KL_MU_P = _fd_grad(lambda p: _kl(MU, p), Z)


def _enumerate(kwargs, on_policy):
    """(E[value], E[coef(y)·(e_y - p)]) over y ~ p (on-policy: old = p) or y ~ μ (old = μ).

    Row y of the batch is one token y: ``lp = log p_y``, ``ref = log q_y``, ``old = sampling =
    log(p_y or μ_y)``; the term's gradient on row y is coef(y)."""
    dist = P if on_policy else MU
    batch = losses.Batch(
        action_mask=np.ones((3, 1)),
        advantages=np.zeros(3),
        sampling_logprobs=np.log(dist)[:, None],
        ref_logprobs=np.log(Q)[:, None],
    )
    term = losses.kl_loss(reduction="token_sum", **kwargs)
    lp = np.log(P)[:, None]
    values = []
    for y in range(3):
        mask = np.zeros((3, 1))
        mask[y] = 1.0
        values.append(kl_grad(term, lp, batch.replace(action_mask=mask))[0])
    coef = kl_grad(term, lp, batch)[1][:, 0]
    expected = sum(dist[y] * coef[y] * (np.eye(3)[y] - P) for y in range(3))
    return float(np.dot(dist, values)), expected


REVERSE = [0.34624, -0.22039, -0.12585]  # ∇KL(p‖q)
FORWARD = [0.3, -0.2, -0.1]  # ∇KL(q‖p)
ENUMERATION = [
    ("k1 on-policy", dict(estimator="k1"), True, [0.0, 0.0, 0.0]),
    ("k2 on-policy", dict(estimator="k2"), True, REVERSE),
    ("k1 score-function on-policy", dict(estimator="k1", score_function=True), True, REVERSE),
    ("k3+ on-policy", dict(estimator="k3", score_function=True), True, REVERSE),
    (
        "sg(r)·k2",
        dict(estimator="k2", score_function=True, importance_weight=True),
        False,
        REVERSE,
    ),
    (
        "sg(r)·k1 score-function",
        dict(estimator="k1", score_function=True, importance_weight=True),
        False,
        REVERSE,
    ),
    ("r·k3", dict(estimator="k3", importance_weight=True), False, REVERSE),
    ("r·k1", dict(estimator="k1", importance_weight=True), False, REVERSE),
    ("k3 on-policy", dict(estimator="k3"), True, FORWARD),
    ("k2 off-policy, no weight", dict(estimator="k2"), False, [0.32597, -0.22866, -0.09731]),
    (
        "differentiable r·k2",
        dict(estimator="k2", importance_weight=True),
        False,
        [0.42340, -0.26089, -0.16251],
    ),
]


def test_enumeration_divergences_match_the_reference():
    assert _kl(P, Q) == pytest.approx(0.22380, abs=6e-6)
    assert _kl(Q, P) == pytest.approx(0.19379, abs=6e-6)
    assert_golden(GRAD_KL_PQ, REVERSE)
    assert_golden(GRAD_KL_QP, FORWARD)
    np.testing.assert_allclose(GRAD_KL_QP, P - Q, atol=1e-8)


@pytest.mark.parametrize(
    "kwargs, on_policy, golden",
    [e[1:] for e in ENUMERATION],
    ids=[e[0] for e in ENUMERATION],
)
def test_section_2_1_exact_enumeration(kwargs, on_policy, golden):
    _, expected = _enumerate(kwargs, on_policy)
    assert_golden(expected, golden)
    if golden is REVERSE:  # unbiased for the reverse KL: equals the exact NumPy gradient
        np.testing.assert_allclose(expected, GRAD_KL_PQ, atol=1e-8)


def test_section_2_1_importance_weighted_values_are_unbiased():
    # E_μ[r·k3] = E_μ[r·k1] = KL(p‖q) = 0.22380.
    for est in ("k3", "k1"):
        value, _ = _enumerate(dict(estimator=est, importance_weight=True), on_policy=False)
        assert value == pytest.approx(_kl(P, Q), rel=1e-12)
        assert value == pytest.approx(0.22380, abs=6e-6)
    # On-policy k1 and k3 are unbiased value estimates too (but k1's gradient has mean 0).
    for est in ("k1", "k3"):
        assert _enumerate(dict(estimator=est), True)[0] == pytest.approx(_kl(P, Q), rel=1e-12)


@pytest.mark.parametrize("form", ["rllm_bwd", "rllm_bwd_sf", "rllm_fwd", "sq_log_ratio"])
def test_sampler_forms_by_enumeration(form):
    # Target = the sampler μ, tokens y ~ μ (old = sampling = μ): ref_logprobs plays no part.
    batch = losses.Batch(
        action_mask=np.ones((3, 1)),
        advantages=np.zeros(3),
        sampling_logprobs=np.log(MU)[:, None],
    )
    term = losses.kl_loss(estimator=form, target="sampling_logprobs", reduction="token_sum")
    lp = np.log(P)[:, None]
    coef = kl_grad(term, lp, batch)[1][:, 0]
    expected = sum(MU[y] * coef[y] * (np.eye(3)[y] - P) for y in range(3))
    values = [
        kl_grad(term, lp, batch.replace(action_mask=np.eye(3)[:, y : y + 1]))[0] for y in range(3)
    ]
    value = float(np.dot(MU, values))
    if form.startswith("rllm_bwd"):  # rllm "backward": ∇KL(μ‖p) = p - μ; value KL(μ‖p)
        np.testing.assert_allclose(expected, GRAD_KL_MU_P, atol=1e-8)
        np.testing.assert_allclose(expected, P - MU, atol=1e-12)
        assert value == pytest.approx(_kl(MU, P), rel=1e-12)
    elif form == "rllm_fwd":  # rllm "forward" = KL(p‖μ), the LLM papers' *reverse* KL
        np.testing.assert_allclose(expected, GRAD_KL_P_MU, atol=1e-8)
        assert not np.allclose(expected, GRAD_KL_MU_P, atol=1e-3)  # the naming trap
        assert value == pytest.approx(_kl(P, MU), rel=1e-12)
    else:  # prime-rl: 2·E_μ[log(p/μ)·(e_y - p)], a trust region, not a KL gradient
        direct = sum(MU[y] * 2 * math.log(P[y] / MU[y]) * (np.eye(3)[y] - P) for y in range(3))
        np.testing.assert_allclose(expected, direct, atol=1e-12)
        assert not np.allclose(expected, GRAD_KL_P_MU, atol=1e-3)
        assert value == pytest.approx(float(np.dot(MU, np.log(P / MU) ** 2)), rel=1e-12)


# -- 3. peer regressions --------------------------------------------------------------------------


def test_importance_weight_is_differentiable_even_on_policy():
    # TRL PR #6503 thread: ~21% gradient change even on-policy, because the ratio is
    # differentiable where its value is 1: ∂(r·k3)/∂p = r·δ = δ, not k3' = 1 - e^{-δ}.
    batch = EXAMPLE.replace(old_logprobs=LP, sampling_logprobs=LP)  # r ≡ 1
    delta = (LP - REF)[0]
    _, g_iw = kl_grad(losses.kl_loss(estimator="k3", importance_weight=True), LP, batch)
    _, g = kl_grad(losses.kl_loss(estimator="k3"), LP, batch)
    np.testing.assert_allclose(g_iw[0], delta / 2, rtol=1e-12)  # token_mean over 2 tokens
    np.testing.assert_allclose(g[0], (1 - np.exp(-delta)) / 2, rtol=1e-12)
    assert np.all(np.abs(g_iw - g) > 0.01)


def test_detaching_the_weight_would_bring_back_the_forward_kl_bias():
    # §2.1: sg(r)·k3 descends ∇KL(q‖p); the differentiable r·k3 descends ∇KL(p‖q).
    _, unbiased = _enumerate(dict(estimator="k3", importance_weight=True), on_policy=False)
    detached = sum(
        MU[y] * (P[y] / MU[y]) * (1 - Q[y] / P[y]) * (np.eye(3)[y] - P) for y in range(3)
    )
    assert_golden(detached, FORWARD)
    assert np.abs(unbiased - detached).max() > 0.02


def test_k1_as_a_loss_has_a_zero_mean_gradient():
    # docs/sources.md#defects-in-peer-implementations (Tunix's k1 default): on-policy k1 regularises nothing in
    # expectation; the score-function k1 form does.
    _, k1 = _enumerate(dict(estimator="k1"), True)
    _, sf = _enumerate(dict(estimator="k1", score_function=True), True)
    np.testing.assert_allclose(k1, 0.0, atol=1e-15)
    assert np.abs(sf).max() > 0.1


def test_rllm_reinforce_kl_as_a_fold():
    # rllm reinforce_kl: ℓ = -sg(r)·A·lp + bwd·KL_bwd + fwd·KL_fwd, r = exp(clamp(lp - roll)).
    rng = np.random.default_rng(3)
    lp = -rng.uniform(0.1, 3.0, (3, 4))
    roll = lp + rng.normal(0, 0.4, (3, 4))
    adv = rng.normal(size=3)
    batch = losses.Batch(action_mask=np.ones((3, 4)), advantages=adv, sampling_logprobs=roll)
    bwd, fwd = 0.3, 0.2
    for approx in (False, True):
        term = losses.fold(
            losses.reinforce(ratio_weight=True, reduction="token_sum"),
            (
                "kl_bwd",
                losses.kl_loss(
                    coef=bwd,
                    estimator="rllm_bwd" if approx else "rllm_bwd_sf",
                    target="sampling_logprobs",
                    reduction="token_sum",
                ),
            ),
            (
                "kl_fwd",
                losses.kl_loss(
                    coef=fwd,
                    estimator="rllm_fwd",
                    target="sampling_logprobs",
                    reduction="token_sum",
                ),
            ),
        )
        _, g = kl_grad(term, lp, batch)
        r = np.exp(lp - roll)
        expected = -r * adv[:, None] + bwd * ((r - 1) if approx else -1.0) + fwd * r * np.log(r)
        np.testing.assert_allclose(g, expected, rtol=1e-12)


def test_prime_rl_kl_is_dppo_tv_kl_kl_part():
    rng = np.random.default_rng(4)
    lp = -rng.uniform(0.1, 3.0, (3, 4))
    batch = losses.Batch(
        action_mask=(rng.uniform(size=(3, 4)) < 0.8).astype(float),
        advantages=rng.normal(size=3),
        sampling_logprobs=lp + rng.normal(0, 0.4, (3, 4)),
    )
    tau = 0.05
    full = losses.dppo_tv_kl(kl_tau=tau)
    parts = losses.fold(
        losses.dppo_tv_kl(kl_tau=0.0),
        losses.kl_loss(coef=tau, estimator="sq_log_ratio", target="sampling_logprobs"),
    )
    v1, g1 = kl_grad(full, lp, batch)
    v2, g2 = kl_grad(parts, lp, batch)
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
    np.testing.assert_allclose(g1, g2, rtol=1e-12, atol=1e-15)


def test_kl_loss_folds_onto_any_policy_term_like_the_keywords():
    rng = np.random.default_rng(5)
    lp = -rng.uniform(0.1, 3.0, (3, 5))
    batch = losses.Batch(
        action_mask=(rng.uniform(size=(3, 5)) < 0.8).astype(float),
        advantages=rng.normal(size=3),
        sampling_logprobs=lp + rng.normal(0, 0.3, (3, 5)),
        ref_logprobs=lp + rng.normal(0, 0.3, (3, 5)),
    )
    kw = dict(reduction="seq_mean_token_mean")
    a = losses.grpo(
        clip_high=0.28, kl_coef=0.05, kl_estimator="k3", kl_importance_weight=True, **kw
    )
    b = losses.fold(
        losses.dapo(clip_low=0.2, clip_high=0.28, **kw),
        losses.kl_loss(coef=0.05, estimator="k3", importance_weight=True, **kw),
    )
    va, ga = kl_grad(a, lp, batch)
    vb, gb = kl_grad(b, lp, batch)
    np.testing.assert_allclose(va, vb, rtol=1e-12)
    np.testing.assert_allclose(ga, gb, rtol=1e-12, atol=1e-15)


def test_zero_coefficient_is_zero_and_leaves_a_fold_bit_exact():
    t = losses.kl_loss(coef=0.0)
    assert t.is_zero
    rng = np.random.default_rng(6)
    lp = -rng.uniform(0.1, 3.0, (2, 3))
    batch = losses.Batch(
        action_mask=np.ones((2, 3)),
        advantages=rng.normal(size=2),
        sampling_logprobs=lp - 0.1,
        ref_logprobs=lp - 0.2,
    )
    v1, g1 = kl_grad(losses.fold(losses.ppo(), t), lp, batch)
    v2, g2 = kl_grad(losses.ppo(), lp, batch)
    assert v1 == v2
    np.testing.assert_array_equal(g1, g2)


# -- 4. configs and bad input -------------------------------------------------------------------


@over(KL_CASES)
def test_kl_loss_config_rebuilds_the_term(case):
    t = case.term()
    json.dumps(t.config)
    assert set(t.config) == set(inspect.signature(losses.kl_loss).parameters)
    rebuilt = losses.kl_loss(**t.config)
    assert rebuilt.config == t.config and rebuilt.kind == "kl_loss"
    rng = np.random.default_rng(7)
    lp = -rng.uniform(0.1, 3.0, (2, 3))
    batch = losses.Batch(
        action_mask=np.ones((2, 3)),
        sampling_logprobs=lp - 0.1,
        ref_logprobs=lp - 0.2,
    )
    assert float(rebuilt(lp, batch)[0]) == float(t(lp, batch)[0])
    v, g = ref.kl_loss_ref(lp, batch, **case.config)
    assert float(t(lp, batch)[0]) == pytest.approx(v, rel=1e-12)


BAD = [
    (losses.kl_loss, dict(estimator="k4"), "unknown estimator 'k4'"),
    (losses.kl_loss, dict(target="old_logprobs"), "unknown target 'old_logprobs'"),
    (losses.kl_loss, dict(estimator="rllm_fwd"), "needs target='sampling_logprobs'"),
    (
        losses.kl_loss,
        dict(estimator="rllm_bwd", target="sampling_logprobs", score_function=True),
        "score_function applies to",
    ),
    (losses.kl_loss, dict(coef=-1.0), "coef must be >= 0.0"),
    (losses.kl_loss, dict(importance_weight=1), "importance_weight must be a bool"),
    (losses.kl_loss, dict(reduction="sum"), "unknown reduction 'sum'"),
    (losses.grpo, dict(kl_estimator="rllm_fwd"), "unknown kl_estimator 'rllm_fwd'"),
    (losses.grpo, dict(kl_importance_weight="yes"), "kl_importance_weight must be a bool"),
    (losses.reinforce, dict(kl_score_function=None), "kl_score_function must be a bool"),
]


@pytest.mark.parametrize("ctor, kwargs, message", BAD, ids=[m[:30] for _, _, m in BAD])
def test_bad_kl_hyperparameters(ctor, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ctor(**kwargs)


def test_missing_fields_are_named():
    lp = jnp.zeros((1, 2))
    no_ref = losses.Batch(action_mask=jnp.ones((1, 2)), sampling_logprobs=lp)
    with pytest.raises(ValueError, match="kl_loss needs batch field 'ref_logprobs'"):
        losses.kl_loss()(lp, no_ref)
    no_old = losses.Batch(action_mask=jnp.ones((1, 2)), ref_logprobs=lp)
    with pytest.raises(ValueError, match="kl_loss needs batch field 'old_logprobs'"):
        losses.kl_loss(importance_weight=True)(lp, no_old)
    assert "old_logprobs" in losses.grpo(kl_coef=0.1, kl_importance_weight=True).requires


def test_kl_loss_reads_exactly_its_fields():
    # The rule of tests/test_batch.py (`reads` is what can change the outputs), for kl_loss.
    from tests.test_batch import _changed, _outputs, _same, _variants

    for kwargs in (
        dict(estimator="k3", importance_weight=True, reduction="seq_mean_token_mean"),
        dict(estimator="sq_log_ratio", target="sampling_logprobs"),
    ):
        term = losses.kl_loss(**kwargs)
        assert term.reads <= set(losses.FIELDS) and term.requires <= term.reads
        rng = np.random.default_rng(0)
        lp, variants = _variants(rng)
        bases = [_outputs(term, lp, f) for f in variants]
        for field in losses.FIELDS:
            outs = [_outputs(term, lp, _changed(field, f, rng)) for f in variants]
            same = all(_same(o, b) for o, b in zip(outs, bases, strict=True))
            assert same != (field in term.reads), (kwargs, field)
