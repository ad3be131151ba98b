"""Mismatch corrections and off-policy filters (`losses.mismatch_correction`,
`losses.correction_chain`, `losses.importance_weight_mean`; mirrors losses/_correction.py).

Here: weights by hand and the golden values of docs/sources.md#mismatch-corrections (IcePop, slime,
TIS batch-normalised, OpenRLHF, rllm, verl rejection statistics, SkyRL, OPSM), the identity in
bypass mode, what a correction scales, the chain API, batch normalisation with the mean as data
(NumPy reference, split_batch exactness, jit/vmap, permutation), denominators, peer-bug
regressions and bad hyperparameters. The corrected terms without batch normalisation (every kind,
chains included) are cases of the registry (tests/cases.py), checked against the NumPy reference
and for NaN safety, split_batch, permutation, padding, jit and vmap by
tests/test_term_properties.py.
"""

from __future__ import annotations

import doctest
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import losses
from tests import numpy_ref_policy as ref
from tests.cases import ICEPOP, MIS_SEQ, MIS_TOK, OPSM, RS_CHAIN, RS_SEQ, TIS_SEQ, TIS_TOK, spec
from tests.cases import fixed_batch as _fixed_batch
from tests.cases import value_and_grad as vg
from tests.strategies import policy_batches

MC = losses.mismatch_correction
B, T = 4, 6

# -- the worked example of policy-losses-2 §1.6: A = +1, one sequence of 3 tokens ---------------

ROLL = np.log([[0.5, 0.2, 0.1]])
OLD = np.log([[0.5, 0.6, 0.04]])  # w = exp(old - roll) = [1, 3, 0.4]


def _example(**changes):
    fields = dict(
        action_mask=np.ones((1, 3)),
        advantages=np.ones(1),
        sampling_logprobs=ROLL,
        old_logprobs=OLD,
    )
    fields.update(changes)
    return losses.Batch(**fields)


def golden(actual, expected):
    """Asserts that ``actual`` rounds to each ``expected`` literal at the digits it is given with
    (the reference rounds to 5 significant digits); integer literals are exact (to 1e-12)."""
    actual = np.atleast_1d(np.asarray(actual, float))
    for a, e in zip(actual, np.atleast_1d(expected), strict=True):
        if float(e).is_integer():
            assert a == pytest.approx(float(e), rel=1e-12, abs=1e-12), (a, e)
        else:
            decimals = len(repr(float(e)).split(".")[1])
            assert abs(a - e) <= 0.5 * 10.0**-decimals + 1e-15, (a, e)


def _weights(corr, batch, lp=None):
    c, metrics = corr.weights(batch, jnp.asarray(batch.action_mask) > 0, logprobs=lp)
    return np.asarray(c), {k: float(v) for k, v in metrics.items()}


def test_correction_weights_by_hand():
    # ρ_t = exp(old - sampling) = [2, 0.5, 4] on the first row's three action tokens.
    old = np.log([[0.4, 0.1, 0.8, 0.3]])
    samp = np.log([[0.2, 0.2, 0.2, 0.3]])
    batch = losses.Batch(
        action_mask=jnp.array([[1.0, 1, 1, 0]]),
        advantages=jnp.ones(1),
        sampling_logprobs=samp,
        old_logprobs=old,
    )
    cases = [
        (dict(kind="tis", level="token", cap=3.0), [2.0, 0.5, 3.0, 0], "truncated", 1 / 3),
        (dict(kind="tis", level="sequence", cap=3.0), [3.0, 3.0, 3.0, 0], "truncated", 1.0),
        (dict(kind="tis", level="sequence", cap=5.0), [4.0, 4.0, 4.0, 0], "truncated", 0.0),
        (dict(kind="mis", level="token", low=0.6, high=3.0), [2.0, 0, 0, 0], "rejected", 2 / 3),
        (dict(kind="mis", level="sequence", high=4.5), [4.0, 4.0, 4.0, 0], "rejected", 0.0),
        (dict(kind="mis", level="sequence", high=3.9), [0, 0, 0, 0], "rejected", 1.0),
        (dict(kind="icepop", low=0.5, high=3.0), [2.0, 0.5, 0, 0], "rejected", 1 / 3),
    ]
    for kwargs, expected, flag, frac in cases:
        c, metrics = _weights(MC(**kwargs), batch)
        np.testing.assert_allclose(c[0], expected, rtol=1e-12, err_msg=str(kwargs))
        assert metrics[f"mismatch_{flag}_frac"] == pytest.approx(frac)
        assert metrics["mismatch_weight_mean"] == pytest.approx(sum(expected) / 3)
        assert metrics["mismatch_ratio_mean"] == pytest.approx(6.5 / 3)
        assert metrics["mismatch_ratio_min"] == pytest.approx(0.5)
        assert metrics["mismatch_ratio_max"] == pytest.approx(4.0)
        assert metrics["mismatch_ratio_ess"] == pytest.approx(6.5**2 / 20.25)


# policy-losses-2 §1.6 "Scheme | Weights" (the OpenRLHF `tis` two-sided clamp has no kind here).
GOLDEN_WEIGHTS = [
    ("icepop [0.5, 5] (OpenRLHF/verl)", MC(kind="icepop"), [1, 3, 0]),
    ("slime icepop_function [0, 2]", MC(kind="mis", low=0.0, high=2.0), [1, 0, 0.4]),
    ("slime icepop_function [0.5, 2]", MC(kind="icepop", high=2.0), [1, 0, 0]),
    ("TIS C = 2", MC(kind="tis", cap=2.0), [1, 2, 0.4]),
    (
        "TIS C = 2, batch-normalised",
        MC(kind="tis", cap=2.0, batch_normalize=True),
        [0.88235, 1.76471, 0.35294],
    ),
    (
        # keep iff 0.5 <= exp(mean lr) <= 5, i.e. k1 = -mean lr within [log 1/5, log 1/0.5];
        # then the raw ratio (an MIS band no ratio reaches: exp(±20) bounds every ratio).
        "OpenRLHF seq-mask-tis [0.5, 5]",
        losses.correction_chain(
            MC(kind="rejection", level="seq_mean", statistic="k1", low=0.2, high=2.0),
            MC(kind="mis", low=0.0, high=1e9),
        ),
        [1, 3, 0.4],
    ),
]


@pytest.mark.parametrize(
    "corr, expected", [g[1:] for g in GOLDEN_WEIGHTS], ids=[g[0] for g in GOLDEN_WEIGHTS]
)
def test_golden_weights(corr, expected):
    c, metrics = _weights(corr, _example())
    golden(c[0], expected)
    # ratio diagnostics of w = [1, 3, 0.4]: ESS = 4.4² / 10.16
    assert metrics["mismatch_ratio_min"] == pytest.approx(0.4, rel=1e-12)
    assert metrics["mismatch_ratio_max"] == pytest.approx(3.0, rel=1e-12)
    golden(metrics["mismatch_ratio_ess"], 1.90551)


def test_golden_batch_normalised_mean_is_data():
    corr = MC(kind="tis", cap=2.0, batch_normalize=True)
    mean = losses.importance_weight_mean(_example(), corr)
    golden(float(mean), 1.13333)
    _, metrics = _weights(corr, _example())
    golden(metrics["mismatch_is_weight_mean"], 1.13333)
    # a carried mean replaces the batch's own
    c, metrics = _weights(corr, _example(is_weight_mean=np.array(2.0)))
    np.testing.assert_allclose(c[0], [0.5, 1.0, 0.2], rtol=1e-12)
    assert metrics["mismatch_is_weight_mean"] == 2.0


def test_golden_rllm_icepop_first_step():
    # rllm `icepop` is REINFORCE with d = exp(sg(lp) - roll); at the first step lp = old, so it
    # is reinforce with the IcePop weight of exp(old - roll): gradient -A·d·keep, value Σ -d·lp·keep.
    term = losses.reinforce(reduction="token_sum", correction=MC(kind="icepop"))
    lp = jnp.asarray(OLD)
    (value, _), grad = jax.value_and_grad(term, has_aux=True)(lp, _example())
    golden(float(value), 2.22562)
    np.testing.assert_allclose(np.asarray(grad)[0], [-1.0, -3.0, 0.0], rtol=1e-12)


# -- verl rejection statistics (§1.6): NumPy values, and the JAX keep decision around each -------

LR = [0.0, math.log(3.0), math.log(0.4)]


@pytest.mark.parametrize(
    "statistic, expected",
    [
        ("k1", [0.0, -1.09861, 0.91629]),
        ("k2", [0.0, 0.60347, 0.41979]),
        ("k3", [0.0, 0.90139, 0.31629]),
    ],
)
def test_golden_token_statistics(statistic, expected):
    got = [ref.rejection_statistic_ref(lr, statistic) for lr in LR]
    golden(got, expected)
    if statistic == "k1":
        return
    for j in (1, 2):  # the JAX decision flips between the golden value ± 1e-4 (relative)
        for factor, kept in ((1 + 1e-4, True), (1 - 1e-4, False)):
            corr = MC(kind="rejection", statistic=statistic, high=expected[j] * factor)
            c, _ = _weights(corr, _example())
            assert (c[0, j] == 1.0) == kept, (statistic, j, factor)
            assert c[0, 0] == 1.0


def test_golden_token_k1_threshold_two():
    # threshold 2.0 = bounds ±0.69315 on k1: keeps [1, 0, 0]
    c, metrics = _weights(MC(kind="rejection", statistic="k1", high=2.0), _example())
    np.testing.assert_array_equal(c[0], [1.0, 0.0, 0.0])
    assert metrics["mismatch_rejected_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "level, statistic, value",
    [
        ("seq_sum", "k1", -0.18232),
        ("seq_mean", "k1", -0.06077),
        ("seq_mean", "k3", 0.40589),
        ("seq_max", "k3", 0.90139),
    ],
)
def test_golden_sequence_statistics(level, statistic, value):
    stats = [ref.rejection_statistic_ref(lr, statistic) for lr in LR]
    agg = {"seq_sum": sum(stats), "seq_mean": sum(stats) / 3, "seq_max": max(stats)}[level]
    golden(agg, value)
    eps = 2e-4 * abs(value)
    if statistic == "k1":  # ratio bounds on π_roll/π_old: log low <= S <= log high
        keep = MC(
            kind="rejection", level=level, statistic="k1", low=math.exp(value - eps), high=2.0
        )
        drop = MC(
            kind="rejection", level=level, statistic="k1", low=math.exp(value + eps), high=2.0
        )
    else:
        keep = MC(kind="rejection", level=level, statistic=statistic, high=value + eps)
        drop = MC(kind="rejection", level=level, statistic=statistic, high=value - eps)
    np.testing.assert_array_equal(_weights(keep, _example())[0][0], [1, 1, 1])
    c, metrics = _weights(drop, _example())
    np.testing.assert_array_equal(c[0], [0, 0, 0])
    assert metrics["mismatch_rejected_frac"] == 1.0


def test_golden_verl_presets():
    # seq_sum_k1 kept by "0.5_2.0"; seq_mean_k1 (geo_rs) rejected by "0.999_1.001"
    kept = MC(kind="rejection", level="seq_sum", statistic="k1", low=0.5, high=2.0)
    np.testing.assert_array_equal(_weights(kept, _example())[0][0], [1, 1, 1])
    geo = MC(kind="rejection", level="seq_mean", statistic="k1", low=0.999, high=1.001)
    np.testing.assert_array_equal(_weights(geo, _example())[0][0], [0, 0, 0])
    golden(math.log(0.999), -0.0010005)
    golden(math.log(1.001), 0.0009995)
    # decoupled_seq_is_rs: sequence IS 2.0 (product 1.2) + seq_sum_k1 at "0.5_2.0"
    chain = losses.correction_chain(MC(kind="tis", level="sequence", cap=2.0), kept)
    np.testing.assert_allclose(_weights(chain, _example())[0][0], [1.2, 1.2, 1.2], rtol=1e-12)


def test_golden_skyrl_masks():
    # SkyRL bounds are on the IS ratio; ours (k1) on its inverse: [lo, hi] -> [1/hi, 1/lo].
    geometric = MC(kind="rejection", level="seq_mean", statistic="k1", low=1 / 1.01, high=1 / 0.99)
    np.testing.assert_array_equal(_weights(geometric, _example())[0][0], [0, 0, 0])
    golden(math.exp(sum(LR) / 3), 1.06266)
    product = MC(kind="rejection", level="seq_sum", statistic="k1", low=1 / 2.0, high=1 / 0.5)
    np.testing.assert_array_equal(_weights(product, _example())[0][0], [1, 1, 1])
    assert math.exp(sum(LR)) == pytest.approx(1.2, rel=1e-12)
    # outlier high = 2.5 (no low): a token with ratio 3 > 2.5 rejects the whole sequence
    outlier = MC(kind="rejection", level="seq_max", statistic="k1", low=1 / 2.5, high=1e6)
    c, metrics = _weights(outlier, _example())
    np.testing.assert_array_equal(c[0], [0, 0, 0])
    assert metrics["mismatch_rejected_frac"] == 1.0
    loose = MC(kind="rejection", level="seq_max", statistic="k1", low=1 / 3.5, high=1e6)
    np.testing.assert_array_equal(_weights(loose, _example())[0][0], [1, 1, 1])
    # the token mask zeroes single tokens, the TIS weight multiplies (order does not matter)
    token = MC(kind="rejection", statistic="k1", low=1 / 2.5, high=1 / 0.3)  # IS [0.3, 2.5]
    skyrl = losses.correction_chain(token, MC(kind="tis", cap=2.0))
    np.testing.assert_allclose(_weights(skyrl, _example())[0][0], [1, 0, 0.4], rtol=1e-12)


@pytest.mark.parametrize("delta", [0.3, 1e-4])
def test_golden_opsm(delta):
    lp = np.log([[0.25, 0.5]])
    behaviour = np.log([[0.5, 0.5]])
    golden(np.mean(behaviour - lp), 0.34657)
    term = losses.importance_sampling(
        reduction="token_sum", correction=MC(kind="opsm", delta=delta)
    )
    for adv, dropped in ((-1.0, True), (1.0, False)):
        batch = losses.Batch(
            action_mask=np.ones((1, 2)),
            advantages=np.array([adv]),
            sampling_logprobs=behaviour,
            old_logprobs=lp,
        )
        (value, metrics), grad = jax.value_and_grad(term, has_aux=True)(jnp.asarray(lp), batch)
        if dropped:
            assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0)
            assert float(metrics["mismatch_rejected_frac"]) == 1.0
        else:
            np.testing.assert_allclose(np.asarray(grad), [[-1.0, -1.0]], rtol=1e-12)
            assert float(metrics["mismatch_rejected_frac"]) == 0.0


def test_opsm_threshold_is_strict_and_zero_advantage_is_kept():
    lp = jnp.log(jnp.array([[0.25, 0.5], [0.25, 0.5]]))
    batch = losses.Batch(
        action_mask=np.ones((2, 2)),
        advantages=np.array([-1.0, 0.0]),
        sampling_logprobs=np.log([[0.5, 0.5], [0.5, 0.5]]),
    )
    d = math.log(2.0) / 2  # mean(π_b - lp) = 0.34657
    c, _ = _weights(MC(kind="opsm", delta=d * (1 - 1e-9)), batch, lp)
    np.testing.assert_array_equal(c, [[0, 0], [1, 1]])  # A = 0 is never dropped
    c, _ = _weights(MC(kind="opsm", delta=d * (1 + 1e-9)), batch, lp)
    np.testing.assert_array_equal(c, [[1, 1], [1, 1]])
    # per-token advantages: only the negative tokens of a divergent row are dropped
    tok = batch.replace(advantages=np.array([[-1.0, 2.0], [-1.0, -1.0]]))
    c, metrics = _weights(MC(kind="opsm", delta=0.3), tok, lp)
    np.testing.assert_array_equal(c, [[0, 1], [0, 0]])
    assert metrics["mismatch_rejected_frac"] == 0.75


def test_opsm_behaviour_field_and_logprobs_requirement():
    lp = jnp.log(jnp.array([[0.25, 0.5]]))
    only_old = losses.Batch(
        action_mask=np.ones((1, 2)), advantages=np.array([-1.0]), old_logprobs=np.log([[0.5, 0.5]])
    )
    old = MC(kind="opsm", delta=0.3, behaviour="old")
    assert old.requires == {"advantages", "old_logprobs"}
    assert MC(kind="opsm", delta=0.3).requires == {"advantages", "sampling_logprobs"}
    c, _ = _weights(old, only_old, lp)
    np.testing.assert_array_equal(c, [[0, 0]])
    term = losses.ppo(correction=old)
    assert "sampling_logprobs" not in term.requires
    with pytest.raises(ValueError, match="sampling_logprobs"):
        losses.ppo(correction=MC(kind="opsm", delta=0.3))(lp, only_old)
    with pytest.raises(ValueError, match="needs the current logprobs"):
        old.weights(only_old, jnp.ones((1, 2), bool))


# -- bypass mode, what a correction scales ------------------------------------------------------

BN_TOK = MC(kind="tis", cap=1.5, batch_normalize=True)
BN_SEQ = MC(kind="mis", level="sequence", high=3.0, batch_normalize=True)


@pytest.mark.parametrize(
    "corr", [TIS_TOK, TIS_SEQ, MIS_TOK, MIS_SEQ, ICEPOP, RS_CHAIN, BN_TOK, BN_SEQ], ids=str
)
@pytest.mark.parametrize("seed", [0, 1])
def test_correction_is_the_identity_in_bypass_mode(corr, seed):
    # old == sampling: ρ ≡ 1, so the corrected term equals the uncorrected one bit for bit.
    lp, batch = _fixed_batch(seed)
    batch = batch.replace(sampling_logprobs=batch.old_logprobs)
    plain = losses.importance_sampling()
    t = losses.importance_sampling(correction=corr)
    (v0, _), g0 = jax.value_and_grad(lambda x: plain(x, batch), has_aux=True)(jnp.asarray(lp))
    (v1, m1), g1 = jax.value_and_grad(lambda x: t(x, batch), has_aux=True)(jnp.asarray(lp))
    assert float(v1) == float(v0)
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))
    any_token = np.asarray(batch.action_mask).any()
    assert float(m1["mismatch_weight_mean"]) == (1.0 if any_token else 0.0)
    assert float(m1["mismatch_ratio_ess"]) == np.asarray(batch.action_mask).sum()


def test_correction_scales_only_the_policy_part_of_grpo_and_reinforce():
    lp = jnp.array([[-1.0, -2.0]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 2)),
        advantages=jnp.array([1.0]),
        old_logprobs=lp,
        sampling_logprobs=lp - jnp.log(1.5),  # ρ = 1.5 everywhere
        ref_logprobs=lp + 0.3,
    )
    corr = dict(kind="tis", level="token", cap=4.0)
    for ctor in (losses.grpo, losses.reinforce):
        plain = ctor(kl_coef=0.2, reduction="token_sum")
        corrected = ctor(kl_coef=0.2, reduction="token_sum", correction=corr)
        _, mp = plain(lp, batch)
        _, mc = corrected(lp, batch)
        assert float(mc["pg_loss"]) == pytest.approx(1.5 * float(mp["pg_loss"]), rel=1e-12)
        assert float(mc["kl_loss"]) == float(mp["kl_loss"])


# -- denominators: rejected tokens stay in them; verl's behaviour by editing the mask -----------


def test_rejected_tokens_stay_in_the_denominator_and_verl_is_one_mask_edit_away():
    lp, batch = _fixed_batch(3)
    rs = MC(kind="rejection", statistic="k3", high=0.1)
    valid = np.asarray(batch.action_mask) > 0
    c, _ = _weights(rs, batch)
    assert 0 < (c[valid] == 0).sum() < valid.sum()
    ours = losses.importance_sampling(reduction="token_mean", correction=rs)
    value, _ = ours(jnp.asarray(lp), batch)
    ell = -np.asarray(batch.advantages)[:, None] * np.exp(lp - np.asarray(batch.old_logprobs))
    np.testing.assert_allclose(float(value), (c * ell)[valid].sum() / valid.sum(), rtol=1e-12)
    # verl writes the rejection into response_mask: the local token mean then counts kept tokens
    kept = batch.replace(action_mask=np.asarray(batch.action_mask) * (c > 0))
    verl, _ = losses.importance_sampling(reduction="token_mean")(jnp.asarray(lp), kept)
    np.testing.assert_allclose(float(verl), (c * ell)[valid].sum() / (c > 0).sum(), rtol=1e-12)


# -- chains -------------------------------------------------------------------------------------


def test_chain_api():
    tis = MC(kind="tis", level="sequence", cap=2.5)
    rs = dict(kind="rejection", level="token", statistic="k3", high=0.35)
    chain = losses.correction_chain(tis, rs)
    assert isinstance(chain, losses.CorrectionChain) and len(chain.rules) == 2
    assert losses.correction_chain(tis) is tis
    nested = losses.correction_chain(chain, MC(kind="opsm", delta=0.1))
    assert [r.kind for r in nested.rules] == ["tis", "rejection", "opsm"]
    assert chain.as_config() == [tis.as_config(), MC(**rs).as_config()]
    assert losses.correction_chain(*chain.as_config()) == chain
    assert hash(chain) == hash(losses.correction_chain(tis, rs))
    # a policy term takes the chain, a list of configs, and rebuilds from its own config
    lp, batch = _fixed_batch(1)
    terms = [losses.grpo(correction=c) for c in (chain, chain.as_config(), [tis, rs])]
    assert terms[0].config["correction"] == chain.as_config()
    rebuilt = losses.grpo(**terms[0].config)
    v = [float(t(jnp.asarray(lp), batch)[0]) for t in [*terms, rebuilt]]
    assert v == [v[0]] * 4
    assert chain.requires == {"old_logprobs", "sampling_logprobs"}
    assert nested.requires == {"old_logprobs", "sampling_logprobs", "advantages"}


@settings(max_examples=10)
@given(data=policy_batches(shapes=[(B, T)]))
def test_chain_weights_are_the_product_and_metrics_are_per_rule(data):
    lp, batch = data
    for chain in (RS_CHAIN, RS_SEQ):
        c, metrics = _weights(chain, batch, jnp.asarray(lp))
        prod = np.ones(batch.shape)
        for i, rule in enumerate(chain.rules):
            ci, mi = _weights(rule, batch, jnp.asarray(lp))
            prod = prod * ci
            flag = "truncated" if rule.kind == "tis" else "rejected"
            assert metrics[f"mismatch_{i}_{flag}_frac"] == mi[f"mismatch_{flag}_frac"]
        np.testing.assert_array_equal(c, prod)
        c_ref, m_ref = ref.correction_ref(batch, chain, lp)
        np.testing.assert_allclose(c, c_ref, rtol=1e-12, atol=0)
        for key, expected in m_ref.items():
            assert metrics[key] == pytest.approx(expected, rel=1e-10, abs=1e-12), key


# -- batch normalisation: NumPy reference, the mean as data, split_batch exactness --------------

BN_CASES = [
    spec("importance_sampling", reduction="token_mean", correction=BN_TOK),
    spec(
        "ppo",
        reduction="seq_mean_token_sum",
        correction=losses.correction_chain(
            BN_SEQ, MC(kind="rejection", level="seq_sum", statistic="k2", high=1.5)
        ),
    ),
    spec(
        "cispo", reduction="token_sum", correction=MC(kind="icepop", high=2.0, batch_normalize=True)
    ),
]


def _with_mean(batch, case):
    return batch.replace(
        is_weight_mean=losses.importance_weight_mean(batch, case.config["correction"])
    )


@pytest.mark.parametrize("case", BN_CASES, ids=lambda c: c.ctor)
@settings(max_examples=8)
@given(data=policy_batches(shapes=[(B, T)]), carried=st.booleans())
def test_batch_normalised_matches_numpy_reference(case, data, carried):
    lp, batch = data
    if carried:
        batch = _with_mean(batch, case)
    (value, metrics), grad = vg(case, lp, batch)
    ref_value, ref_grad = ref.policy_ref(case.ctor, lp, batch, **case.config)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    _, ref_metrics = ref.correction_ref(batch, case.config["correction"], lp)
    for key, expected in ref_metrics.items():
        assert metrics[key] == pytest.approx(expected, rel=1e-10, abs=1e-12), key
    assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("case", BN_CASES, ids=lambda c: c.ctor)
@settings(max_examples=8)
@given(data=policy_batches(shapes=[(B, T)]), k=st.sampled_from([2, 4]))
def test_batch_normalised_split_batch_is_exact_with_the_mean_carried(case, data, k):
    lp, batch = data
    full = _with_mean(batch, case)
    (v_own, _), g_own = vg(case, lp, batch)
    (v_full, _), g_full = vg(case, lp, full)
    np.testing.assert_allclose(v_full, v_own, rtol=1e-12, atol=1e-14)  # the helper's mean
    np.testing.assert_allclose(g_full, g_own, rtol=1e-12, atol=1e-14)
    values, grads = [], []
    for sl, part in zip(losses.row_slices(B, k), losses.split_batch(full, k), strict=True):
        assert float(part.is_weight_mean) == float(full.is_weight_mean)  # never sliced
        (v, _), g = vg(case, lp[sl], part)
        values.append(v)
        grads.append(g)
    np.testing.assert_allclose(sum(values), v_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-12, atol=1e-14)


def test_batch_normalised_split_batch_is_not_exact_without_the_mean():
    # Documented: without is_weight_mean each micro-batch divides by its own mean.
    case = BN_CASES[0]
    lp, batch = _fixed_batch(0)
    (v_full, _), _ = vg(case, lp, batch)
    parts = losses.split_batch(batch, 2)
    assert all(p.is_weight_mean is None for p in parts)
    v_sum = sum(
        vg(case, lp[sl], p)[0][0] for sl, p in zip(losses.row_slices(B, 2), parts, strict=True)
    )
    assert abs(v_sum - v_full) > 1e-6


@pytest.mark.parametrize("case", BN_CASES[:2], ids=lambda c: c.ctor)
@settings(max_examples=6)
@given(
    data=policy_batches(shapes=[(B, T)]),
    seed=st.integers(0, 2**31 - 1),
    fill=st.sampled_from([np.inf, -np.inf, np.nan, 200.0]),
)
def test_batch_normalised_permutation_and_nan_safety(case, data, seed, fill):
    lp, batch = data
    (v0, _), g0 = vg(case, lp, batch)
    perm = np.random.default_rng(seed).permutation(B)
    permuted = jax.tree.map(lambda x: x[perm] if x.ndim >= 1 else x, batch)
    (v1, _), g1 = vg(case, lp[perm], permuted)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, g0[perm], rtol=1e-12, atol=1e-14)
    masked = np.asarray(batch.action_mask) == 0
    changes = {
        name: np.where(masked, fill, np.asarray(getattr(batch, name)))
        for name in ("old_logprobs", "sampling_logprobs")
    }
    (v2, m2), g2 = vg(case, np.where(masked, fill, lp), batch.replace(**changes))
    assert np.all(g2[masked] == 0.0) and all(np.isfinite(v) for v in m2.values())
    np.testing.assert_allclose(v2, v0, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(g2, g0, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("carried", [False, True])
def test_batch_normalised_jit_and_vmap(carried):
    case = BN_CASES[1]
    lp, batch = _fixed_batch(2)
    if carried:
        batch = _with_mean(batch, case)
    t = case.term()
    v_eager, _ = t(jnp.asarray(lp), batch)
    (v_jit, _), _ = vg(case, lp, batch)
    np.testing.assert_allclose(v_jit, float(v_eager), rtol=1e-13)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)
    values, _ = jax.vmap(t)(jnp.stack([lp, lp]), stacked)
    np.testing.assert_allclose(np.asarray(values), [float(v_eager)] * 2, rtol=1e-13)
    mean = jax.jit(losses.importance_weight_mean, static_argnums=1)(
        batch, case.config["correction"]
    )
    assert float(mean) == float(losses.importance_weight_mean(batch, case.config["correction"]))


def test_batch_normalisation_edge_cases():
    # verl: normalised weights can exceed the cap (no re-truncation)
    batch = _example(old_logprobs=ROLL + np.log([[2.0, 0.1, 0.1]]))
    c, _ = _weights(MC(kind="tis", cap=2.0, batch_normalize=True), batch)
    np.testing.assert_allclose(c[0], np.array([2.0, 0.1, 0.1]) / (2.2 / 3), rtol=1e-12)
    assert c[0, 0] > 2.0
    # a mean <= 1e-8 (everything rejected) skips the normalisation: weights 0, divisor 1
    corr = MC(kind="mis", low=0.9, high=1.1, batch_normalize=True)
    c, metrics = _weights(corr, batch)
    np.testing.assert_array_equal(c, 0.0)
    assert metrics["mismatch_is_weight_mean"] == 1.0
    assert float(losses.importance_weight_mean(batch, corr)) == 1.0
    # sequence level: the mean over rows with an action token of the row weight
    two = losses.Batch(
        action_mask=np.array([[1.0, 1, 0], [1, 0, 0], [0, 0, 0]]),
        advantages=np.ones(3),
        sampling_logprobs=np.zeros((3, 3)) - 1.0,
        old_logprobs=np.array(
            [[-1.0 + math.log(1.5), -1.0, 0], [-1.0 + math.log(3.0), 0, 0], [0, 0, 0]]
        ),
    )
    seq = MC(kind="tis", level="sequence", cap=2.5, batch_normalize=True)
    assert float(losses.importance_weight_mean(two, seq)) == pytest.approx((1.5 + 2.5) / 2)
    with pytest.raises(ValueError, match="no batch_normalize=True rule"):
        losses.importance_weight_mean(two, TIS_TOK)


def test_reads_and_requires():
    assert BN_TOK.reads == {"old_logprobs", "sampling_logprobs", "is_weight_mean"}
    assert "is_weight_mean" in losses.importance_sampling(correction=BN_TOK).reads
    assert "is_weight_mean" not in losses.importance_sampling(correction=TIS_TOK).reads
    assert losses.grpo(correction=TIS_TOK).requires == {
        "action_mask",
        "advantages",
        "old_logprobs",
        "sampling_logprobs",
    }
    assert losses.grpo(correction=OPSM).reads >= {"advantages", "sampling_logprobs"}


# -- peer-bug regressions -----------------------------------------------------------------------


@pytest.mark.parametrize("corr", [ICEPOP, OPSM, RS_CHAIN, RS_SEQ, BN_TOK, BN_SEQ], ids=str)
def test_masked_huge_log_ratio_gives_finite_zero_gradient(corr):
    # docs/sources.md#defects-in-peer-implementations (TRL #3015 class): a masked position whose log-ratio is 200 must
    # not make the gradient nan; in a sequence sum it must not enter the row statistic either.
    lp = jnp.array([[-1.0, 0.0], [-0.5, -2.0]])
    batch = losses.Batch(
        action_mask=np.array([[1.0, 0.0], [1.0, 1.0]]),
        advantages=np.array([-1.0, 1.0]),
        old_logprobs=np.array([[-1.1, 200.0], [-0.6, -1.9]]),
        sampling_logprobs=np.array([[-1.0, -200.0], [-0.55, -2.0]]),
    )
    term = losses.ppo(reduction="token_sum", correction=corr)
    (value, metrics), grad = jax.value_and_grad(term, has_aux=True)(lp, batch)
    g = np.asarray(grad)
    assert np.isfinite(float(value)) and np.all(np.isfinite(g)) and g[0, 1] == 0.0
    assert all(np.isfinite(float(v)) for v in metrics.values())
    clean = batch.replace(
        old_logprobs=np.where(batch.action_mask > 0, batch.old_logprobs, -1.0),
        sampling_logprobs=np.where(batch.action_mask > 0, batch.sampling_logprobs, -1.0),
    )
    (v2, _), g2 = jax.value_and_grad(term, has_aux=True)(lp, clean)
    assert float(v2) == float(value)
    np.testing.assert_array_equal(np.asarray(g2), g)


def test_k1_bounds_apply_to_the_inverse_ratio():
    # verl: k1 bounds are on π_roll/π_old, mirrored relative to TIS. With "0.5_1.5": the token with
    # IS ratio 1.8 (π_roll/π_old = 0.556) is kept, the one with IS ratio 0.6 (1.667) rejected.
    batch = _example(
        action_mask=np.ones((1, 2)),
        sampling_logprobs=np.log([[0.5, 0.5]]),
        old_logprobs=np.log([[0.9, 0.3]]),
    )
    c, _ = _weights(MC(kind="rejection", statistic="k1", low=0.5, high=1.5), batch)
    np.testing.assert_array_equal(c[0], [1.0, 0.0])
    c, _ = _weights(MC(kind="mis", low=0.5, high=1.5), batch)  # MIS bounds: the IS ratio
    np.testing.assert_allclose(c[0], [0.0, 0.6], rtol=1e-12)


# -- bad hyperparameters ------------------------------------------------------------------------

BAD = [
    (MC, dict(kind="pg"), "unknown kind 'pg'"),
    (MC, dict(level="row"), "unknown level 'row'"),
    (MC, dict(kind="tis", low=0.5), "low/high are the bounds of kind='mis'"),
    (MC, dict(kind="mis", cap=2.0), "cap is the bound of kind='tis'"),
    (MC, dict(cap=0.5), "cap must be >= 1.0"),
    (MC, dict(kind="mis", low=1.5), "low must be <= 1.0"),
    (MC, dict(kind="mis", high=0.5), "high must be >= 1.0"),
    (MC, dict(max_log_ratio=0), "max_log_ratio must be > 0.0"),
    (losses.MismatchCorrection, dict(kind="tis", level="token"), "kind='tis' needs cap"),
    (losses.MismatchCorrection, dict(kind="mis", level="token", high=2.0), "needs low and high"),
    (MC, dict(kind="tis", level="seq_sum"), "kind='tis' takes level in"),
    (MC, dict(kind="icepop", level="sequence"), "kind='icepop' takes level in"),
    (MC, dict(kind="icepop", low=2.0), "low must be <= 1.0"),
    (MC, dict(kind="icepop", cap=2.0), "cap does not apply to kind='icepop'"),
    (MC, dict(kind="rejection", high=2.0), "needs statistic"),
    (MC, dict(kind="rejection", statistic="k4", high=2.0), "unknown statistic 'k4'"),
    (MC, dict(kind="rejection", statistic="k1"), "needs low and high"),
    (MC, dict(kind="rejection", statistic="k1", high=0.5), "high must be >= 1.0"),
    (MC, dict(kind="rejection", statistic="k2", low=0.5, high=1.0), "takes an upper bound only"),
    (MC, dict(kind="rejection", statistic="k3"), "kind='rejection' needs high"),
    (MC, dict(kind="rejection", statistic="k3", high=-0.1), "high must be >= 0.0"),
    (MC, dict(kind="rejection", level="sequence", statistic="k1", high=2.0), "takes level in"),
    (
        MC,
        dict(kind="rejection", statistic="k3", high=0.1, batch_normalize=True),
        "batch_normalize does not apply",
    ),
    (MC, dict(kind="opsm"), "kind='opsm' needs delta"),
    (MC, dict(kind="opsm", delta=-1.0), "delta must be >= 0.0"),
    (MC, dict(kind="opsm", delta=0.1, behaviour="ref"), "unknown behaviour 'ref'"),
    (MC, dict(kind="opsm", delta=0.1, high=2.0), "high does not apply to kind='opsm'"),
    (MC, dict(kind="opsm", level="token", delta=0.1), "kind='opsm' takes level in"),
    (MC, dict(kind="tis", delta=0.1), "delta does not apply to kind='tis'"),
    (MC, dict(kind="tis", batch_normalize=1), "batch_normalize must be a bool"),
    (losses.correction_chain, dict(), "at least one rule"),
]


@pytest.mark.parametrize(
    "ctor, kwargs, message", BAD, ids=[f"{c.__name__}-{m[:28]}" for c, _, m in BAD]
)
def test_correction_rejects_bad_hyperparameters(ctor, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ctor(**kwargs)


def test_chain_rejects_bad_rules():
    with pytest.raises(ValueError, match="at most one weighting rule"):
        losses.correction_chain(TIS_TOK, MIS_SEQ)
    with pytest.raises(ValueError, match="at most one weighting rule"):
        losses.grpo(correction=[dict(kind="tis"), dict(kind="icepop")])
    with pytest.raises(ValueError, match="a rule is None"):
        losses.correction_chain(TIS_TOK, None)
    with pytest.raises(ValueError, match=r"unknown correction keys \['C'\]"):
        losses.correction_chain(TIS_TOK, dict(kind="tis", C=2))
    with pytest.raises(ValueError, match="two or more"):
        losses.CorrectionChain(rules=(TIS_TOK,))
    with pytest.raises(ValueError, match="correction must be None"):
        losses.ppo(correction="icepop")


def test_docstring_examples_run():
    result = doctest.testmod(importlib.import_module("losses._correction"))
    assert result.failed == 0 and result.attempted >= 5
