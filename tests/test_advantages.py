"""group_advantages against a NumPy reference, plus its properties and errors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import losses


def ref(rewards, n, estimator, eps):
    out = np.zeros_like(rewards)
    for g in range(len(rewards) // n):
        r = rewards[g * n : (g + 1) * n]
        for i in range(n):
            others = np.delete(r, i)
            if estimator == "grpo":
                out[g * n + i] = (r[i] - r.mean()) / (r.std(ddof=1) + eps)
            elif estimator == "dr_grpo":
                out[g * n + i] = r[i] - r.mean()
            else:
                out[g * n + i] = r[i] - others.mean()
    return out


@given(
    n=st.sampled_from([2, 4]),
    groups=st.sampled_from([1, 3]),
    estimator=st.sampled_from(losses.ESTIMATORS),
    data=st.data(),
)
def test_group_advantages_match_reference(n, groups, estimator, data):
    rewards = data.draw(hnp.arrays(np.float64, n * groups, elements=st.floats(-5, 5)))
    adv = np.asarray(losses.group_advantages(rewards, group_size=n, estimator=estimator))
    np.testing.assert_allclose(adv, ref(rewards, n, estimator, 1e-6), rtol=1e-9, atol=1e-9)
    # Each group's advantages sum to zero.
    np.testing.assert_allclose(adv.reshape(groups, n).sum(axis=1), 0.0, atol=1e-9)


def test_constant_groups_get_zero_advantage():
    for est in losses.ESTIMATORS:
        adv = losses.group_advantages(np.array([1.0, 1.0, 0.0, 1.0]), group_size=2, estimator=est)
        assert np.all(np.asarray(adv)[:2] == 0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rewards=[1.0, 2.0], group_size=1), "group_size must be an int >= 2"),
        (dict(rewards=[1.0, 2.0, 3.0], group_size=2), "positive multiple of group_size=2"),
        (dict(rewards=[[1.0, 2.0]], group_size=2), "rewards must be rank 1"),
        (dict(rewards=[1.0, 2.0], group_size=2, estimator="ppo"), "unknown estimator 'ppo'"),
        (dict(rewards=[1.0, 2.0], group_size=2, eps=0.0), "eps must be > 0.0"),
    ],
)
def test_group_advantages_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        losses.group_advantages(**kwargs)
