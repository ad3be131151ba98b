"""Advantage estimators (losses/_advantages.py) against NumPy loop references, the golden values
of docs/sources.md#critic-and-advantage-estimators, their singleton/tie rules, NaN safety and errors."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import losses

SHAPES = [(1, 1), (2, 5), (4, 7)]
FILLS = [np.nan, np.inf, -np.inf]
#: Estimators whose group advantages sum to zero.
ZERO_SUM = ("grpo", "dr_grpo", "rloo", "maxrl", "trl_batch")


def _r5(x):
    return [float(f"{v:.5g}") for v in np.ravel(x)]


# -- NumPy references (loops over groups and tokens; no code shared with losses/) ---------------


def ref(rewards, n, estimator, eps=None, lengths=None, norm=True):
    if eps is None:
        eps = 1e-4 if estimator == "trl_batch" else 1e-6
    out = np.zeros_like(rewards)
    batch_std = np.std(rewards, ddof=1) if len(rewards) > 1 else 0.0
    for g in range(len(rewards) // n):
        r = rewards[g * n : (g + 1) * n]
        best = int(np.argmax(r))
        for i in range(n):
            k = g * n + i
            others = np.delete(r, i)
            if estimator == "grpo":
                out[k] = (r[i] - r.mean()) / (r.std(ddof=1) + eps) if norm else r[i] - r.mean()
            elif estimator == "dr_grpo":
                out[k] = r[i] - r.mean()
            elif estimator == "rloo":
                out[k] = r[i] - others.mean()
            elif estimator == "maxrl":
                out[k] = r[i] if n == 1 else (r[i] - r.mean()) / (r.mean() + eps)
            elif estimator == "trl_batch":
                out[k] = (r[i] - r.mean()) / (batch_std + eps)
            elif estimator == "grpo_passk":
                if i == best:
                    gap = r[i] - np.sort(r)[-2]
                    out[k] = gap / (r.std(ddof=1) + eps) if norm else gap
            elif estimator == "opo":
                lens = lengths[g * n : (g + 1) * n]
                base = 0.0 if n == 1 or lens.sum() == 0 else (lens * r).sum() / lens.sum()
                out[k] = r[i] - base
            else:
                raise ValueError(estimator)
    return out


def returns_ref(rewards, mask, gamma, reset):
    b, t = rewards.shape
    out = np.zeros((b, t))
    for i in range(b):
        g = 0.0
        for j in reversed(range(t)):
            if mask[i, j] == 0:
                if reset:
                    g = 0.0
                continue
            g = rewards[i, j] + gamma * g
            out[i, j] = g
    return out


def whiten_ref(x, mask, eps=1e-8):
    sel = x[mask > 0]
    out = np.zeros_like(x)
    if sel.size == 0:
        return out
    mean = sel.sum() / sel.size
    var = ((sel - mean) ** 2).sum() / (sel.size - 1) if sel.size > 1 else 0.0
    for i, j in zip(*np.nonzero(mask > 0), strict=True):
        out[i, j] = (x[i, j] - mean) / np.sqrt(var + eps)
    return out


# -- group_advantages -----------------------------------------------------------------------------


def _rewards(estimator, size):
    lo = 0.0 if estimator == "maxrl" else -5.0  # MaxRL divides by the group mean
    return hnp.arrays(np.float64, size, elements=st.floats(lo, 5, allow_subnormal=False))


@given(
    n=st.sampled_from([2, 4]),
    groups=st.sampled_from([1, 3]),
    estimator=st.sampled_from(losses.ESTIMATORS),
    data=st.data(),
)
def test_group_advantages_match_reference(n, groups, estimator, data):
    rewards = data.draw(_rewards(estimator, n * groups))
    if estimator == "maxrl":  # keep clear of a group mean of 0 (then A = R/eps)
        rewards = rewards + 0.5
    adv = np.asarray(losses.group_advantages(rewards, group_size=n, estimator=estimator))
    np.testing.assert_allclose(adv, ref(rewards, n, estimator), rtol=1e-9, atol=1e-9)
    if estimator in ZERO_SUM:
        np.testing.assert_allclose(adv.reshape(groups, n).sum(axis=1), 0.0, atol=1e-8)
    elif estimator == "grpo_passk":  # at most one non-zero per group, never negative
        assert np.all((adv.reshape(groups, n) != 0).sum(axis=1) <= 1) and np.all(adv >= 0)


@given(n=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 3]), data=st.data())
def test_opo_matches_reference(n, groups, data):
    rewards = data.draw(_rewards("opo", n * groups))
    lengths = data.draw(hnp.arrays(np.float64, n * groups, elements=st.integers(0, 30)))
    adv = losses.group_advantages(rewards, group_size=n, estimator="opo", lengths=lengths)
    np.testing.assert_allclose(
        np.asarray(adv), ref(rewards, n, "opo", lengths=lengths), rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("estimator", ["grpo", "grpo_passk"])
def test_norm_adv_by_std_false(estimator):
    r = np.array([0.9, 0.5, 0.2, 1.0, 0.0, 0.3])
    adv = losses.group_advantages(r, group_size=3, estimator=estimator, norm_adv_by_std=False)
    np.testing.assert_allclose(np.asarray(adv), ref(r, 3, estimator, norm=False), atol=1e-12)


def test_constant_groups_get_zero_advantage():
    for est in losses.ESTIMATORS:
        adv = losses.group_advantages(np.array([1.0, 1.0, 0.0, 1.0]), group_size=2, estimator=est)
        assert np.all(np.asarray(adv)[:2] == 0.0), est
    adv = losses.group_advantages([1.0, 1.0], group_size=2, estimator="opo", lengths=[3, 5])
    assert np.all(np.asarray(adv) == 0.0)


def _close5(x, golden):
    """Agreement to 5 significant digits."""
    np.testing.assert_allclose(np.ravel(x), golden, rtol=1e-5, atol=1e-12)


def test_golden_one_group():
    # §6.3: one group with R = [1, 0, 0, 1]. The reference's ±0.86603 is the eps-free value;
    # eps = 1e-6 moves the 6th digit (0.866024), so compare both ways.
    r = np.array([1.0, 0.0, 0.0, 1.0])

    def adv(est, **kw):
        return losses.group_advantages(r, group_size=4, estimator=est, **kw)

    _close5(adv("grpo"), [0.86603, -0.86603, -0.86603, 0.86603])
    assert _r5(adv("grpo", eps=1e-12)) == [0.86603, -0.86603, -0.86603, 0.86603]
    _close5(adv("maxrl"), [1.0, -1.0, -1.0, 1.0])
    assert _r5(adv("rloo")) == [0.66667, -0.66667, -0.66667, 0.66667]
    assert _r5(adv("opo", lengths=[10, 20, 30, 40])) == [0.5, -0.5, -0.5, 0.5]  # baseline 0.5


def test_golden_passk():
    r = [0.9, 0.5, 0.2]
    _close5(losses.group_advantages(r, group_size=3, estimator="grpo_passk"), [1.13899, 0, 0])
    out = losses.group_advantages(r, group_size=3, estimator="grpo_passk", eps=1e-12)
    np.testing.assert_allclose(np.asarray(out), [1.13899, 0, 0], rtol=5e-6)  # 6 digits, eps-free
    out = losses.group_advantages(r, group_size=3, estimator="grpo_passk", norm_adv_by_std=False)
    assert _r5(out) == [0.4, 0.0, 0.0]


def test_passk_only_the_first_maximum_and_ties_give_zero():
    out = losses.group_advantages(
        [0.9, 0.2, 0.9, 0.0, 1.0, 0.5], group_size=3, estimator="grpo_passk", norm_adv_by_std=False
    )
    # Group 0: r_max = r_2nd = 0.9, so its argmax gets 0; group 1: only index 4 gets 1.0 − 0.5.
    np.testing.assert_array_equal(np.asarray(out), [0.0, 0.0, 0.0, 0.0, 0.5, 0.0])


def test_golden_trl_batch_uses_the_std_of_raw_rewards():
    # §6.3: groups {1, 0}, {1, 1}: batch std of the raw rewards is 0.5 → ±0.9998 (the std of the
    # group-centred rewards, 0.40825, would give ±1.2244).
    out = losses.group_advantages([1.0, 0.0, 1.0, 1.0], group_size=2, estimator="trl_batch")
    assert _r5(out) == [0.9998, -0.9998, 0.0, 0.0]


def test_singleton_groups():
    r = np.array([0.7, -0.2, 1.0])
    # MaxRL: a singleton group keeps R; OPO: baseline 0 (verl).
    np.testing.assert_array_equal(
        np.asarray(losses.group_advantages(r, group_size=1, estimator="maxrl")), r
    )
    out = losses.group_advantages(r, group_size=1, estimator="opo", lengths=[1, 2, 3])
    np.testing.assert_array_equal(np.asarray(out), r)


def test_opo_group_of_empty_responses_has_baseline_zero():
    out = losses.group_advantages([1.0, 0.0], group_size=2, estimator="opo", lengths=[0, 0])
    np.testing.assert_array_equal(np.asarray(out), [1.0, 0.0])


def test_group_advantages_jit_and_vmap():
    f = jax.jit(functools.partial(losses.group_advantages, group_size=2, estimator="grpo_passk"))
    r = np.array([[1.0, 0.0, 0.3, 0.8], [0.0, 0.0, 2.0, 1.0]])
    out = jax.vmap(f)(r)
    for i in range(2):
        np.testing.assert_allclose(out[i], ref(r[i], 2, "grpo_passk"), rtol=1e-12, atol=1e-12)
    g = jax.jit(functools.partial(losses.group_advantages, group_size=2, estimator="opo"))
    np.testing.assert_allclose(
        g(r[0], lengths=np.array([1.0, 3, 2, 2])),
        ref(r[0], 2, "opo", lengths=np.array([1.0, 3, 2, 2])),
        rtol=1e-12,
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rewards=[1.0, 2.0], group_size=1), "group_size must be an int >= 2"),
        (dict(rewards=[1.0, 2.0], group_size=1, estimator="grpo_passk"), "int >= 2"),
        (dict(rewards=[1.0, 2.0], group_size=0, estimator="maxrl"), "int >= 1"),
        (dict(rewards=[1.0, 2.0, 3.0], group_size=2), "positive multiple of group_size=2"),
        (dict(rewards=[[1.0, 2.0]], group_size=2), "rewards must be rank 1"),
        (dict(rewards=[1.0, 2.0], group_size=2, estimator="ppo"), "unknown estimator 'ppo'"),
        (dict(rewards=[1.0, 2.0], group_size=2, eps=0.0), "eps must be > 0.0"),
        (dict(rewards=[1.0, 2.0], group_size=2, estimator="opo"), "lengths must be given"),
        (dict(rewards=[1.0, 2.0], group_size=2, lengths=[1, 2]), "lengths must be given"),
        (
            dict(rewards=[1.0, 2.0], group_size=2, estimator="opo", lengths=[1.0]),
            "lengths has shape",
        ),
        (
            dict(rewards=[1.0, 2.0], group_size=2, estimator="opo", lengths=[1.0, -2.0]),
            r"lengths\[1\] = .*must be finite and >= 0",
        ),
        (
            dict(rewards=[1.0, 2.0], group_size=2, estimator="rloo", norm_adv_by_std=False),
            "norm_adv_by_std=False applies only",
        ),
    ],
)
def test_group_advantages_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        losses.group_advantages(**kwargs)


def test_estimator_lists():
    assert set(losses.ESTIMATORS) >= {"grpo", "dr_grpo", "rloo"}
    assert losses.GROUP_ESTIMATORS == losses.ESTIMATORS + ("opo",)


# -- token-level estimators --------------------------------------------------------------------


@st.composite
def token_data(draw):
    b, t = draw(st.sampled_from(SHAPES))
    mask = draw(hnp.arrays(np.bool_, (b, t))).astype(np.float64)
    r = draw(hnp.arrays(np.float64, (b, t), elements=st.floats(-3, 3, allow_subnormal=False)))
    return r, mask


@functools.cache
def jit_returns(gamma, reset):
    return jax.jit(functools.partial(losses.discounted_returns, gamma=gamma, reset_on_mask=reset))


@given(data=token_data(), gamma=st.sampled_from([1.0, 0.9, 0.0]), reset=st.booleans())
def test_discounted_returns_and_reinforce_pp_match_reference(data, gamma, reset):
    r, m = data
    g = np.asarray(jit_returns(gamma, reset)(r, m))
    expected = returns_ref(r, m, gamma, reset)
    np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-12)
    adv = losses.reinforce_pp_advantages(r, m, gamma=gamma, reset_on_mask=reset)
    np.testing.assert_allclose(np.asarray(adv), whiten_ref(expected, m), rtol=1e-9, atol=1e-9)


def test_carry_versus_reset_on_a_masked_middle_token():
    r, m = [[0.0, 0.0, 1.0]], [[1.0, 0.0, 1.0]]
    # verl carries G = 1 through the masked token (no discount there): G_0 = 0 + 0.5·1.
    assert _r5(losses.discounted_returns(r, m, gamma=0.5)) == [0.5, 0.0, 1.0]
    assert _r5(losses.discounted_returns(r, m, gamma=0.5, reset_on_mask=True)) == [0.0, 0.0, 1.0]


def test_golden_reinforce_pp():
    # §6.3: γ = 1, rewards [0, 0, 1] and [0, 0, 0] → returns [1, 1, 1], [0, 0, 0] → ±0.91287.
    r, m = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), np.ones((2, 3))
    assert _r5(losses.discounted_returns(r, m)) == [1.0] * 3 + [0.0] * 3
    assert _r5(losses.reinforce_pp_advantages(r, m)) == [0.91287] * 3 + [-0.91287] * 3


def test_golden_remax():
    out = losses.remax_advantages([[0.0, 0.0, 1.0]], [0.4], [[1.0, 1.0, 1.0]])
    assert _r5(out) == [0.6, 0.6, 0.6]


@given(data=token_data(), seed=st.integers(0, 2**31 - 1))
def test_remax_matches_reference(data, seed):
    r, m = data
    b = np.random.default_rng(seed).normal(size=r.shape[0])
    out = np.asarray(losses.remax_advantages(r, b, m))
    expected = (returns_ref(r, m, 1.0, False) - b[:, None]) * m
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


@given(n=st.sampled_from([1, 2]), data=st.data())
def test_reinforce_pp_baseline_matches_reference(n, data):
    b, t = data.draw(st.sampled_from([(2, 5), (4, 7)]))
    m = data.draw(hnp.arrays(np.bool_, (b, t))).astype(np.float64)
    rewards = data.draw(hnp.arrays(np.float64, b, elements=st.floats(-3, 3)))
    out = losses.reinforce_pp_baseline_advantages(rewards, m, group_size=n)
    centered = rewards.copy()
    if n > 1:
        for g in range(b // n):
            centered[g * n : (g + 1) * n] -= rewards[g * n : (g + 1) * n].mean()
    expected = whiten_ref(np.repeat(centered[:, None], t, axis=1), m)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-9, atol=1e-9)


def test_reinforce_pp_baseline_singleton_mean_is_zero():
    # group_size=1: μ = 0, so the advantages are the whitened raw rewards (token-weighted).
    m = np.array([[1.0, 1.0], [1.0, 0.0]])
    out = losses.reinforce_pp_baseline_advantages([2.0, 1.0], m, group_size=1)
    expected = whiten_ref(np.array([[2.0, 2.0], [1.0, 0.0]]), m)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-12)


@functools.cache
def _token_estimators():
    return (
        jit_returns(0.9, False),
        jit_returns(0.9, True),
        jax.jit(losses.reinforce_pp_advantages),
        jax.jit(lambda x, m: losses.remax_advantages(x, jax.numpy.linspace(-1, 1, x.shape[0]), m)),
    )


@given(data=token_data(), fill=st.sampled_from(FILLS))
def test_token_estimators_are_nan_safe_on_masked_positions(data, fill):
    r, m = data
    dirty = np.where(m == 0, fill, r)
    for f in _token_estimators():
        out, clean = np.asarray(f(dirty, m)), np.asarray(f(r, m))
        assert np.all(np.isfinite(out)) and np.all(out[m == 0] == 0)
        np.testing.assert_array_equal(out, clean)


def test_token_estimators_vmap_over_stacked_batches():
    rng = np.random.default_rng(3)
    r = rng.normal(size=(3, 2, 5))
    m = (rng.uniform(size=(3, 2, 5)) < 0.7).astype(float)
    out = jax.vmap(functools.partial(losses.reinforce_pp_advantages, gamma=0.9))(r, m)
    for s in range(3):
        expected = whiten_ref(returns_ref(r[s], m[s], 0.9, False), m[s])
        np.testing.assert_allclose(out[s], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: losses.discounted_returns([[1.0]], [[1.0]], gamma=1.5), "gamma must be <= 1.0"),
        (lambda: losses.discounted_returns([1.0], [1.0]), "rewards must be rank 2"),
        (lambda: losses.discounted_returns([[1.0]], [[1.0, 1.0]]), "mask has shape"),
        (
            lambda: losses.discounted_returns([[1.0]], [[1.0]], reset_on_mask=1),
            "reset_on_mask must be a bool",
        ),
        (lambda: losses.remax_advantages([[1.0]], [0.1, 0.2], [[1.0]]), "baseline has shape"),
        (
            lambda: losses.reinforce_pp_baseline_advantages([1.0, 0.0], [[1.0]], group_size=2),
            "mask has 1 rows",
        ),
        (
            lambda: losses.reinforce_pp_baseline_advantages([1.0], [[1.0]], group_size=0),
            "group_size must be an int >= 1",
        ),
        (
            lambda: losses.reinforce_pp_advantages([[1.0]], [[1.0]], eps=-1.0),
            "eps must be > 0.0",
        ),
    ],
)
def test_token_estimator_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
