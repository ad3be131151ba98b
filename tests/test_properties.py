"""Properties shared by every term: references, fold, invariances, split_batch, jit, batch grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import losses
from tests import numpy_ref
from tests.helpers import ALL_TERMS, term, value_and_grad
from tests.strategies import GRPO_CONFIGS, SFT_CONFIGS, batches

term_cases = st.sampled_from(ALL_TERMS)


@given(data=batches(), cfg=st.sampled_from(SFT_CONFIGS))
def test_sft_cross_entropy_matches_numpy_reference(data, cfg):
    lp, batch = data
    (value, metrics), grad = value_and_grad("sft", cfg, lp, batch)
    ref_value, ref_grad = numpy_ref.sft_ref(lp, batch, **cfg)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert metrics["num_tokens"] == np.asarray(batch.action_mask).sum()


@given(data=batches())
def test_weighted_cross_entropy_matches_numpy_reference(data):
    lp, batch = data
    (value, _), grad = value_and_grad("wce", {}, lp, batch)
    ref_value, ref_grad = numpy_ref.weighted_ce_ref(lp, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(grad, ref_grad)


@given(data=batches(), cfg=st.sampled_from(GRPO_CONFIGS))
def test_fold_value_and_gradient_are_sums(data, cfg):
    lp, batch = data
    (vf, mf), gf = value_and_grad("fold", cfg, lp, batch)
    (vp, mp), gp = value_and_grad("grpo", cfg, lp, batch)
    (ve, me), ge = value_and_grad("echo_env", dict(coef=0.3), lp, batch)
    ref_p = numpy_ref.grpo_ref(lp, batch, **cfg)
    ref_e = numpy_ref.echo_env_ref(lp, batch, coef=0.3)
    np.testing.assert_allclose(vf, ref_p[0] + ref_e[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gf, ref_p[1] + ref_e[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vf, vp + ve, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gf, gp + ge, rtol=1e-12, atol=1e-15)
    assert mf["grpo/loss"] == mp["loss"] and mf["echo_env/nll"] == me["nll"]
    assert mf["loss"] == vf


@given(data=batches(), cfg=st.sampled_from(GRPO_CONFIGS))
def test_fold_with_zero_coef_env_is_the_policy_bit_for_bit(data, cfg):
    lp, batch = data
    policy = term("grpo", tuple(sorted(cfg.items())))
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


@given(data=batches(), case=term_cases, seed=st.integers(0, 2**31 - 1))
def test_row_permutation_invariance(data, case, seed):
    lp, batch = data
    perm = np.random.default_rng(seed).permutation(lp.shape[0])
    permuted = jax.tree.map(lambda x: x[perm] if x.ndim >= 1 else x, batch)
    (v0, _), g0 = value_and_grad(*case, lp, batch)
    (v1, _), g1 = value_and_grad(*case, lp[perm], permuted)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, g0[perm], rtol=1e-12, atol=1e-14)


@given(
    data=batches(shapes=[(2, 5)]), case=term_cases, fill=st.sampled_from([np.nan, -np.inf, -3.0])
)
def test_padding_rows_and_columns_change_nothing(data, case, fill):
    lp, batch = data

    def pad(x, value):
        if x.ndim == 1:
            return np.concatenate([np.asarray(x), np.full((2,), value)])
        x = np.pad(np.asarray(x), ((0, 0), (0, 2)), constant_values=value)
        return np.concatenate([x, np.full((2, x.shape[1]), value)])

    fields = {}
    for name, value in batch.fields.items():
        if value is None or name.startswith("num_"):
            continue
        masked_value = 0.0 if name in ("action_mask", "obs_mask", "weights") else fill
        fields[name] = pad(value, masked_value)
    padded = losses.Batch(**fields)
    lp_padded = pad(lp, fill)
    (v0, _), g0 = value_and_grad(*case, lp, batch)
    (v1, m1), g1 = value_and_grad(*case, lp_padded, padded)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1[:2, :5], g0, rtol=1e-12, atol=1e-14)
    assert np.all(g1[2:] == 0) and np.all(g1[:, 5:] == 0)
    assert all(np.isfinite(v) for v in m1.values())


@given(data=batches(shapes=[(4, 7)]), case=term_cases, k=st.sampled_from([2, 3, 4]))
def test_split_batch_reproduces_full_batch(data, case, k):
    lp, batch = data
    (v_full, _), g_full = value_and_grad(*case, lp, batch)
    parts = losses.split_batch(batch, k)
    slices = losses.row_slices(lp.shape[0], k)
    values, grads = [], []
    for sl, part in zip(slices, parts, strict=True):
        (v, _), g = value_and_grad(*case, lp[sl], part)
        values.append(v)
        grads.append(g)
    np.testing.assert_allclose(sum(values), v_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-12, atol=1e-14)


def test_split_batch_without_normalizers_would_differ():
    # Regression for the chunk-normalization bug (rllm #782, echo.md E7): per-micro-batch
    # denominators inflate the loss. split_batch must not behave like that.
    lp = -jnp.ones((2, 2))
    batch = losses.Batch(
        action_mask=jnp.array([[1.0, 1], [1, 0]]), advantages=jnp.ones(2), sampling_logprobs=lp
    )
    t = losses.sft_cross_entropy()
    full = float(t(lp, batch)[0])
    naive = sum(
        float(t(lp[i : i + 1], losses.Batch(action_mask=batch.action_mask[i : i + 1]))[0])
        for i in range(2)
    )
    carried = sum(float(t(lp[i : i + 1], p)[0]) for i, p in enumerate(losses.split_batch(batch, 2)))
    assert naive == pytest.approx(2.0) and full == carried == pytest.approx(1.0)


def test_split_batch_rejects_bad_counts_and_splits_extra_fields():
    batch = losses.Batch(
        action_mask=jnp.ones((3, 2)), extra_rows=jnp.arange(3.0), scalar=jnp.ones(())
    )
    for k in (0, 4, 1.5, True):
        with pytest.raises(ValueError, match="num_microbatches"):
            losses.split_batch(batch, k)
    parts = losses.split_batch(batch, 2)
    assert [p.shape[0] for p in parts] == [2, 1]
    np.testing.assert_array_equal(np.asarray(parts[1].extra_rows), [2.0])
    assert parts[1].scalar.shape == ()
    assert float(parts[1].num_rows) == 3.0 and float(parts[1].num_action_tokens) == 6.0


@given(data=batches(shapes=[(2, 5)]), case=term_cases)
def test_jit_equals_eager(data, case):
    lp, batch = data
    t = term(case[0], tuple(sorted(case[1].items())))
    v_eager, m_eager = t(jnp.asarray(lp), batch)
    v_jit, m_jit = jax.jit(t)(jnp.asarray(lp), batch)
    np.testing.assert_allclose(float(v_jit), float(v_eager), rtol=1e-13, atol=1e-15)
    for key in m_eager:
        np.testing.assert_allclose(float(m_jit[key]), float(m_eager[key]), rtol=1e-13, atol=1e-15)


@given(data=batches(shapes=[(2, 5)]), case=term_cases)
def test_gradient_with_respect_to_batch_fields_is_zero(data, case):
    lp, batch = data
    t = term(case[0], tuple(sorted(case[1].items())))
    batch = jax.tree.map(jnp.asarray, batch)
    g = jax.grad(lambda b: t(jnp.asarray(lp), b)[0])(batch)
    for name, value in g.fields.items():
        if value is not None:
            assert np.all(np.asarray(value) == 0.0), name


@given(data=batches(shapes=[(2, 5)]), case=term_cases)
def test_vmap_over_a_stack_of_batches(data, case):
    lp, batch = data
    t = term(case[0], tuple(sorted(case[1].items())))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)
    values, _ = jax.vmap(t)(jnp.stack([lp, lp]), stacked)
    v, _ = t(jnp.asarray(lp), batch)
    np.testing.assert_allclose(np.asarray(values), [float(v)] * 2, rtol=1e-13, atol=1e-15)
