"""GRPO (mirrors losses/_grpo.py): clip fractions, the clip direction, the KL gradient, clamping,
empty masks, metrics, bad input. Its NumPy reference, on-policy identity, trust region and NaN
safety are properties of the registry's GRPO cases (tests/test_term_properties.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import losses
from tests.cases import GRPO, SHAPE, over, value_and_grad
from tests.strategies import batches


@over(GRPO[:3])  # no KL
@settings(max_examples=max(4, settings.default.max_examples // 3))  # ~the profile's, over the 3
@given(data=batches(shapes=SHAPE, token_advantages=True))
def test_clip_fractions_count_the_clipped_action_tokens(case, data):
    # Where the gradient is zero is tests/test_term_properties.py's trust-region property.
    lp, batch = data
    cfg = case.config
    (_, metrics), _ = value_and_grad(case, lp, batch)
    r = np.exp(lp - np.asarray(batch.old_logprobs))
    a = np.asarray(batch.advantages)
    lo, hi = 1 - cfg.get("clip_low", 0.2), 1 + cfg.get("clip_high", 0.2)
    action = np.asarray(batch.action_mask) > 0
    n = max(action.sum(), 1)
    frac_low = (action & (a < 0) & (r < lo)).sum() / n
    frac_high = (action & (a > 0) & (r > hi)).sum() / n
    assert metrics["clip_frac_low"] == pytest.approx(frac_low)
    assert metrics["clip_frac_high"] == pytest.approx(frac_high)


def test_negative_advantage_clip_is_not_inverted():
    # EasyDeL's defect (docs/sources.md#defects-in-peer-implementations): A=-1, eps=0.2. At r=0.5 PPO's gradient is 0,
    # at r=2.0 it is -A·r·w = +2.0 (in d/dlogp), never the other way round.
    batch = losses.Batch(
        action_mask=jnp.ones((1, 2)),
        advantages=jnp.array([-1.0]),
        sampling_logprobs=jnp.log(jnp.array([[0.2, 0.1]])),
    )
    lp = jnp.log(jnp.array([[0.1, 0.2]]))  # r = 0.5, r = 2.0
    g = jax.grad(lambda x: losses.grpo(reduction="token_sum")(x, batch)[0])(lp)
    np.testing.assert_allclose(np.asarray(g), [[0.0, 2.0]], rtol=1e-12)


@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
def test_kl_penalty_has_a_true_gradient(estimator):
    # The cookbook shipped kl_beta*(pi.detach()-ref): zero gradient. Ours must move p toward ref.
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 3)),
        advantages=jnp.zeros((1,)),
        sampling_logprobs=lp,
        ref_logprobs=jnp.array([[-1.5, -1.0, -0.5]]),
    )
    term = losses.grpo(kl_coef=1.0, kl_estimator=estimator, reduction="token_sum")
    g = np.asarray(jax.grad(lambda x: term(x, batch)[0])(lp))
    delta = np.asarray(lp - batch.ref_logprobs)[0]
    expected = {"k1": np.ones(3), "k2": delta, "k3": 1 - np.exp(-delta)}[estimator]
    np.testing.assert_allclose(g[0], expected, rtol=1e-12, atol=1e-15)
    if estimator != "k1":
        assert g[0, 0] > 0 and g[0, 1] < 0 and g[0, 2] == 0  # descent moves p toward ref


def test_kl_estimators_values_at_small_delta():
    delta = 1e-6
    batch = losses.Batch(
        action_mask=jnp.ones((1, 1)),
        advantages=jnp.zeros(1),
        sampling_logprobs=jnp.array([[-1.0]]),
        ref_logprobs=jnp.array([[-1.0 - delta]]),
    )
    lp = jnp.array([[-1.0]])
    _, m = losses.grpo(kl_coef=1.0, kl_estimator="k3")(lp, batch)
    # k3 = e^-δ + δ - 1 ≈ δ²/2 (expm1 keeps precision).
    assert float(m["kl"]) == pytest.approx(delta**2 / 2, rel=1e-6)


def test_huge_unmasked_log_ratio_is_clamped_not_nan():
    batch = losses.Batch(
        action_mask=jnp.ones((1, 2)),
        advantages=jnp.array([1.0]),
        sampling_logprobs=jnp.array([[-500.0, -1.0]]),
    )
    lp = jnp.array([[-1.0, -1.0]])
    term = losses.grpo(clip_high=1e9)
    value, _ = term(lp, batch)
    g = jax.grad(lambda x: term(x, batch)[0])(lp)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(float(value), -(np.exp(20.0) + 1) / 2, rtol=1e-12)
    assert float(g[0, 0]) == 0.0  # clamped: no gradient beyond max_log_ratio


def test_empty_action_mask_gives_zero_not_nan():
    batch = losses.Batch(
        action_mask=jnp.zeros((2, 3)),
        advantages=jnp.ones(2),
        sampling_logprobs=jnp.full((2, 3), jnp.nan),
        ref_logprobs=jnp.zeros((2, 3)),
    )
    for reduction in losses.REDUCTIONS:
        term = losses.grpo(reduction=reduction, kl_coef=0.1, max_tokens=4)
        (value, metrics), g = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(
            jnp.full((2, 3), -jnp.inf)
        )
        assert float(value) == 0.0
        assert np.all(np.asarray(g) == 0.0)
        assert all(np.isfinite(float(v)) for v in metrics.values())


def test_metrics_are_jax_scalars_under_jit():
    lp = jnp.array([[-1.0, -2.0]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 2)), advantages=jnp.array([1.0]), sampling_logprobs=lp - 0.5
    )
    _, metrics = jax.jit(losses.grpo(kl_coef=0.0))(lp, batch)
    for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "kl"):
        assert metrics[key].shape == ()
    assert float(metrics["ratio_mean"]) == pytest.approx(np.exp(0.5))
    assert float(metrics["clip_frac_high"]) == 1.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(clip_low=-0.1), "clip_low must be >= 0.0"),
        (dict(clip_low=1.0), "clip_low must be < 1"),
        (dict(clip_high=-1), "clip_high must be >= 0.0"),
        (dict(clip_high="a"), "clip_high must be a number"),
        (dict(dual_clip=1.0), "dual_clip must be > 1.0"),
        (dict(kl_coef=-0.1), "kl_coef must be >= 0.0"),
        (dict(kl_coef=float("nan")), "kl_coef must be finite"),
        (dict(kl_estimator="k4"), "unknown kl_estimator 'k4'"),
        (dict(reduction="mean"), "unknown reduction 'mean'"),
        (dict(reduction="seq_mean_token_sum_norm"), "needs max_tokens"),
        (dict(reduction="seq_mean_token_sum_norm", max_tokens=0), "max_tokens must be > 0"),
        (dict(max_tokens=True), "max_tokens must be a positive number"),
        (dict(max_log_ratio=0), "max_log_ratio must be > 0.0"),
    ],
)
def test_grpo_rejects_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        losses.grpo(**kwargs)


def test_grpo_rejects_missing_fields_and_bad_shapes():
    lp = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="needs batch field 'old_logprobs'"):
        losses.grpo()(lp, losses.Batch(action_mask=jnp.ones((1, 2)), advantages=jnp.ones(1)))
    with pytest.raises(ValueError, match="needs batch field 'advantages'"):
        losses.grpo()(lp, losses.Batch(action_mask=jnp.ones((1, 2)), sampling_logprobs=lp))
    with pytest.raises(ValueError, match="needs batch field 'ref_logprobs'"):
        losses.grpo(kl_coef=0.1)(
            lp,
            losses.Batch(
                action_mask=jnp.ones((1, 2)), advantages=jnp.ones(1), sampling_logprobs=lp
            ),
        )
    with pytest.raises(ValueError, match=r"logprobs has shape \(1, 3\), expected \(1, 2\)"):
        losses.grpo()(
            jnp.zeros((1, 3)),
            losses.Batch(
                action_mask=jnp.ones((1, 2)), advantages=jnp.ones(1), sampling_logprobs=lp
            ),
        )
