"""The critic (losses/_critic.py): `gae`, `masked_whiten` and the `value_loss` term.

Each is checked against an independent NumPy loop reference (float64), the golden values of
docs/sources.md#critic-and-advantage-estimators, NaN safety on masked positions, and, for the term,
split_batch exactness, permutation and padding invariance, jit and vmap.
"""

from __future__ import annotations

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import losses
import losses._critic
from tests import numpy_ref

SHAPES = [(1, 1), (2, 5), (4, 7)]
B, T = 4, 6
FILLS = [np.nan, np.inf, -np.inf, 1e30]
#: (gamma, lam) pairs: each compiles `gae` once per shape.
GAE_PARAMS = [(1.0, 1.0), (0.99, 0.95), (1.0, 0.5), (0.0, 0.3)]
VALUE_CONFIGS = [
    dict(),
    dict(clip=None, reduction="seq_mean_token_mean"),
    dict(clip=0.2, reduction="token_sum"),
    dict(clip=0.3, reduction="seq_mean_token_sum_norm", max_tokens=8),
    dict(clip=1.0, reduction="seq_mean_token_sum"),
]
few = settings(max_examples=max(4, settings.default.max_examples // 3))


def _floats(shape, lo, hi):
    el = st.floats(lo, hi, allow_nan=False, allow_subnormal=False, width=64).map(
        lambda x: 0.0 if abs(x) < 1e-30 else x
    )
    return hnp.arrays(np.float64, shape, elements=el)


# -- NumPy references (loops; no code shared with losses/) -------------------------------------


def gae_ref(rewards, values, mask, gamma, lam):
    """verl's skip rule, row by row; 0 on masked positions."""
    b, t = rewards.shape
    adv, ret = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        next_v, last = 0.0, 0.0
        for j in reversed(range(t)):
            if mask[i, j] == 0:
                continue
            delta = rewards[i, j] + gamma * next_v - values[i, j]
            last = delta + gamma * lam * last
            next_v = values[i, j]
            adv[i, j] = last
            ret[i, j] = last + values[i, j]
    return adv, ret


def whiten_ref(x, mask, shift_mean=True, eps=1e-8):
    sel = [float(v) for v, m in zip(np.ravel(x), np.ravel(mask), strict=True) if m > 0]
    out = np.zeros(np.shape(x))
    if not sel:
        return out
    mean = sum(sel) / len(sel)
    var = sum((v - mean) ** 2 for v in sel) / (len(sel) - 1) if len(sel) > 1 else 0.0
    for idx in zip(*np.nonzero(np.asarray(mask) > 0), strict=True):
        y = (x[idx] - mean) / np.sqrt(var + eps)
        out[idx] = y if shift_mean else y + mean
    return out


def value_loss_ref(values, batch, *, clip=0.5, reduction="token_mean", max_tokens=None):
    """(value, grad[B, T]) of ½·Σ w·max((v − R)², (v_clip − R)²)."""
    action = np.asarray(batch.action_mask)
    obs = np.asarray(batch.obs_mask) if batch.obs_mask is not None else np.zeros_like(action)
    rows = numpy_ref.active_row_count(action, obs)
    w = numpy_ref.reduction_weights(action, reduction, rows, max_tokens)
    ret = np.asarray(batch.returns)
    old = None if batch.old_values is None else np.asarray(batch.old_values)
    value, grad, clipped_larger = 0.0, np.zeros_like(values), 0
    for i, j in zip(*np.nonzero(action), strict=True):
        v, r = values[i, j], ret[i, j]
        l1 = (v - r) ** 2
        if clip is not None:
            vc = min(max(v, old[i, j] - clip), old[i, j] + clip)
            l2 = (vc - r) ** 2
        if clip is not None and l2 > l1:
            loss, g = l2, 0.0
            clipped_larger += 1
        else:
            loss, g = l1, v - r
        value += 0.5 * w[i, j] * loss
        grad[i, j] = w[i, j] * g
    frac = clipped_larger / max(action.sum(), 1)
    return value, grad, frac


# -- strategies ---------------------------------------------------------------------------------


@st.composite
def token_data(draw, shapes=SHAPES):
    b, t = draw(st.sampled_from(shapes))
    mask = draw(hnp.arrays(np.bool_, (b, t))).astype(np.float64)
    return draw(_floats((b, t), -3, 3)), draw(_floats((b, t), -3, 3)), mask


@st.composite
def critic_batches(draw, shapes=((B, T),)):
    """(values[B, T], Batch) with old values within ±1 of the values (both clip sides occur)."""
    b, t = draw(st.sampled_from(shapes))
    action = draw(hnp.arrays(np.bool_, (b, t)))
    obs = draw(hnp.arrays(np.bool_, (b, t))) & ~action
    values = draw(_floats((b, t), -3, 3))
    batch = losses.Batch(
        action_mask=action.astype(np.float64),
        obs_mask=obs.astype(np.float64),
        old_values=values + draw(_floats((b, t), -1, 1)),
        returns=draw(_floats((b, t), -3, 3)),
    )
    return values, batch


# -- cached jitted functions --------------------------------------------------------------------


@functools.cache
def jit_gae(gamma, lam):
    return jax.jit(functools.partial(losses.gae, gamma=gamma, lam=lam))


@functools.cache
def value_term(frozen):
    return losses.value_loss(**dict(frozen))


@functools.cache
def _jitted_value(frozen):
    t = value_term(frozen)

    def f(v, batch):
        (value, metrics), (g_v, g_batch) = jax.value_and_grad(
            lambda x, b: t(x, b), argnums=(0, 1), has_aux=True
        )(v, batch)
        g_metrics = jax.grad(lambda x: sum(t(x, batch)[1].values()))(v)
        return value, metrics, g_v, g_batch, g_metrics

    return jax.jit(f)


def vg(cfg, values, batch):
    """((value, metrics), grad) of value_loss(**cfg); checks batch gradients and metrics are 0."""
    out = _jitted_value(tuple(sorted(cfg.items())))(jnp.asarray(values), batch)
    value, metrics, g_v, g_batch, g_metrics = jax.device_get(out)
    for name, g in g_batch.fields.items():
        assert g is None or not np.any(g), f"gradient reaches batch field {name}"
    assert not np.any(g_metrics), "a metric is not stop-gradient"
    return (float(value), {k: float(v) for k, v in metrics.items()}), np.asarray(g_v)


def over_configs():
    return pytest.mark.parametrize("cfg", VALUE_CONFIGS, ids=[str(c) for c in VALUE_CONFIGS])


# -- gae: golden values (§6.2) ------------------------------------------------------------------


def _round(x):
    return [float(f"{v:.5g}") for v in np.ravel(x)]


@pytest.mark.parametrize(
    "lam, adv, ret",
    [(1.0, [0.5, 0.4, 0.3], [1.0, 1.0, 1.0]), (0.5, [0.225, 0.25, 0.3], [0.725, 0.85, 1.0])],
)
def test_gae_golden_all_valid(lam, adv, ret):
    a, r = losses.gae([[0.0, 0.0, 1.0]], [[0.5, 0.6, 0.7]], [[1.0, 1.0, 1.0]], gamma=1.0, lam=lam)
    assert _round(a) == adv
    assert _round(r) == ret


def test_gae_golden_middle_masked_is_verl_not_openrlhf_or_skyrl():
    # §6.2: m = [1, 0, 1], V = [0.5, 9.0, 0.7]. verl skips the masked token: [0.35, ·, 0.3]
    # (OpenRLHF −0.075 and SkyRL 4.425 at t = 0); our masked output is 0 (verl carries 0.3).
    r, v, m = [[0.0, 0.0, 1.0]], [[0.5, 9.0, 0.7]], [[1.0, 0.0, 1.0]]
    a, ret = losses.gae(r, v, m, gamma=1.0, lam=0.5)
    assert _round(a) == [0.35, 0.0, 0.3]
    assert _round(ret) == [0.85, 0.0, 1.0]
    a1, _ = losses.gae(r, v, m, gamma=1.0, lam=1.0)
    assert _round(a1)[0] == 0.5  # the sum telescopes: all three libraries agree at λ = 1
    # A masked value of 9.0 must not matter at all.
    a9, _ = losses.gae(r, [[0.5, -123.0, 0.7]], m, gamma=1.0, lam=0.5)
    np.testing.assert_array_equal(np.asarray(a9), np.asarray(a))


def test_gae_reward_on_masked_token_is_discarded():
    a, _ = losses.gae([[0.0, 5.0, 1.0]], [[0.5, 0.0, 0.7]], [[1.0, 0.0, 1.0]], gamma=1.0, lam=0.5)
    assert _round(a) == [0.35, 0.0, 0.3]


# -- gae: NumPy reference, NaN safety, jit/vmap ---------------------------------------------------


@given(data=token_data(), params=st.sampled_from(GAE_PARAMS))
def test_gae_matches_numpy_loop(data, params):
    r, v, m = data
    gamma, lam = params
    adv, ret = jax.device_get(jit_gae(gamma, lam)(r, v, m))
    ref_adv, ref_ret = gae_ref(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-12, atol=1e-12)
    assert np.all(adv[m == 0] == 0) and np.all(ret[m == 0] == 0)


@few
@given(data=token_data(), fill=st.sampled_from(FILLS), params=st.sampled_from(GAE_PARAMS))
def test_gae_masked_nan_inf_do_not_leak(data, fill, params):
    r, v, m = data
    gamma, lam = params
    masked = m == 0
    dirty = jit_gae(gamma, lam)(np.where(masked, fill, r), np.where(masked, -fill, v), m)
    clean = jit_gae(gamma, lam)(r, v, m)
    for x, y in zip(jax.device_get(dirty), jax.device_get(clean), strict=True):
        assert np.all(np.isfinite(x))
        np.testing.assert_array_equal(x, y)
    # Differentiating through gae (e.g. a user's critic) stays finite and zero off the mask.
    g = jax.grad(
        lambda vv: jnp.sum(losses.gae(np.where(masked, fill, r), vv, m, gamma=gamma, lam=lam)[0])
    )(jnp.asarray(np.where(masked, fill, v)))
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[masked] == 0)


def test_gae_jit_and_vmap_over_stacked_batches():
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(3, 2, 5)), rng.normal(size=(3, 2, 5))
    m = (rng.uniform(size=(3, 2, 5)) < 0.7).astype(float)
    f = functools.partial(losses.gae, gamma=0.99, lam=0.95)
    adv, ret = jax.vmap(f)(r, v, m)
    for s in range(3):
        ref_adv, ref_ret = gae_ref(r[s], v[s], m[s], 0.99, 0.95)
        np.testing.assert_allclose(adv[s], ref_adv, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ret[s], ref_ret, rtol=1e-12, atol=1e-12)
    jitted = jax.jit(losses.gae, static_argnames=("gamma", "lam"))
    adv_j, _ = jitted(r[0], v[0], m[0], gamma=0.99, lam=0.95)
    np.testing.assert_array_equal(np.asarray(adv_j), np.asarray(adv[0]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gamma=1.1, lam=1.0), "gae: gamma must be <= 1.0"),
        (dict(gamma=1.0, lam=-0.1), "gae: lam must be >= 0.0"),
        (dict(gamma=True, lam=1.0), "gae: gamma must be a number"),
        (dict(gamma=1.0, lam=1.0, values=[[1.0, 2.0]]), "values has shape"),
        (dict(gamma=1.0, lam=1.0, rewards=[1.0, 2.0, 3.0]), "rewards must be rank 2"),
    ],
)
def test_gae_errors(kwargs, message):
    args = dict(rewards=[[0.0, 0.0, 1.0]], values=[[0.5, 0.6, 0.7]], mask=[[1.0, 1.0, 1.0]])
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        losses.gae(args.pop("rewards"), args.pop("values"), args.pop("mask"), **args)


# -- masked_whiten ----------------------------------------------------------------------------


@given(data=token_data(), shift_mean=st.booleans(), fill=st.sampled_from(FILLS))
def test_masked_whiten_matches_reference_and_is_nan_safe(data, shift_mean, fill):
    x, _, m = data
    out = np.asarray(losses.masked_whiten(np.where(m == 0, fill, x), m, shift_mean=shift_mean))
    np.testing.assert_allclose(out, whiten_ref(x, m, shift_mean), rtol=1e-10, atol=1e-10)
    assert np.all(out[m == 0] == 0) and np.all(np.isfinite(out))


def test_masked_whiten_unbiased_variance_golden():
    # §6.3 REINFORCE++: returns [1, 1, 1], [0, 0, 0] whiten to ±0.91287 (unbiased: 6/5 · 0.25).
    out = losses.masked_whiten(np.array([[1.0, 1, 1], [0, 0, 0]]), np.ones((2, 3)))
    assert _round(out) == [0.91287] * 3 + [-0.91287] * 3


def test_masked_whiten_zero_or_one_masked_entry_gives_no_nan():
    # verl's masked_var raises for Σm ∈ {0, 1}; here it is 0 (or μ without the shift).
    x = np.array([[3.0, np.nan]])
    assert np.all(np.asarray(losses.masked_whiten(x, np.zeros((1, 2)))) == 0)
    assert np.all(np.asarray(losses.masked_whiten(x, np.array([[1.0, 0]]))) == 0)
    out = losses.masked_whiten(x, np.array([[1.0, 0]]), shift_mean=False)
    np.testing.assert_array_equal(np.asarray(out), [[3.0, 0.0]])


def test_masked_whiten_errors():
    with pytest.raises(ValueError, match="masked_whiten: eps must be > 0.0"):
        losses.masked_whiten([1.0, 2.0], [1.0, 1.0], eps=0.0)
    with pytest.raises(ValueError, match="masked_whiten: mask has shape"):
        losses.masked_whiten([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="shift_mean must be a bool"):
        losses.masked_whiten([1.0, 2.0], [1.0, 1.0], shift_mean=1)


# -- value_loss: golden values (§6.1) --------------------------------------------------------


def test_value_loss_golden():
    batch = losses.Batch(
        action_mask=np.ones((1, 2)),
        old_values=np.array([[0.5, 0.5]]),
        returns=np.array([[1.0, 0.0]]),
    )
    values = np.array([[1.2, 0.1]])  # v_clip = [1.0, 0.1]; per token [0.02, 0.005]
    (value, metrics), grad = vg({}, values, batch)
    assert float(f"{value:.5g}") == 0.0125
    assert metrics["vf_clipfrac"] == 0.0
    np.testing.assert_allclose(grad, [[0.1, 0.05]], rtol=1e-12)  # w·(v − R), w = 1/2
    # token 1 moves away from R = 1.9 beyond the band: v_clip = 1.0, (1 − 1.9)² = 0.81 >
    # (2 − 1.9)² = 0.01, so the clipped loss wins and the gradient is exactly 0.
    far = batch.replace(returns=np.array([[1.0, 1.9]]))
    (value2, metrics2), grad2 = vg({}, np.array([[1.2, 2.0]]), far)
    assert metrics2["vf_clipfrac"] == 0.5
    assert grad2[0, 1] == 0.0
    np.testing.assert_allclose(value2, 0.5 * (0.04 + 0.81) / 2, rtol=1e-12)
    # Below the band, toward R: v_clip = 0, (0 − 1)² = 1 < (−1 − 1)² = 4: unclipped wins.
    (value3, metrics3), grad3 = vg(
        {}, np.array([[1.2, -1.0]]), far.replace(returns=np.array([[1.0, 1.0]]))
    )
    assert metrics3["vf_clipfrac"] == 0.0
    np.testing.assert_allclose(value3, 0.5 * (0.04 + 4.0) / 2, rtol=1e-12)
    np.testing.assert_allclose(grad3, [[0.1, -1.0]], rtol=1e-12)


def test_value_loss_unclipped_does_not_need_old_values():
    batch = losses.Batch(action_mask=np.ones((1, 2)), returns=np.array([[1.0, 0.0]]))
    (value, metrics), grad = vg(dict(clip=None), np.array([[1.2, 0.1]]), batch)
    assert float(f"{value:.5g}") == float(f"{0.5 * (0.04 + 0.01) / 2:.5g}")
    assert metrics["vf_clipfrac"] == 0.0
    assert "old_values" not in losses.value_loss(clip=None).reads
    with pytest.raises(ValueError, match="value_loss needs batch field 'old_values'"):
        losses.value_loss()(jnp.ones((1, 2)), batch)


# -- value_loss: reference, NaN safety, split, permutation, padding, jit, vmap ----------------


@over_configs()
@given(data=critic_batches())
def test_value_loss_matches_numpy_reference(cfg, data):
    values, batch = data
    (value, metrics), grad = vg(cfg, values, batch)
    ref_value, ref_grad, ref_frac = value_loss_ref(values, batch, **cfg)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-14)
    assert metrics["loss"] == value
    assert metrics["vf_clipfrac"] == pytest.approx(ref_frac, abs=1e-15)
    action = np.asarray(batch.action_mask) > 0
    assert metrics["num_tokens"] == action.sum()
    if action.any():
        assert metrics["vpred_mean"] == pytest.approx(values[action].mean(), rel=1e-12, abs=1e-14)


@over_configs()
@few
@given(data=critic_batches(), fill=st.sampled_from(FILLS))
def test_value_loss_masked_positions_are_nan_safe(cfg, data, fill):
    values, batch = data
    masked = np.asarray(batch.action_mask) == 0
    dirty = batch.replace(
        old_values=np.where(masked, -fill, np.asarray(batch.old_values)),
        returns=np.where(masked, fill, np.asarray(batch.returns)),
    )
    (value, metrics), grad = vg(cfg, np.where(masked, fill, values), dirty)
    (value_ok, _), grad_ok = vg(cfg, values, batch)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    assert np.all(grad[masked] == 0.0)
    assert value == value_ok
    np.testing.assert_array_equal(grad, grad_ok)


def _pad_rows(x, rows):
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[0] == rows:
        return x
    return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


@over_configs()
@few
@given(data=critic_batches(), k=st.sampled_from([2, 3, 4]))
def test_value_loss_split_batch_is_exact(cfg, data, k):
    values, batch = data
    (v_full, _), g_full = vg(cfg, values, batch)
    total, grads = 0.0, []
    for sl, part in zip(losses.row_slices(B, k), losses.split_batch(batch, k), strict=True):
        rows = part.shape[0]
        padded = jax.tree.map(lambda x: _pad_rows(x, B // 2), part)
        (v, _), g = vg(cfg, _pad_rows(values[sl], B // 2), padded)
        assert np.all(g[rows:] == 0)
        total += v
        grads.append(g[:rows])
    np.testing.assert_allclose(total, v_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-12, atol=1e-14)


@over_configs()
@few
@given(data=critic_batches(), seed=st.integers(0, 2**31 - 1))
def test_value_loss_row_permutation_invariance(cfg, data, seed):
    values, batch = data
    perm = np.random.default_rng(seed).permutation(B)
    permuted = jax.tree.map(lambda x: x[perm] if x.ndim >= 1 else x, batch)
    (v0, _), g0 = vg(cfg, values, batch)
    (v1, _), g1 = vg(cfg, values[perm], permuted)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, g0[perm], rtol=1e-12, atol=1e-14)


@over_configs()
@few
@given(data=critic_batches(shapes=((B - 2, T - 2),)), fill=st.sampled_from([np.nan, -3.0]))
def test_value_loss_padding_rows_and_columns_change_nothing(cfg, data, fill):
    values, batch = data

    def pad(x, value):
        x = np.pad(np.asarray(x), ((0, 0), (0, 2)), constant_values=value)
        return np.concatenate([x, np.full((2, x.shape[1]), value)])

    padded = losses.Batch(
        action_mask=pad(batch.action_mask, 0.0),
        obs_mask=pad(batch.obs_mask, 0.0),
        old_values=pad(batch.old_values, fill),
        returns=pad(batch.returns, fill),
    )
    v0, g0, _ = value_loss_ref(values, batch, **cfg)
    (v1, _), g1 = vg(cfg, pad(values, fill), padded)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1[: B - 2, : T - 2], g0, rtol=1e-12, atol=1e-14)
    assert np.all(g1[B - 2 :] == 0) and np.all(g1[:, T - 2 :] == 0)


@over_configs()
def test_value_loss_jit_equals_eager_and_vmaps(cfg):
    rng = np.random.default_rng(1)
    values = rng.normal(size=(B, T))
    batch = losses.Batch(
        action_mask=(rng.uniform(size=(B, T)) < 0.7).astype(float),
        old_values=values + rng.uniform(-1, 1, (B, T)),
        returns=rng.normal(size=(B, T)),
    )
    t = value_term(tuple(sorted(cfg.items())))
    v_eager, m_eager = t(jnp.asarray(values), batch)
    (v_jit, m_jit), _ = vg(cfg, values, batch)
    np.testing.assert_allclose(v_jit, float(v_eager), rtol=1e-13, atol=1e-15)
    assert set(m_jit) == set(m_eager)
    doubled = batch.replace(
        old_values=2 * np.asarray(batch.old_values), returns=2 * np.asarray(batch.returns)
    )
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), batch, doubled)
    vals, _ = jax.vmap(t)(jnp.stack([values, 2 * values]), stacked)
    v2, _ = t(jnp.asarray(2 * values), doubled)
    np.testing.assert_allclose(np.asarray(vals), [float(v_eager), float(v2)], rtol=1e-13)
    if t.config["clip"] is None:  # unclipped: homogeneous of degree 2 in (v, R)
        assert float(v2) == pytest.approx(4 * float(v_eager), rel=1e-12)


def test_value_loss_term_contract():
    t = losses.value_loss(clip=0.2, reduction="seq_mean_token_mean")
    assert t.kind == "value_loss" and t.name == "value_loss" and t.twin is None
    assert t.config == dict(clip=0.2, reduction="seq_mean_token_mean", max_tokens=None)
    assert t.requires == {"action_mask", "returns", "old_values"}
    assert {"action_mask", "returns", "old_values", "num_rows", "obs_mask"} <= t.reads
    assert losses.builtin_twin(t) is None
    assert t.argument == "values"


def test_value_predictions_are_checked_as_values_not_logprobs():
    # The critic's first argument is a value prediction: positive values are valid data, where
    # a logprob would have to be <= 0; a non-finite or float32-overflowing one is not.
    t = losses.value_loss()
    batch = losses.Batch(
        action_mask=np.array([[1.0, 1.0, 0.0]]),
        old_values=np.array([[0.5, 2.0, 0.0]]),
        returns=np.array([[3.0, 1.0, 0.0]]),
    )
    values = np.array([[2.5, 7.0, np.nan]])  # the masked NaN is not read
    losses.check_batch(batch, values, term=t, dtype=np.float32)
    assert not bool(losses.any_violation(batch, values, argument=t.argument))
    with pytest.raises(ValueError, match=r"> 0 on an unmasked token"):  # read as logprobs
        losses.check_batch(batch, values)
    assert bool(losses.any_violation(batch, values))
    for bad, rule in ((np.inf, "must be finite"), (1e39, "overflows float32")):
        v = values.copy()
        v[0, 1] = bad
        with pytest.raises(ValueError, match=rf"values\[row 0, column 1\] = .*{rule}"):
            losses.check_batch(batch, v, term=t, dtype=np.float32)
    v = values.copy()
    v[0, 0] = np.inf
    assert bool(losses.any_violation(batch, v, argument="values"))
    with pytest.raises(ValueError, match=r"values have shape \(1, 2\), expected \(1, 3\)"):
        losses.check_batch(batch, values[:, :2], term=t)
    with pytest.raises(ValueError, match="argument must be one of"):
        losses.any_violation(batch, values, argument="value")
    with pytest.raises(ValueError, match="argument must be one of"):
        losses.Term(name="x", fn=t.fn, argument="value")


def test_a_fold_of_terms_over_different_arguments_is_refused():
    with pytest.raises(ValueError, match=r"different first arguments \(grpo: logprobs, "):
        losses.fold(losses.grpo(), losses.value_loss())
    both = losses.fold(("a", losses.value_loss()), ("b", losses.value_loss(clip=None)))
    assert both.argument == "values"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(clip=0.0), "value_loss: clip must be > 0.0"),
        (dict(clip=-1.0), "value_loss: clip must be > 0.0"),
        (dict(clip="0.5"), "value_loss: clip must be a number"),
        (dict(reduction="mean"), "value_loss: unknown reduction 'mean'"),
        (dict(reduction="seq_mean_token_sum_norm"), "needs max_tokens"),
    ],
)
def test_value_loss_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        losses.value_loss(**kwargs)


def test_value_loss_call_errors():
    batch = losses.Batch(action_mask=np.ones((1, 2)), old_values=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="value_loss needs batch field 'returns'"):
        losses.value_loss()(jnp.ones((1, 2)), batch)
    batch = batch.replace(returns=np.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"value_loss: values has shape \(1, 3\)"):
        losses.value_loss()(jnp.ones((1, 3)), batch)


def test_docstring_examples_run():
    result = doctest.testmod(losses._critic, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
