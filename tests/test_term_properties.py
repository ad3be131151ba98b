"""Properties every term satisfies, each written once over the case registry (`tests.cases`).

Each property is parametrized over `CASES` (or the cases a flag of `Case` selects) and runs
`per_case` examples per case on one batch shape, (4, 6); split_batch adds the (2, 6)
micro-batches. So a case compiles its jitted value-and-gradient twice, whatever the property
(three times for a `padding_vs_jit` case: the unpadded (2, 4) batch of the padding property). Every `value_and_grad` call also checks that no gradient reaches a batch field and
that the metrics are stop-gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import losses
from tests import numpy_ref_policy as ref
from tests.cases import (
    CASES,
    SHAPE,
    B,
    T,
    action_weights,
    adv_BT,
    fixed_batch,
    over,
    per_case,
)
from tests.cases import value_and_grad as vg
from tests.strategies import policy_batches

#: Drawn examples per case of the properties that run the term eagerly (op by op: slower), besides
#: the explicit `fixed_batch` (hypothesis draws the minimal batch, no action token, first).
per_case_eager = settings(max_examples=max(1, settings.default.max_examples // 25))

RATIO = [c for c in CASES if c.ratio_based]
TRUST_REGION = [c for c in CASES if c.trust_region]


# -- 1. NumPy reference -------------------------------------------------------------------------


@over(CASES)
@per_case
@given(data=policy_batches(shapes=SHAPE))
def test_matches_numpy_reference(case, data):
    lp, batch = data
    (value, metrics), grad = vg(case, lp, batch)
    ref_value, ref_grad = case.reference(lp, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    if case.exact_grad:
        np.testing.assert_array_equal(grad, ref_grad)
    else:
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert metrics["loss"] == value
    assert all(np.isfinite(v) for v in metrics.values())
    correction = case.config.get("correction")
    if correction is not None:
        _, ref_metrics = ref.correction_ref(batch, correction, lp)
        for key, expected in ref_metrics.items():
            assert metrics[key] == pytest.approx(expected, rel=1e-10, abs=1e-12), key
    if case.check_metrics is not None:
        case.check_metrics(metrics, lp, batch)


# -- 2. on-policy identity ----------------------------------------------------------------------


@over(RATIO)
@per_case
@given(data=policy_batches(shapes=SHAPE))
def test_on_policy_gradient_is_minus_advantage_times_weight(case, data):
    # p == old == sampling (== ref): every ratio and every correction weight is 1, and the
    # KL gradient is k'(0) = 0 (k2, k3) or 1 (k1).
    lp, batch = data
    batch = batch.replace(old_logprobs=lp, sampling_logprobs=lp, ref_logprobs=lp)
    _, grad = vg(case, lp, batch)
    a, w = adv_BT(batch), action_weights(batch, case)
    cfg = case.term().config
    if case.has_kl and cfg["kl_estimator"] == "k1":
        np.testing.assert_array_equal(grad, -a * w + cfg["kl_coef"] * w)
    elif case.ctor == "gmpo":
        # Sequence loss -Ā_i·ρ_i: the gradient is -Ā_i·w on tokens with A ≠ 0.
        m = np.asarray(batch.action_mask)
        abar = (a * m).sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1)
        np.testing.assert_allclose(grad, -abar * w * (a != 0), rtol=1e-13, atol=1e-15)
    elif case.ctor == "sapo":
        # g'(1) = σ'(0)·τ·4/τ = 1, up to the rounding of τ·(1/τ).
        np.testing.assert_allclose(grad, -a * w, rtol=1e-14, atol=1e-16)
    else:
        np.testing.assert_array_equal(grad, -a * w)


# -- 3. masked positions ------------------------------------------------------------------------


@over(CASES)
@per_case
@given(
    data=policy_batches(shapes=SHAPE),
    fill=st.sampled_from([np.inf, -np.inf, np.nan, 1e30, -1e30, 200.0]),
)
def test_masked_positions_are_nan_safe(case, data, fill):
    lp, batch = data
    masked = ~case.read_mask(batch)
    opposite = -fill if np.isfinite(fill) else fill
    changes = {
        "old_logprobs": np.where(masked, opposite, np.asarray(batch.old_logprobs)),
        "sampling_logprobs": np.where(masked, fill, np.asarray(batch.sampling_logprobs)),
        "ref_logprobs": np.where(masked, opposite, np.asarray(batch.ref_logprobs)),
    }
    if np.asarray(batch.advantages).ndim == 2:
        changes["advantages"] = np.where(masked, fill, np.asarray(batch.advantages))
    (value, metrics), grad = vg(case, np.where(masked, fill, lp), batch.replace(**changes))
    (value_ok, _), grad_ok = vg(case, lp, batch)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    assert np.all(grad[masked] == 0.0)
    np.testing.assert_allclose(value, value_ok, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(grad, grad_ok, rtol=1e-12, atol=1e-15)


# -- 4. trust regions: exactly zero where they say so, never zero elsewhere ---------------------


def expected_zero(case, lp, batch):
    """Action tokens whose gradient the term's trust region (or an MIS rejection) zeroes."""
    kind, cfg = case.ctor, case.term().config
    m = np.asarray(batch.action_mask) > 0
    a = adv_BT(batch)
    d = lp - np.asarray(batch.old_logprobs)
    r = np.exp(d)
    zero = np.zeros_like(m)
    if kind in ("ppo", "dapo", "grpo"):
        if kind == "grpo":
            lo, hi, c = 1 - cfg["clip_low"], 1 + cfg["clip_high"], cfg["dual_clip"]
        else:
            lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
            c = cfg.get("eps_clip_c")
        zero = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
        if c is not None:
            zero |= (a < 0) & (r > c)
    elif kind == "gspo":
        mean = (d * m).sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1)
        s = np.exp(np.minimum(mean, cfg["seq_ratio_log_cap"]))
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        zero = ((a > 0) & (s > hi)) | ((a < 0) & (s < lo)) | (mean > cfg["seq_ratio_log_cap"])
    elif kind == "dppo":
        div = np.vectorize(lambda p, q: ref._binary_div(p, q, cfg["divergence"]))(
            lp, np.asarray(batch.old_logprobs)
        )
        improving = ((a > 0) & (r > 1)) | ((a < 0) & (r < 1))
        zero = improving & (div > cfg["threshold"])
    elif kind == "gmpo":
        zero = ((a > 0) & (d > cfg["clip_high"])) | ((a < 0) & (d < -cfg["clip_low"])) | (a == 0)
    c_BT, _ = ref.correction_ref(batch, cfg.get("correction"), lp)
    return m & (zero | (c_BT == 0))


@over(TRUST_REGION)
@per_case
@given(data=policy_batches(shapes=SHAPE))
def test_zero_gradient_exactly_where_the_trust_region_says(case, data):
    lp, batch = data
    _, grad = vg(case, lp, batch)
    zero = expected_zero(case, lp, batch)
    assert np.all(grad[zero] == 0.0)
    live = (np.asarray(batch.action_mask) > 0) & ~zero & (adv_BT(batch) != 0)
    if case.ctor == "dro":  # the gradient -(A - β(p - q)) vanishes where A = β(p - q) exactly
        d = lp - np.asarray(batch.old_logprobs)
        live = (np.asarray(batch.action_mask) > 0) & ~zero
        live &= ~np.isclose(adv_BT(batch), case.term().config["beta"] * d, rtol=1e-9, atol=1e-12)
    if case.ctor == "gmpo":  # the whole row scales with Ā_i
        m = np.asarray(batch.action_mask)
        live &= (adv_BT(batch) * m).sum(1, keepdims=True) != 0
    assert np.all(grad[live] != 0.0)


# -- 5. micro-batching, permutation, padding ----------------------------------------------------


def pad_rows(lp, batch, rows):
    """``lp`` and every per-row batch field padded with zero rows to ``rows`` rows."""

    def pad(x):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] == rows:
            return x
        return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])

    return pad(lp), jax.tree.map(pad, batch)


@over(CASES)
@per_case
@given(data=policy_batches(shapes=SHAPE), k=st.sampled_from([2, 3, 4]))
def test_split_batch_reproduces_full_batch(case, data, k):
    # Micro-batches of one row (k = 3, 4) are padded with a zero row to the two rows of the
    # k = 2 micro-batches, as the runner pads to row buckets: one compilation for all of them.
    lp, batch = data
    (v_full, _), g_full = vg(case, lp, batch)
    values, grads = [], []
    for sl, part in zip(losses.row_slices(B, k), losses.split_batch(batch, k), strict=True):
        rows = part.shape[0]
        (v, _), g = vg(case, *pad_rows(lp[sl], part, B // 2))
        assert np.all(g[rows:] == 0)
        values.append(v)
        grads.append(g[:rows])
    np.testing.assert_allclose(sum(values), v_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-12, atol=1e-14)


@over(CASES)
@per_case
@given(data=policy_batches(shapes=SHAPE), seed=st.integers(0, 2**31 - 1))
def test_row_permutation_invariance(case, data, seed):
    lp, batch = data
    perm = np.random.default_rng(seed).permutation(B)
    permuted = jax.tree.map(lambda x: x[perm] if x.ndim >= 1 else x, batch)
    (v0, _), g0 = vg(case, lp, batch)
    (v1, _), g1 = vg(case, lp[perm], permuted)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, g0[perm], rtol=1e-12, atol=1e-14)


@over(CASES)
@per_case
@given(data=policy_batches(shapes=[(B - 2, T - 2)]), fill=st.sampled_from([np.nan, -np.inf, -3.0]))
def test_padding_rows_and_columns_change_nothing(case, data, fill):
    # A (2, 4) batch padded with two all-zero rows and columns to (4, 6), the compiled shape;
    # the unpadded side is the NumPy reference (shape-generic, no extra compilation) and, for
    # the cases flagged `padding_vs_jit`, also the jitted term.
    lp, batch = data

    def pad(x, value):
        x = np.asarray(x)
        if x.ndim == 1:
            return np.concatenate([x, np.full((2,), value)])
        x = np.pad(x, ((0, 0), (0, 2)), constant_values=value)
        return np.concatenate([x, np.full((2, x.shape[1]), value)])

    fields = {}
    for name, value in batch.fields.items():
        if value is None or name.startswith("num_"):
            continue
        fields[name] = pad(value, 0.0 if name in ("action_mask", "obs_mask", "weights") else fill)
    v0, g0 = case.reference(lp, batch)
    (v1, m1), g1 = vg(case, pad(lp, fill), losses.Batch(**fields))
    np.testing.assert_allclose(v1, v0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g1[: B - 2, : T - 2], g0, rtol=1e-10, atol=1e-12)
    assert np.all(g1[B - 2 :] == 0) and np.all(g1[:, T - 2 :] == 0)
    assert all(np.isfinite(v) for v in m1.values())
    if case.padding_vs_jit:  # and the jitted unpadded batch (a (2, 4) compilation)
        (v2, _), g2 = vg(case, lp, batch)
        np.testing.assert_allclose(v1, v2, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g1[: B - 2, : T - 2], g2, rtol=1e-12, atol=1e-14)


# -- 6. jit, vmap -------------------------------------------------------------------------------


@over(CASES)
@per_case_eager
@given(data=policy_batches(shapes=SHAPE))
@example(data=fixed_batch(0))
def test_jit_equals_eager(case, data):
    lp, batch = data
    v_eager, m_eager = case.term()(jnp.asarray(lp), batch)
    (v_jit, m_jit), _ = vg(case, lp, batch)
    np.testing.assert_allclose(v_jit, float(v_eager), rtol=1e-13, atol=1e-15)
    assert set(m_jit) == set(m_eager)
    for key in m_eager:
        assert m_eager[key].shape == ()
        np.testing.assert_allclose(m_jit[key], float(m_eager[key]), rtol=1e-13, atol=1e-15)


@over(CASES)
@per_case_eager
@given(data=policy_batches(shapes=SHAPE))
@example(data=fixed_batch(0))
def test_vmap_over_a_stack_of_batches(case, data):
    lp, batch = data
    t = case.term()
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)
    values, _ = jax.vmap(t)(jnp.stack([lp, lp]), stacked)
    v, _ = t(jnp.asarray(lp), batch)
    np.testing.assert_allclose(np.asarray(values), [float(v)] * 2, rtol=1e-13, atol=1e-15)
