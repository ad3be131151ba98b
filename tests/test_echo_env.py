"""ECHO env cross-entropy (mirrors losses/_env.py): gradient = -w, linearity, golden values,
observation masks. Its NumPy reference (and metrics) is a property of the registry's echo_env
cases (tests/test_term_properties.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import losses
from tests.cases import ENV_CONFIGS, spec, value_and_grad
from tests.strategies import batches


@given(data=batches(), cfg=st.sampled_from(ENV_CONFIGS))
def test_echo_env_gradient_is_exactly_minus_weights(data, cfg):
    lp, batch = data
    _, grad = value_and_grad(spec("echo_env", **cfg), lp, batch)
    w = np.asarray(
        losses.echo_env_weights(
            batch, **{"coef": 0.05, "normalization": "seq_mean_token_mean", **cfg}
        )
    )
    np.testing.assert_array_equal(grad, -w)


@given(data=batches(), k=st.sampled_from([0.0, 0.5, 3.0]))
def test_echo_env_is_linear_in_coef(data, k):
    lp, batch = data
    (v1, _), g1 = value_and_grad(spec("echo_env", coef=0.2), lp, batch)
    (vk, _), gk = value_and_grad(spec("echo_env", coef=0.2 * k), lp, batch)
    np.testing.assert_allclose(vk, k * v1, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gk, k * g1, rtol=1e-12, atol=1e-15)


@given(data=batches(), c=st.floats(0.1, 5.0))
def test_echo_env_constant_nll_gives_coef_times_c(data, c):
    lp, batch = data
    obs = np.asarray(batch.obs_mask) > 0
    lp = np.where(obs, -c, lp)
    (value, _), _ = value_and_grad(
        spec("echo_env", coef=0.3, normalization="token_mean"), lp, batch
    )
    assert value == pytest.approx(0.3 * c if obs.any() else 0.0, rel=1e-12)
    assert value >= 0


def test_length_normalization_duplicating_obs_tokens():
    # Duplicating every obs token of a row keeps seq_mean_token_mean and doubles token_sum.
    lp1 = jnp.array([[-1.0, -2.0, 0.0, 0.0]])
    lp2 = jnp.array([[-1.0, -2.0, -1.0, -2.0]])
    b1 = losses.Batch(action_mask=jnp.zeros((1, 4)), obs_mask=jnp.array([[1.0, 1, 0, 0]]))
    b2 = losses.Batch(action_mask=jnp.zeros((1, 4)), obs_mask=jnp.ones((1, 4)))
    mean = losses.echo_env(coef=1.0)
    tsum = losses.echo_env(coef=1.0, normalization="token_sum")
    assert float(mean(lp1, b1)[0]) == float(mean(lp2, b2)[0]) == 1.5
    assert float(tsum(lp2, b2)[0]) == 2 * float(tsum(lp1, b1)[0]) == 6.0


def test_rows_without_observations_count_in_n_only():
    lp = jnp.array([[-1.0, -3.0], [-5.0, -5.0]])
    with_obs = losses.Batch(
        action_mask=jnp.array([[0.0, 0], [1, 1]]), obs_mask=jnp.array([[1.0, 1], [0, 0]])
    )
    term = losses.echo_env(coef=1.0)
    value, metrics = term(lp, with_obs)
    assert float(value) == pytest.approx(2.0 / 2)  # mean NLL 2 of row 0, N = 2 active rows
    assert float(metrics["rows_with_obs"]) == 1.0
    pad = losses.Batch(
        action_mask=jnp.array([[0.0, 0], [0, 0]]), obs_mask=jnp.array([[1.0, 1], [0, 0]])
    )
    assert float(term(lp, pad)[0]) == pytest.approx(2.0)  # an all-zero row is padding, not N


def test_empty_observations_give_exact_zero_value_and_gradient():
    lp = jnp.full((2, 3), jnp.nan)
    for obs in (None, jnp.zeros((2, 3))):
        batch = losses.Batch(action_mask=jnp.zeros((2, 3)), obs_mask=obs)
        for norm in losses.ENV_NORMALIZATIONS:
            term = losses.echo_env(normalization=norm)
            (value, metrics), g = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(lp)
            assert float(value) == 0.0
            assert np.all(np.asarray(g) == 0.0)
            assert all(np.isfinite(float(v)) for v in metrics.values())


# --- Golden values: rllm tests/unified_trainer/test_aux_loss.py (docs/echo.md#edge-cases) ---------------


def test_golden_inprocess_env_loss_equals_paper_l_env():  # rllm test 15
    nll = jnp.array([[1, 2, 0.5, 0.5, 1, 3], [1, 0.8, 2, 0, 0, 0]], dtype=jnp.float64)
    obs = jnp.array([[0, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0]], dtype=jnp.float64)
    batch = losses.Batch(action_mask=jnp.zeros_like(obs), obs_mask=obs)
    value, _ = losses.echo_env(coef=1.0)(-nll, batch)
    assert float(value) == pytest.approx(((0.5 + 0.5 + 1) / 3 + 0.8) / 2, abs=1e-6)
    assert float(value) == pytest.approx(0.733333333, abs=1e-6)


def test_golden_inprocess_empty_obs_is_safe():  # rllm test 16
    batch = losses.Batch(action_mask=jnp.zeros((2, 6)), obs_mask=jnp.zeros((2, 6)))
    value, _ = losses.echo_env(coef=1.0)(-jnp.ones((2, 6)), batch)
    assert float(value) == 0.0


def test_golden_fireworks_client_fold_equals_paper_l_env():  # rllm test 17
    action = jnp.array([[1, 1, 0, 0, 0, 1], [1, 0, 1, 1, 1, 1]], dtype=jnp.float64)
    nll = jnp.array([[1, 2, 0.5, 0.5, 1, 3], [1, 0.8, 2, 0.1, 0.2, 0.3]], dtype=jnp.float64)
    # The managed convention: every non-action target is an observation.
    obs = losses.observation_mask(action, jnp.ones_like(action), include_prompt=True)
    batch = losses.Batch(action_mask=action, obs_mask=obs)
    value, _ = losses.echo_env(coef=0.05)(-nll, batch)
    assert float(value) == pytest.approx(0.05 * ((2 / 3) + 0.8) / 2, abs=1e-9)
    assert float(value) == pytest.approx(0.036667, abs=1e-6)


def test_golden_weighted_ce_adds_term_and_gradient():  # rllm test 18
    lp = jnp.array([[-1.0, -2.0, -3.0]])
    batch = losses.Batch(action_mask=jnp.zeros((1, 3)), weights=jnp.array([[0.0, 0.5, 0.0]]))
    inner = ("policy", lambda x, b: (jnp.zeros(()), {}))
    term = losses.fold(inner, ("aux_env_prediction", losses.weighted_cross_entropy()))
    (value, metrics), g = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(lp)
    assert float(value) == 1.0
    assert float(metrics["aux_env_prediction/loss"]) == 1.0
    np.testing.assert_array_equal(np.asarray(g), [[0.0, -0.5, 0.0]])


def test_golden_skips_rows_without_weights_and_accumulates_on_policy():  # rllm test 19
    lp = jnp.array([[-1.0, -2.0], [-7.0, -9.0]])
    batch = losses.Batch(action_mask=jnp.zeros((2, 2)), weights=jnp.array([[1.0, 0.0], [0.0, 0.0]]))
    inner = ("policy", lambda x, b: (jnp.asarray(5.0), {}))
    term = losses.fold(inner, ("aux", losses.weighted_cross_entropy()))
    (value, metrics), g = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(lp)
    assert float(value) == 6.0 and "aux/loss" in metrics
    np.testing.assert_array_equal(np.asarray(g)[1], [0.0, 0.0])


def test_golden_echo_rl_zero_tokens_loss_zero_gradient_zero():  # echo-rl §3.3
    batch = losses.Batch(action_mask=jnp.ones((1, 2)), obs_mask=jnp.zeros((1, 2)))
    (value, m), g = jax.value_and_grad(lambda x: losses.echo_env()(x, batch), has_aux=True)(
        jnp.array([[-1.0, -2.0]])
    )
    assert float(value) == 0.0 and np.all(np.asarray(g) == 0) and float(m["num_obs_tokens"]) == 0


# --- observation_mask ------------------------------------------------------------------------


def test_observation_mask_conventions():
    # prompt P P | action A A | obs O O | action A | pad
    action = jnp.array([[0, 0, 1, 1, 0, 0, 1, 0]], dtype=jnp.float32)
    valid = jnp.array([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=jnp.float32)
    paper = losses.observation_mask(action, valid)
    np.testing.assert_array_equal(np.asarray(paper), [[0, 0, 0, 0, 1, 1, 0, 0]])
    managed = losses.observation_mask(action, valid, include_prompt=True)
    np.testing.assert_array_equal(np.asarray(managed), [[1, 1, 0, 0, 1, 1, 0, 0]])
    # prompt of 2 tokens: targets t < 1 are prompt; target 1 (token 2) is not.
    with_len = losses.observation_mask(action, valid, prompt_lengths=jnp.array([2]))
    np.testing.assert_array_equal(np.asarray(with_len), [[0, 1, 0, 0, 1, 1, 0, 0]])
    assert paper.dtype == jnp.float32


@given(data=batches())
def test_observation_mask_properties(data):
    _, batch = data
    action = np.asarray(batch.action_mask)
    valid = np.asarray(batch.action_mask + batch.obs_mask)
    for include in (False, True):
        obs = np.asarray(losses.observation_mask(action, valid, include_prompt=include))
        assert not np.any((obs > 0) & (action > 0))
        assert not np.any((obs > 0) & (valid == 0))
    paper = np.asarray(losses.observation_mask(action, valid))
    managed = np.asarray(losses.observation_mask(action, valid, include_prompt=True))
    assert np.all(paper <= managed)


def test_observation_mask_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must both be"):
        losses.observation_mask(jnp.ones((2, 3)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="prompt_lengths has shape"):
        losses.observation_mask(jnp.ones((2, 3)), jnp.ones((2, 3)), prompt_lengths=jnp.ones(3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(coef=-1.0), "coef must be >= 0.0"),
        (dict(coef=float("inf")), "coef must be finite"),
        (dict(normalization="seq_mean"), "unknown normalization 'seq_mean'"),
    ],
)
def test_echo_env_rejects_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        losses.echo_env(**kwargs)
