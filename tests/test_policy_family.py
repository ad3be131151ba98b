"""The policy family: NumPy references, shared properties, peer-defect regressions, bad input,
the mismatch correction and the built-in twins.

Every property runs over `CASES`, a list of ``(constructor, config)`` pairs covering each term,
each reduction and each kind/level of mismatch correction. The jitted function of a case is
cached and sees two shapes only ((4, 6) and the (2, 6) micro-batches), so a case compiles twice.
Properties parametrized over the cases run a third of the profile's examples per case (8 of 25
by default, 66 of 200 with ``HYPOTHESIS_PROFILE=thorough``): across the 26 cases that is still
~200 examples per property.
"""

from __future__ import annotations

import doctest
import functools
import inspect
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import losses
from tests import numpy_ref_policy as ref
from tests.strategies import policy_batches

TIS_TOK = losses.mismatch_correction(kind="tis", level="token", cap=1.5)
TIS_SEQ = losses.mismatch_correction(kind="tis", level="sequence", cap=2.5)
MIS_TOK = losses.mismatch_correction(kind="mis", level="token", low=0.6, high=1.7)
MIS_SEQ = losses.mismatch_correction(kind="mis", level="sequence", high=3.0)

#: (constructor name, keywords). Odd-looking bounds keep ties with the data away.
CASES = [
    ("importance_sampling", {}),
    ("importance_sampling", dict(reduction="token_sum", correction=TIS_TOK)),
    ("ppo", {}),
    (
        "ppo",
        dict(clip_low=0.13, clip_high=0.31, reduction="seq_mean_token_mean", correction=MIS_SEQ),
    ),
    ("cispo", {}),
    (
        "cispo",
        dict(clip_low=0.2, clip_high=0.28, reduction="seq_mean_token_sum", correction=MIS_TOK),
    ),
    ("dro", {}),
    ("dro", dict(beta=0.3, reduction="token_sum", correction=TIS_SEQ)),
    ("dapo", {}),
    ("dapo", dict(eps_clip_c=1.7, reduction="seq_mean_token_sum_norm", max_tokens=16)),
    (
        "dapo",
        dict(clip_low_threshold=0.75, clip_high_threshold=1.33, eps_clip_c=2.9, correction=TIS_SEQ),
    ),
    ("gspo", {}),
    ("gspo", dict(clip_low=0.11, clip_high=0.17, reduction="token_sum")),
    (
        "gspo",
        dict(
            clip_low=0.23,
            clip_high=0.19,
            seq_ratio_log_cap=0.07,
            reduction="token_mean",
            correction=MIS_TOK,
        ),
    ),
    ("dppo", {}),
    ("dppo", dict(divergence="binary_kl", reduction="token_sum")),
    (
        "dppo",
        dict(threshold=0.043, reduction="seq_mean_token_mean", correction=TIS_TOK),
    ),
    ("reinforce", {}),
    (
        "reinforce",
        dict(
            ratio_weight=True,
            ratio_cap=1.7,
            kl_coef=0.1,
            kl_estimator="k2",
            reduction="seq_mean_token_sum",
            correction=MIS_SEQ,
        ),
    ),
    ("reinforce", dict(ratio_weight=True, kl_coef=0.05, kl_estimator="k3", reduction="token_sum")),
    ("gmpo", {}),
    ("gmpo", dict(clip_low=0.13, clip_high=0.21, reduction="token_sum", correction=TIS_TOK)),
    ("sapo", {}),
    ("sapo", dict(tau_pos=0.7, tau_neg=2.3, reduction="token_mean", correction=MIS_SEQ)),
    ("grpo", dict(correction=TIS_TOK)),
    (
        "grpo",
        dict(
            kl_coef=0.1,
            dual_clip=2.2,
            clip_high=0.28,
            reduction="seq_mean_token_mean",
            correction=MIS_SEQ,
        ),
    ),
]
IDS = [f"{i:02d}-{kind}" for i, (kind, _) in enumerate(CASES)]
CASE_IDX = list(range(len(CASES)))
NO_KL = [i for i in CASE_IDX if not CASES[i][1].get("kl_coef")]
#: Examples per case of the per-case properties (see the module docstring).
per_case = settings(max_examples=max(4, settings.default.max_examples // 3))

#: One shape for every property (B=4 splits into two micro-batches of 2), so each case compiles
#: its jitted function for (4, 6) and once more for the (2, 6) micro-batches.
B, T = 4, 6
SHAPE = [(B, T)]


@functools.cache
def make(i: int) -> losses.Term:
    kind, cfg = CASES[i]
    return getattr(losses, kind)(**cfg)


@functools.cache
def _vg(i: int):
    t = make(i)

    def f(lp, batch):
        (value, metrics), (g_lp, g_batch) = jax.value_and_grad(
            lambda x, b: t(x, b), argnums=(0, 1), has_aux=True
        )(lp, batch)
        g_metrics = jax.grad(lambda x: sum(t(x, batch)[1].values()))(lp)
        return value, metrics, g_lp, g_batch, g_metrics

    return jax.jit(f)


def vg(i, lp, batch):
    """((value, metrics), grad) of case ``i`` as numpy (cached jit).

    Every call also checks that the gradient with respect to every batch field is exactly 0 and
    that the metrics are stop-gradient (the gradient of their sum is exactly 0).
    """
    value, metrics, g_lp, g_batch, g_metrics = _vg(i)(jnp.asarray(lp), batch)
    for name, g in g_batch.fields.items():
        assert g is None or not np.any(np.asarray(g)), f"gradient reaches batch field {name}"
    assert not np.any(np.asarray(g_metrics)), "a metric is not stop-gradient"
    return (float(value), {k: float(v) for k, v in metrics.items()}), np.asarray(g_lp)


def ref_cfg(i):
    kind, cfg = CASES[i]
    return kind, dict(cfg)


def adv_BT(batch):
    a = np.asarray(batch.advantages)
    return np.broadcast_to(a[:, None], batch.shape) if a.ndim == 1 else a


def weights(batch, i):
    cfg = make(i).config
    return np.asarray(losses.term_weights(batch, "action", cfg["reduction"], cfg["max_tokens"]))


# -- 1. NumPy reference -------------------------------------------------------------------------


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
@per_case
@given(data=policy_batches(shapes=SHAPE))
def test_matches_numpy_reference(i, data):
    lp, batch = data
    (value, metrics), grad = vg(i, lp, batch)
    kind, cfg = ref_cfg(i)
    ref_value, ref_grad = ref.policy_ref(kind, lp, batch, **cfg)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert metrics["loss"] == value
    assert all(np.isfinite(v) for v in metrics.values())
    if cfg.get("correction") is not None:
        _, ref_metrics = ref.correction_ref(batch, cfg["correction"])
        for key, expected in ref_metrics.items():
            assert metrics[key] == pytest.approx(expected, rel=1e-10, abs=1e-12), key


# -- 2. on-policy identity ----------------------------------------------------------------------


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
@per_case
@given(data=policy_batches(shapes=SHAPE))
def test_on_policy_gradient_is_minus_advantage_times_weight(i, data):
    # p == old == sampling (== ref): every ratio and every correction weight is 1.
    lp, batch = data
    batch = batch.replace(old_logprobs=lp, sampling_logprobs=lp, ref_logprobs=lp)
    _, grad = vg(i, lp, batch)
    kind = CASES[i][0]
    a, w = adv_BT(batch), weights(batch, i)
    if kind == "gmpo":
        # Sequence loss -Ā_i·ρ_i: the gradient is -Ā_i·w on tokens with A ≠ 0.
        m = np.asarray(batch.action_mask)
        abar = (a * m).sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1)
        np.testing.assert_allclose(grad, -abar * w * (a != 0), rtol=1e-13, atol=1e-15)
    elif kind == "sapo":
        # g'(1) = σ'(0)·τ·4/τ = 1, up to the rounding of τ·(1/τ).
        np.testing.assert_allclose(grad, -a * w, rtol=1e-14, atol=1e-16)
    else:
        np.testing.assert_array_equal(grad, -a * w)


# -- 3. masked positions ------------------------------------------------------------------------


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
@per_case
@given(
    data=policy_batches(shapes=SHAPE),
    fill=st.sampled_from([np.inf, -np.inf, np.nan, 1e30, -1e30, 200.0]),
)
def test_masked_positions_are_nan_safe(i, data, fill):
    lp, batch = data
    masked = np.asarray(batch.action_mask) == 0
    opposite = -fill if np.isfinite(fill) else fill
    changes = {
        "old_logprobs": np.where(masked, opposite, np.asarray(batch.old_logprobs)),
        "sampling_logprobs": np.where(masked, fill, np.asarray(batch.sampling_logprobs)),
        "ref_logprobs": np.where(masked, opposite, np.asarray(batch.ref_logprobs)),
    }
    if np.asarray(batch.advantages).ndim == 2:
        changes["advantages"] = np.where(masked, fill, np.asarray(batch.advantages))
    (value, metrics), grad = vg(i, np.where(masked, fill, lp), batch.replace(**changes))
    (value_ok, _), grad_ok = vg(i, lp, batch)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    assert np.all(grad[masked] == 0.0)
    np.testing.assert_allclose(value, value_ok, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(grad, grad_ok, rtol=1e-12, atol=1e-15)


# -- 4. trust regions: exactly zero where they say so, never zero elsewhere ---------------------


def expected_zero(i, lp, batch):
    """Action tokens whose gradient the term's trust region (or an MIS rejection) zeroes."""
    kind, cfg = CASES[i][0], make(i).config
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
    c_BT, _ = ref.correction_ref(batch, cfg.get("correction"))
    return m & (zero | (c_BT == 0))


@pytest.mark.parametrize("i", NO_KL, ids=[IDS[i] for i in NO_KL])
@per_case
@given(data=policy_batches(shapes=SHAPE))
def test_zero_gradient_exactly_where_the_trust_region_says(i, data):
    lp, batch = data
    _, grad = vg(i, lp, batch)
    zero = expected_zero(i, lp, batch)
    assert np.all(grad[zero] == 0.0)
    live = (np.asarray(batch.action_mask) > 0) & ~zero & (adv_BT(batch) != 0)
    if CASES[i][0] == "gmpo":  # the whole row scales with Ā_i
        m = np.asarray(batch.action_mask)
        live &= (adv_BT(batch) * m).sum(1, keepdims=True) != 0
    assert np.all(grad[live] != 0.0)


# -- 5. micro-batching, permutation, padding, jit -----------------------------------------------


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
@per_case
@given(data=policy_batches(shapes=SHAPE))
def test_split_batch_reproduces_full_batch(i, data):
    lp, batch = data
    (v_full, _), g_full = vg(i, lp, batch)
    values, grads = [], []
    for sl, part in zip(losses.row_slices(B, 2), losses.split_batch(batch, 2), strict=True):
        (v, _), g = vg(i, lp[sl], part)
        values.append(v)
        grads.append(g)
    np.testing.assert_allclose(sum(values), v_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
@per_case
@given(data=policy_batches(shapes=SHAPE), seed=st.integers(0, 2**31 - 1))
def test_row_permutation_invariance(i, data, seed):
    lp, batch = data
    perm = np.random.default_rng(seed).permutation(B)
    permuted = jax.tree.map(lambda x: x[perm] if x.ndim >= 1 else x, batch)
    (v0, _), g0 = vg(i, lp, batch)
    (v1, _), g1 = vg(i, lp[perm], permuted)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, g0[perm], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
@per_case
@given(data=policy_batches(shapes=[(B - 2, T - 2)]), fill=st.sampled_from([np.nan, -np.inf, -3.0]))
def test_padding_rows_and_columns_change_nothing(i, data, fill):
    # A (2, 4) batch padded with two all-zero rows and columns to (4, 6), the compiled shape;
    # the unpadded side is the NumPy reference (shape-generic), so no extra compilation.
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
    kind, cfg = ref_cfg(i)
    v0, g0 = ref.policy_ref(kind, lp, batch, **cfg)
    (v1, m1), g1 = vg(i, pad(lp, fill), losses.Batch(**fields))
    np.testing.assert_allclose(v1, v0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g1[: B - 2, : T - 2], g0, rtol=1e-10, atol=1e-12)
    assert np.all(g1[B - 2 :] == 0) and np.all(g1[:, T - 2 :] == 0)
    assert all(np.isfinite(v) for v in m1.values())


def _fixed_batch(seed=0, b=B, t=T):
    """A deterministic batch with the same fields (pytree structure) as `policy_batches`."""
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.01, 4.0, (b, t))
    old = np.minimum(lp + rng.uniform(-1, 1, (b, t)), 0)
    action = rng.uniform(size=(b, t)) < 0.7
    batch = losses.Batch(
        action_mask=action.astype(float),
        obs_mask=(~action).astype(float),
        advantages=rng.normal(size=b),
        sampling_logprobs=np.minimum(old + rng.uniform(-1, 1, (b, t)), 0),
        old_logprobs=old,
        ref_logprobs=np.minimum(lp + rng.uniform(-1, 1, (b, t)), 0),
        weights=rng.normal(size=(b, t)),
    )
    return lp, batch


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
def test_jit_equals_eager(i):
    lp, batch = _fixed_batch(seed=i)
    v_eager, m_eager = make(i)(jnp.asarray(lp), batch)
    (v_jit, m_jit), _ = vg(i, lp, batch)
    np.testing.assert_allclose(v_jit, float(v_eager), rtol=1e-13, atol=1e-15)
    assert set(m_jit) == set(m_eager)
    for key in m_eager:
        assert m_eager[key].shape == ()
        np.testing.assert_allclose(m_jit[key], float(m_eager[key]), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
def test_config_holds_the_keywords_and_rebuilds_the_term(i):
    kind, kwargs = CASES[i]
    t = make(i)
    cfg = dict(t.config)
    json.dumps(cfg)  # machine-readable: plain values only
    rebuilt = getattr(losses, kind)(**cfg)
    assert rebuilt.config == t.config and rebuilt.kind == t.kind == kind
    # Exactly the constructor's keywords, offset aliases resolved into absolute thresholds.
    params = set(inspect.signature(getattr(losses, kind)).parameters)
    aliases = {"clip_low", "clip_high"} if "clip_low_threshold" in params else set()
    assert set(cfg) == params - aliases
    assert set(kwargs) - aliases <= set(cfg)
    lp, batch = _fixed_batch(seed=i)
    np.testing.assert_array_equal(np.asarray(rebuilt(lp, batch)[0]), np.asarray(t(lp, batch)[0]))


# -- 6. regressions for peer defects (policy-losses.md §10, Fireworks SDK reference §8) ---------


def _one_token_rows(lp, old, adv):
    """Rows of one action token each: ``lp``, ``old`` and ``adv`` are lists of equal length."""
    n = len(lp)
    return jnp.asarray(lp, float).reshape(n, 1), losses.Batch(
        action_mask=jnp.ones((n, 1)),
        advantages=jnp.asarray(adv, float),
        sampling_logprobs=jnp.asarray(old, float).reshape(n, 1),
    )


@pytest.mark.parametrize(
    "term",
    [
        losses.ppo(clip_low_threshold=0.8, clip_high_threshold=1.2, reduction="token_sum"),
        losses.ppo(clip_low=0.2, clip_high=0.2, reduction="token_sum"),
        losses.dapo(clip_low=0.2, clip_high=0.2, reduction="token_sum"),
        losses.dapo(clip_low=0.2, clip_high=0.2, eps_clip_c=3.0, reduction="token_sum"),
        losses.gspo(clip_low=0.2, clip_high=0.2, reduction="token_sum"),
    ],
    ids=["ppo", "ppo-offsets", "dapo", "dapo-dual", "gspo"],
)
def test_negative_advantage_clip_is_not_inverted(term):
    # EasyDeL (§10.1) used max(rA, cA) for A<0. With A=-1, eps=0.2: at r=0.5 the PPO gradient
    # is 0 (clipped: the bad token is already pushed down); at r=2.0 it is -A·r = +2.0.
    lp, batch = _one_token_rows(np.log([0.1, 0.2]), np.log([0.2, 0.1]), [-1.0, -1.0])
    g = jax.grad(lambda x: term(x, batch)[0])(lp)
    np.testing.assert_allclose(np.asarray(g)[:, 0], [0.0, 2.0], rtol=1e-12)
    assert float(g[0, 0]) == 0.0


@pytest.mark.parametrize(
    "term",
    [
        losses.cispo(reduction="token_sum"),
        losses.cispo(clip_low=0.2, clip_high=0.28, reduction="token_sum"),
        losses.reinforce(ratio_weight=True, reduction="token_sum"),
    ],
    ids=["cispo", "cispo-offsets", "reinforce-ratio"],
)
def test_clipped_ratio_coefficient_is_stop_gradient(term):
    # EasyDeL's CISPO (§10.2) let the gradient flow through r: with lp=log 0.3, lp_old=log 0.25,
    # A=1 it gives d/dlp[-r·A·lp] = -r·(1 + lp)·A = +0.245. The coefficient must be detached: -1.2.
    lp, batch = _one_token_rows([math.log(0.3)], [math.log(0.25)], [1.0])
    g = float(jax.grad(lambda x: term(x, batch)[0])(lp)[0, 0])
    assert g == pytest.approx(-1.2, rel=1e-12)
    defective = -1.2 * (1.0 + math.log(0.3))
    assert defective == pytest.approx(0.2447, abs=1e-4) and abs(g - defective) > 1.0


@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
def test_reinforce_kl_penalty_has_a_true_gradient(estimator):
    # The Fireworks cookbook's REINFORCE adds β(sg(π) - ref): zero gradient (SDK reference §8).
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 3)),
        advantages=jnp.zeros((1,)),
        sampling_logprobs=lp,
        ref_logprobs=jnp.array([[-1.5, -1.0, -0.5]]),
    )
    term = losses.reinforce(kl_coef=1.0, kl_estimator=estimator, reduction="token_sum")
    g = np.asarray(jax.grad(lambda x: term(x, batch)[0])(lp))[0]
    delta = np.array([0.5, -1.0, 0.0])
    expected = {"k1": np.ones(3), "k2": delta, "k3": 1 - np.exp(-delta)}[estimator]
    np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-15)
    if estimator != "k1":
        assert g[0] > 0 and g[1] < 0 and g[2] == 0  # descent moves p toward ref


@pytest.mark.parametrize("i", CASE_IDX, ids=IDS)
def test_masked_exp_of_a_huge_log_ratio_gives_no_nan(i):
    # §10.3 / §8: sum(-min(rA, cA)·m) with a masked log-ratio of 200 has gradient [-1, nan] when
    # the mask multiplies after exp (0·inf in the backward pass).
    lp = jnp.array([[-1.0, 0.0]])
    batch = losses.Batch(
        action_mask=jnp.array([[1.0, 0.0]]),
        advantages=jnp.array([1.0]),
        old_logprobs=jnp.array([[-1.0, -200.0]]),
        sampling_logprobs=jnp.array([[-1.0, 200.0]]),
        ref_logprobs=jnp.array([[-1.0, -200.0]]),
    )
    (value, metrics), g = jax.value_and_grad(lambda x: make(i)(x, batch), has_aux=True)(lp)
    assert np.isfinite(float(value)) and all(np.isfinite(float(v)) for v in metrics.values())
    w = weights(batch, i)
    np.testing.assert_array_equal(np.asarray(g), -1.0 * w)  # on-policy token: -A·w; masked: 0
    assert float(g[0, 1]) == 0.0


def test_gspo_sequence_ratio_ignores_padding_and_masked_tokens():
    # Soup#723 / the Fireworks cookbook's main GSPO average p - q over the whole response slice.
    # Valid log-ratios 0.1 and 0.3 → s = e^0.2, whatever the masked or padded tokens hold.
    lp = jnp.array([[-1.0, -1.0, -1.0, -1.0]])
    old = jnp.array([[-1.1, -1.3, -6.0, -6.0]])  # masked log-ratios 5.0
    mask = jnp.array([[1.0, 1.0, 0.0, 0.0]])
    batch = losses.Batch(action_mask=mask, advantages=jnp.array([1.0]), sampling_logprobs=old)
    term = losses.gspo(clip_low=0.5, clip_high=0.5, reduction="token_sum")
    (value, metrics), g = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(lp)
    s = math.exp(0.2)
    assert float(metrics["seq_ratio_mean"]) == pytest.approx(s, rel=1e-12)
    assert float(value) == pytest.approx(-2 * s, rel=1e-12)
    np.testing.assert_allclose(np.asarray(g), [[-s, -s, 0.0, 0.0]], rtol=1e-12)
    unmasked = math.exp((0.1 + 0.3 + 5.0 + 5.0) / 4)  # the defective ratio
    assert abs(float(value) - (-2 * min(unmasked, 1.5))) > 0.5
    # More padding (columns and a row) changes nothing.
    padded = losses.Batch(
        action_mask=jnp.pad(mask, ((0, 1), (0, 3))),
        advantages=jnp.array([1.0, 7.0]),
        sampling_logprobs=jnp.pad(old, ((0, 1), (0, 3)), constant_values=-50.0),
    )
    v2, m2 = term(jnp.pad(lp, ((0, 1), (0, 3))), padded)
    assert float(v2) == float(value) and float(m2["seq_ratio_mean"]) == float(
        metrics["seq_ratio_mean"]
    )


def test_dro_penalty_applies_where_the_advantage_is_zero():
    # Tinker kernel: the quadratic applies at every position; the Fireworks cookbook client gates
    # it on A ≠ 0 (contradicting its docstring). An A = 0 row must still be pulled to q.
    lp = jnp.array([[-1.0, -2.0]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 2)),
        advantages=jnp.zeros((1,)),
        sampling_logprobs=jnp.array([[-1.5, -1.0]]),
    )
    g = np.asarray(jax.grad(lambda x: losses.dro(beta=0.4, reduction="token_sum")(x, batch)[0])(lp))
    np.testing.assert_allclose(g, [[0.4 * 0.5, 0.4 * -1.0]], rtol=1e-12)


# -- 7. the mismatch correction -----------------------------------------------------------------


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
    valid = batch.action_mask > 0
    cases = [
        (dict(kind="tis", level="token", cap=3.0), [2.0, 0.5, 3.0, 0], "truncated", 1 / 3),
        (dict(kind="tis", level="sequence", cap=3.0), [3.0, 3.0, 3.0, 0], "truncated", 1.0),
        (dict(kind="tis", level="sequence", cap=5.0), [4.0, 4.0, 4.0, 0], "truncated", 0.0),
        (dict(kind="mis", level="token", low=0.6, high=3.0), [2.0, 0, 0, 0], "rejected", 2 / 3),
        (dict(kind="mis", level="sequence", high=4.5), [4.0, 4.0, 4.0, 0], "rejected", 0.0),
        (dict(kind="mis", level="sequence", high=3.9), [0, 0, 0, 0], "rejected", 1.0),
    ]
    for kwargs, expected, flag, frac in cases:
        corr = losses.mismatch_correction(**kwargs)
        c, metrics = corr.weights(batch, valid)
        np.testing.assert_allclose(np.asarray(c)[0], expected, rtol=1e-12, err_msg=str(kwargs))
        assert float(metrics[f"mismatch_{flag}_frac"]) == pytest.approx(frac)
        assert float(metrics["mismatch_weight_mean"]) == pytest.approx(sum(expected) / 3)
        assert float(metrics["mismatch_ratio_mean"]) == pytest.approx(6.5 / 3)


@pytest.mark.parametrize("corr", [TIS_TOK, TIS_SEQ, MIS_TOK, MIS_SEQ], ids=str)
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


# -- 8. bad input -------------------------------------------------------------------------------


BAD = [
    (losses.ppo, dict(clip_low=0.1, clip_low_threshold=0.9), "not both"),
    (losses.ppo, dict(clip_low_threshold=1.1), "clip_low_threshold must be <= 1.0"),
    (losses.ppo, dict(clip_high_threshold=0.9), "clip_high_threshold must be >= 1.0"),
    (losses.ppo, dict(clip_low=-0.1), "clip_low must be >= 0.0"),
    (losses.ppo, dict(reduction="mean"), "unknown reduction 'mean'"),
    (losses.ppo, dict(correction="tis"), "correction must be None"),
    (losses.ppo, dict(correction=dict(kind="tis", C=2)), r"unknown correction keys \['C'\]"),
    (losses.importance_sampling, dict(max_log_ratio=0), "max_log_ratio must be > 0.0"),
    (losses.importance_sampling, dict(reduction="seq_mean_token_sum_norm"), "needs max_tokens"),
    (losses.cispo, dict(clip_high=0.2, clip_high_threshold=5.0), "not both"),
    (losses.cispo, dict(clip_high_threshold=0.5), "clip_high_threshold must be >= 1.0"),
    (losses.dro, dict(beta=-1.0), "beta must be >= 0.0"),
    (losses.dro, dict(beta=float("inf")), "beta must be finite"),
    (losses.dapo, dict(eps_clip_c=1.0), "eps_clip_c must be > 1.0"),
    (losses.dapo, dict(eps_clip_c="3"), "eps_clip_c must be a number"),
    (losses.dapo, dict(clip_high=-0.1), "clip_high must be >= 0.0"),
    (losses.dapo, dict(clip_low=0.2, clip_high_threshold=1.3), "not both"),
    (losses.gspo, dict(seq_ratio_log_cap=0.0), "seq_ratio_log_cap must be > 0.0"),
    (losses.gspo, dict(clip_low=1.5), "clip_low must be <= 1.0"),
    (losses.gspo, dict(clip_low_threshold=-0.1), "clip_low_threshold must be >= 0.0"),
    (losses.gspo, dict(max_tokens=-1), "max_tokens must be > 0"),
    (losses.dppo, dict(divergence="tv"), "unknown divergence 'tv'"),
    (losses.dppo, dict(threshold=0.0), "threshold must be > 0.0"),
    (losses.dppo, dict(threshold=1.5), "threshold must be <= 1.0"),
    (losses.dppo, dict(threshold=float("nan")), "threshold must be finite"),
    (losses.reinforce, dict(ratio_cap=2.0), "ratio_cap needs ratio_weight=True"),
    (losses.reinforce, dict(ratio_weight=True, ratio_cap=0.0), "ratio_cap must be > 0.0"),
    (losses.reinforce, dict(ratio_weight=1), "ratio_weight must be a bool"),
    (losses.reinforce, dict(kl_coef=-0.1), "kl_coef must be >= 0.0"),
    (losses.reinforce, dict(kl_estimator="k4"), "unknown kl_estimator 'k4'"),
    (losses.gmpo, dict(clip_low=-0.1), "clip_low must be >= 0.0"),
    (losses.gmpo, dict(clip_high="wide"), "clip_high must be a number"),
    (losses.sapo, dict(tau_pos=0.0), "tau_pos must be > 0.0"),
    (losses.sapo, dict(tau_neg=-1.0), "tau_neg must be > 0.0"),
    (losses.grpo, dict(correction=3), "correction must be None"),
    (losses.mismatch_correction, dict(kind="pg"), "unknown kind 'pg'"),
    (losses.mismatch_correction, dict(level="row"), "unknown level 'row'"),
    (
        losses.mismatch_correction,
        dict(kind="tis", low=0.5),
        "low/high are the bounds of kind='mis'",
    ),
    (losses.mismatch_correction, dict(kind="mis", cap=2.0), "cap is the bound of kind='tis'"),
    (losses.mismatch_correction, dict(cap=0.5), "cap must be >= 1.0"),
    (losses.mismatch_correction, dict(kind="mis", low=1.5), "low must be <= 1.0"),
    (losses.mismatch_correction, dict(kind="mis", high=0.5), "high must be >= 1.0"),
    (losses.mismatch_correction, dict(max_log_ratio=0), "max_log_ratio must be > 0.0"),
    (losses.MismatchCorrection, dict(kind="tis", level="token"), "kind='tis' needs cap"),
    (losses.MismatchCorrection, dict(kind="mis", level="token", high=2.0), "needs low and high"),
]


@pytest.mark.parametrize(
    "ctor, kwargs, message", BAD, ids=[f"{c.__name__}-{m[:24]}" for c, _, m in BAD]
)
def test_constructors_reject_bad_hyperparameters(ctor, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ctor(**kwargs)


def test_missing_batch_fields_are_named():
    lp = jnp.zeros((1, 2))
    mask = jnp.ones((1, 2))
    no_sampling = losses.Batch(action_mask=mask, advantages=jnp.ones(1), old_logprobs=lp)
    with pytest.raises(ValueError, match="needs batch field 'sampling_logprobs'"):
        losses.ppo(correction=TIS_TOK)(lp, no_sampling)
    with pytest.raises(ValueError, match="needs batch field 'sampling_logprobs'"):
        losses.grpo(correction=MIS_SEQ)(lp, no_sampling)
    with pytest.raises(ValueError, match="reinforce needs batch field 'ref_logprobs'"):
        losses.reinforce(kl_coef=0.1)(lp, no_sampling)
    with pytest.raises(ValueError, match="gspo needs batch field 'old_logprobs'"):
        losses.gspo()(lp, losses.Batch(action_mask=mask, advantages=jnp.ones(1)))
    with pytest.raises(ValueError, match="dppo needs batch field 'advantages'"):
        losses.dppo()(lp, losses.Batch(action_mask=mask, sampling_logprobs=lp))


# -- 9. built-in twins --------------------------------------------------------------------------

#: (term, expected twin). Threshold values compare with approx.
TWINS = [
    (losses.importance_sampling(), ("importance_sampling", {})),
    (
        losses.ppo(
            clip_low_threshold=0.75, clip_high_threshold=1.3, reduction="seq_mean_token_mean"
        ),
        ("ppo", {"clip_low_threshold": 0.75, "clip_high_threshold": 1.3}),
    ),
    (
        losses.cispo(clip_low=0.2, clip_high=0.28),
        ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
    ),
    (losses.cispo(), ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0})),
    (losses.dro(beta=0.3, reduction="token_sum"), ("dro", {"beta": 0.3})),
    (losses.dapo(), ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})),
    (
        losses.dapo(eps_clip_c=1.7, reduction="token_sum"),
        ("dapo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "eps_clip_c": 1.7}),
    ),
    (
        losses.gspo(clip_low=0.11, clip_high=0.17, seq_ratio_log_cap=0.3),
        (
            "gspo",
            {"clip_low_threshold": 0.89, "clip_high_threshold": 1.17, "seq_ratio_log_cap": 0.3},
        ),
    ),
    (losses.dppo(), ("dppo", {"divergence": "binary_tv", "threshold": 0.15})),
    (
        losses.dppo(divergence="binary_kl", reduction="seq_mean_token_sum_norm", max_tokens=9),
        ("dppo", {"divergence": "binary_kl", "threshold": 0.05}),
    ),
    (losses.grpo(), ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})),
    (
        losses.grpo(clip_low=0.1, clip_high=0.28, dual_clip=2.5, reduction="seq_mean_token_sum"),
        ("dapo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.28, "eps_clip_c": 2.5}),
    ),
]


@pytest.mark.parametrize("term, expected", TWINS, ids=[repr(t) for t, _ in TWINS])
def test_builtin_twin_names_and_config_keys(term, expected):
    twin = losses.builtin_twin(term)
    assert twin is not None and twin[0] == expected[0]
    assert set(twin[1]) == set(expected[1])
    for key, value in expected[1].items():
        if isinstance(value, str):
            assert twin[1][key] == value
        else:
            assert twin[1][key] == pytest.approx(value, rel=1e-15), key
    json.dumps(twin[1])
    assert losses.builtin_twin(term) == twin  # pure
    # The config moves to the client path unchanged: it rebuilds the kernel as a term.
    kernel = getattr(losses, twin[0])(reduction="token_sum", **twin[1])
    assert losses.builtin_twin(kernel) == twin


@pytest.mark.parametrize(
    "term",
    [
        losses.ppo(correction=TIS_TOK),
        losses.dapo(eps_clip_c=3.0, correction=MIS_SEQ),
        losses.gspo(correction=TIS_SEQ),
        losses.grpo(kl_coef=0.01),
        losses.grpo(correction=MIS_TOK),
        losses.ppo(max_log_ratio=5.0),
        losses.importance_sampling(max_log_ratio=30.0),
        losses.dro(),  # token_mean: the quadratic does not scale with A
        losses.dro(reduction="seq_mean_token_mean"),
        losses.reinforce(),
        losses.reinforce(ratio_weight=True, reduction="token_sum"),
        losses.gmpo(reduction="token_sum"),
        losses.sapo(reduction="token_sum"),
        losses.sft_cross_entropy(),
        losses.fold(losses.ppo(), losses.echo_env()),
        object(),
    ],
    ids=repr,
)
def test_builtin_twin_is_none_when_no_kernel_is_exact(term):
    assert losses.builtin_twin(term) is None


def _fw_kernel(name, cfg, lp, q, adv, mask):
    """A built-in ``loss_fn`` written from the Fireworks SDK reference §4 table (independent of
    `losses`): a raw sum over every target position; the datum has no mask (the runner folds it
    into ``adv``), except the ``gspo`` sequence mean, which we assume runs over action tokens."""
    r = jnp.exp(lp - q)
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    sg = jax.lax.stop_gradient
    if name == "importance_sampling":
        return -jnp.sum(r * adv)
    if name in ("ppo", "dapo"):
        per = -jnp.minimum(r * adv, jnp.clip(r, lo, hi) * adv)
        if name == "dapo":
            per = jnp.where(adv < 0, jnp.minimum(per, -cfg["eps_clip_c"] * adv), per)
        return jnp.sum(per)
    if name == "cispo":
        return -jnp.sum(sg(jnp.clip(r, lo, hi)) * lp * adv)
    if name == "dro":
        return -jnp.sum(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2)
    if name == "gspo":
        n = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
        mean = jnp.sum(mask * (lp - q), axis=1, keepdims=True) / n
        s = jnp.exp(jnp.minimum(sg(mean) + lp - sg(lp), cfg["seq_ratio_log_cap"]))
        return -jnp.sum(jnp.minimum(s * adv, jnp.clip(s, lo, hi) * adv))
    if name == "dppo":
        pi, mu = jnp.exp(lp), jnp.exp(q)
        if cfg["divergence"] == "binary_tv":
            div = jnp.abs(pi - mu)
        else:
            xlogy = jax.scipy.special.xlogy  # 0·log 0 = 0 at μ = 1
            div = xlogy(mu, mu / pi) + xlogy(1 - mu, (1 - mu) / (1 - pi))
        improving = ((adv > 0) & (r > 1)) | ((adv < 0) & (r < 1))
        keep = sg(jnp.where(improving & (div > cfg["threshold"]), 0.0, 1.0))
        return -jnp.sum(r * adv * keep)
    raise ValueError(name)


#: Homogeneous twins: every reduction folds exactly into the advantages.
FOLD_CASES = [
    ("importance_sampling", {}),
    ("ppo", dict(clip_low_threshold=0.75, clip_high_threshold=1.3)),
    ("cispo", dict(clip_low=0.2, clip_high=0.28)),
    ("dapo", {}),
    ("dapo", dict(eps_clip_c=1.7)),
    ("gspo", dict(clip_low=0.11, clip_high=0.17, seq_ratio_log_cap=0.3)),
    ("dppo", {}),
    ("dppo", dict(divergence="binary_kl", threshold=0.02)),
    ("grpo", dict(clip_low=0.1, clip_high=0.28, dual_clip=2.5)),
]


@functools.cache
def _fold_plans(j: int):
    """Per reduction r: the term with r, its twin (name, config), the twin as a token_sum term."""
    kind, cfg = FOLD_CASES[j]
    plans = []
    for reduction in losses.REDUCTIONS:
        max_tokens = 11 if reduction == "seq_mean_token_sum_norm" else None
        term = getattr(losses, kind)(reduction=reduction, max_tokens=max_tokens, **cfg)
        name, kcfg = losses.builtin_twin(term)
        plans.append((term, name, kcfg, getattr(losses, name)(reduction="token_sum", **kcfg)))
    return plans


def _fold_check(j, lp, batch):
    """For every reduction r, (value, grad) of (1) the term with reduction r, (2) its twin
    kernel as a token_sum term with A·w, and (3) the documented kernel formula on the runner's
    datums (A·w, anchor 0 off the mask). Eager: 15 small graphs compile slower than they run."""
    m = batch.action_mask
    adv = jnp.asarray(adv_BT(batch))
    q = jnp.where(m > 0, batch.old_logprobs, 0.0)
    for term, name, kcfg, kernel_term in _fold_plans(j):
        w = losses.term_weights(batch, "action", term.config["reduction"], 11)
        folded = batch.replace(advantages=adv * w)
        yield (
            term.config["reduction"],
            jax.value_and_grad(lambda x: term(x, batch)[0])(lp),
            jax.value_and_grad(lambda x: kernel_term(x, folded)[0])(lp),
            jax.value_and_grad(lambda x: _fw_kernel(name, kcfg, x, q, adv * w, m))(lp),
        )


@pytest.mark.parametrize("j", range(len(FOLD_CASES)), ids=[k for k, _ in FOLD_CASES])
@settings(max_examples=max(3, settings.default.max_examples // 6))  # × 5 reductions each
@given(data=policy_batches(shapes=SHAPE))
def test_reduction_folded_into_advantages_equals_the_builtin_kernel(j, data):
    lp, batch = data
    batch = batch.replace(sampling_logprobs=batch.old_logprobs)
    for reduction, (v, g), (vk, gk), (vf, gf) in _fold_check(j, jnp.asarray(lp), batch):
        # (a) the term's own token_sum version (from the twin config) with A·w ...
        np.testing.assert_allclose(float(vk), float(v), rtol=1e-12, atol=1e-14, err_msg=reduction)
        np.testing.assert_allclose(np.asarray(gk), np.asarray(g), rtol=1e-12, atol=1e-14)
        # (b) ... and the documented kernel formula on the runner's datums.
        np.testing.assert_allclose(float(vf), float(v), rtol=1e-12, atol=1e-14, err_msg=reduction)
        np.testing.assert_allclose(np.asarray(gf), np.asarray(g), rtol=1e-12, atol=1e-14)


@given(data=policy_batches(shapes=SHAPE))
def test_dro_kernel_matches_token_sum_only_when_every_target_is_an_action(data):
    lp, batch = data
    batch = batch.replace(action_mask=np.ones(batch.shape), sampling_logprobs=batch.old_logprobs)
    term = losses.dro(beta=0.3, reduction="token_sum")
    name, kcfg = losses.builtin_twin(term)
    v, g = jax.value_and_grad(lambda x: term(x, batch)[0])(jnp.asarray(lp))
    q, a = np.asarray(batch.old_logprobs), adv_BT(batch)
    vf, gf = jax.value_and_grad(lambda x: _fw_kernel(name, kcfg, x, q, a, None))(jnp.asarray(lp))
    np.testing.assert_allclose(float(vf), float(v), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(gf), np.asarray(g), rtol=1e-12, atol=1e-14)


def test_dro_folding_is_not_exact_for_a_mean_reduction():
    # Why builtin_twin(dro(reduction != token_sum)) is None: ½β(p-q)² does not scale with A.
    lp = jnp.array([[-1.0, -2.0, -1.5]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 3)),
        advantages=jnp.array([1.0]),
        sampling_logprobs=jnp.array([[-1.5, -1.0, -1.0]]),
    )
    mean = float(losses.dro(beta=0.5)(lp, batch)[0])
    w = losses.term_weights(batch, "action", "token_mean")
    folded = float(losses.dro(beta=0.5, reduction="token_sum")(lp, batch.replace(advantages=w))[0])
    assert abs(mean - folded) > 0.1


# -- 10. docstring examples ---------------------------------------------------------------------


def test_docstring_examples_run():
    import importlib

    for mod in ("_correction", "_twin", "_policy", "_policy_seq"):
        result = doctest.testmod(importlib.import_module(f"losses.{mod}"))
        assert result.failed == 0, mod
