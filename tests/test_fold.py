"""`losses.fold` (mirrors losses/_fold.py): value, gradient and metrics are sums of the folded
terms', a zero-coefficient env term changes nothing, bad terms are rejected, nested folds.

The batches have the registry's shape (tests/cases.py), so the GRPO terms share its compilations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import losses
from tests import numpy_ref
from tests.cases import FOLD_ENV_COEF, GRPO_CONFIGS, SHAPE, spec, value_and_grad
from tests.strategies import batches


@given(data=batches(shapes=SHAPE), cfg=st.sampled_from(GRPO_CONFIGS))
def test_fold_value_and_gradient_are_sums(data, cfg):
    lp, batch = data
    (vf, mf), gf = value_and_grad(spec("fold", **cfg), lp, batch)
    (vp, mp), gp = value_and_grad(spec("grpo", **cfg), lp, batch)
    (ve, me), ge = value_and_grad(spec("echo_env", coef=FOLD_ENV_COEF), lp, batch)
    ref_p = numpy_ref.grpo_ref(lp, batch, **cfg)
    ref_e = numpy_ref.echo_env_ref(lp, batch, coef=FOLD_ENV_COEF)
    np.testing.assert_allclose(vf, ref_p[0] + ref_e[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gf, ref_p[1] + ref_e[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vf, vp + ve, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gf, gp + ge, rtol=1e-12, atol=1e-15)
    assert mf["grpo/loss"] == mp["loss"] and mf["echo_env/nll"] == me["nll"]
    assert mf["loss"] == vf


@given(data=batches(shapes=SHAPE), cfg=st.sampled_from(GRPO_CONFIGS))
def test_fold_with_zero_coef_env_is_the_policy_bit_for_bit(data, cfg):
    lp, batch = data
    policy = spec("grpo", **cfg).term()
    folded = losses.fold(policy, losses.echo_env(coef=0.0))
    (v0, _), g0 = jax.value_and_grad(lambda x: policy(x, batch), has_aux=True)(lp)
    (v1, _), g1 = jax.value_and_grad(lambda x: folded(x, batch), has_aux=True)(lp)
    assert np.asarray(v0).tobytes() == np.asarray(v1).tobytes()
    assert np.asarray(g0).tobytes() == np.asarray(g1).tobytes()


def test_fold_is_linear_for_repeated_terms():
    lp = jnp.array([[-1.0, -2.0, -0.3]])
    batch = losses.Batch(
        action_mask=jnp.array([[1.0, 1, 0]]),
        advantages=jnp.array([0.7]),
        sampling_logprobs=lp - 0.1,
    )
    f = losses.grpo()
    folded = losses.fold(("a", f), ("b", f), ("c", f))
    g1 = jax.grad(lambda x: f(x, batch)[0])(lp)
    g3 = jax.grad(lambda x: folded(x, batch)[0])(lp)
    np.testing.assert_allclose(np.asarray(g3), 3 * np.asarray(g1), rtol=1e-14)


def test_fold_rejects_bad_terms():
    g = losses.grpo()
    with pytest.raises(ValueError, match="duplicate term name 'grpo'"):
        losses.fold(g, losses.grpo())
    with pytest.raises(ValueError, match="needs at least one term"):
        losses.fold()
    with pytest.raises(ValueError, match="cannot name term"):
        losses.fold(lambda lp, b: (0.0, {}))
    with pytest.raises(ValueError, match="must be a term or a"):
        losses.fold(("a", g, 1))
    with pytest.raises(ValueError, match="is not callable"):
        losses.fold(3)
    with pytest.raises(ValueError, match="contain no '/'"):
        losses.fold(("a/b", g))
    with pytest.raises(ValueError, match="'loss' is reserved"):
        losses.fold(("loss", g))
    bad = losses.fold(("vec", lambda lp, b: (lp.sum(axis=1), {})))
    with pytest.raises(ValueError, match="returned a loss of shape"):
        bad(jnp.zeros((2, 2)), losses.Batch(action_mask=jnp.ones((2, 2))))


def test_nested_fold_namespaces_metrics():
    inner = losses.fold(losses.grpo(), losses.echo_env())
    outer = losses.fold(("rl", inner), ("sft", losses.sft_cross_entropy()))
    batch = losses.Batch(
        action_mask=jnp.array([[1.0, 0]]),
        obs_mask=jnp.array([[0.0, 1]]),
        advantages=jnp.ones(1),
        sampling_logprobs=jnp.array([[-1.0, -1.0]]),
    )
    _, m = outer(jnp.array([[-1.0, -2.0]]), batch)
    assert {"rl/grpo/loss", "rl/echo_env/loss", "rl/loss", "sft/loss", "loss"} <= set(m)
