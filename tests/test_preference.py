"""Preference terms (losses/_preference.py): DPO loss types, SimPO, CPO, ORPO, KTO.

Every case of `CASES` runs the generic properties on one compiled shape, (8, 6) = 4 pairs, with
one batch pytree structure (normalizers always carried), so each case compiles its jitted
value-and-gradient once: the NumPy reference (tests/numpy_ref_preference.py), NaN safety on masked
positions, split_batch exactness (micro-batches padded back to 8 rows with all-zero pairs, which
contribute 0), pair-preserving permutation, padding columns, the chosen/rejected swap, jit = eager
and vmap. Then the reference's worked examples (docs/sources.md#preference-terms) as golden values, the
peer-bug regressions of §4, β limits, constructor and `check_batch` errors.
"""

from __future__ import annotations

import dataclasses
import doctest
import functools
import importlib
import inspect
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import losses
from tests import numpy_ref_preference as ref

B, T = 8, 6
f64 = np.float64
per_case = settings(max_examples=max(3, settings.default.max_examples // 6))
per_case_eager = settings(max_examples=1)


# -- the case registry --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    ctor: str
    kwargs: tuple = ()

    @property
    def config(self) -> dict:
        return dict(self.kwargs)

    @property
    def paired(self) -> bool:
        return self.ctor != "kto"

    @property
    def sorts(self) -> bool:
        """AOT sorts over the pairs of the call: exact under permutation, not under splitting."""
        return self.ctor == "dpo" and self.config.get("loss_type", "").startswith("aot")

    def term(self) -> losses.Term:
        return _term(self.ctor, self.kwargs)

    def reference(self, lp, batch):
        return REFS[self.ctor](lp, batch, **self.config)


REFS = {
    "dpo": ref.dpo_ref,
    "cpo": ref.cpo_ref,
    "simpo": ref.simpo_ref,
    "orpo": ref.orpo_ref,
    "kto": ref.kto_ref,
}


def _case(ctor, **kwargs):
    label = "-".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
    return Case(id=f"{ctor}[{label}]", ctor=ctor, kwargs=tuple(sorted(kwargs.items())))


CASES = (
    [
        _case("dpo", loss_type=lt, **({"label_smoothing": 1e-3} if lt == "exo_pair" else {}))
        for lt in losses.DPO_LOSS_TYPES
    ]
    + [
        _case("dpo", loss_type="sigmoid", label_smoothing=0.1, beta=0.3),
        _case("dpo", loss_type="robust", label_smoothing=0.2),
        _case("dpo", loss_type="exo_pair", label_smoothing=0.3, beta=0.7),
        _case("dpo", loss_type="aot_unpaired", label_smoothing=0.05, beta=0.4),
        _case("dpo", loss_type="hinge", beta=0.45),
        _case("dpo", loss_type="ipo", beta=0.5),
        _case("dpo", loss_type="discopop", discopop_tau=0.3, beta=0.6),
        _case("dpo", loss_type="sigmoid_norm", beta=1.3),
    ]
    + [_case("cpo", loss_type=lt) for lt in losses.CPO_LOSS_TYPES]
    + [
        _case("cpo", loss_type="sigmoid", alpha=0.2, label_smoothing=0.1),
        _case("cpo", loss_type="simpo", simpo_gamma=0.3, beta=2.0, cpo_alpha=0.4, alpha=-0.3),
        _case("simpo"),
        _case("simpo", beta=2.0, gamma=1.0, label_smoothing=0.1),
        _case("orpo"),
        _case("orpo", beta=0.7),
        _case("kto"),
        _case("kto", beta=0.3, desirable_weight=1.5, undesirable_weight=0.7),
        _case("kto", loss_type="apo_zero_unpaired", beta=0.2),
    ]
)
assert len({c.id for c in CASES}) == len(CASES)
PAIRED = [c for c in CASES if c.paired]
SPLITTABLE = [c for c in CASES if not c.sorts]


def over(cases):
    return pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])


@functools.cache
def _term(ctor, frozen):
    return getattr(losses, ctor)(**dict(frozen))


@functools.cache
def _jitted(case: Case):
    t = case.term()

    def f(lp, batch):
        (value, metrics), (g_lp, g_batch) = jax.value_and_grad(
            lambda x, b: t(x, b), argnums=(0, 1), has_aux=True
        )(lp, batch)
        g_metrics = jax.grad(lambda x: sum(t(x, batch)[1].values()))(lp)
        return value, metrics, g_lp, g_batch, g_metrics

    return jax.jit(f)


def vg(case: Case, lp, batch):
    """((value, metrics), grad) as numpy; also checks no gradient reaches the batch or metrics."""
    out = _jitted(case)(jnp.asarray(lp), batch)
    value, metrics, g_lp, g_batch, g_metrics = jax.device_get(out)
    for name, g in g_batch.fields.items():
        assert g is None or not np.any(g), f"gradient reaches batch field {name}"
    assert not np.any(g_metrics), "a metric is not stop-gradient"
    return (float(value), {k: float(v) for k, v in metrics.items()}), np.asarray(g_lp)


# -- data -----------------------------------------------------------------------------------------


def _arr(shape, lo, hi):
    elements = st.floats(lo, hi, allow_nan=False, allow_subnormal=False, width=64)
    return hnp.arrays(f64, shape, elements=elements)


def make_batch(action, obs, ref_lp, labels, z0, carry=True):
    batch = losses.Batch(
        action_mask=action.astype(f64),
        obs_mask=obs.astype(f64),
        ref_logprobs=ref_lp,
        labels=labels.astype(f64),
        kl_baseline=np.asarray(z0, f64),
    )
    return losses.with_normalizers(batch) if carry else batch


@st.composite
def pair_batches(draw, b=B, t=T):
    """(lp[B, T], Batch): every row has ≥ 1 action token; observation tokens elsewhere; the
    normalizers carried (one pytree structure for every call)."""
    action = draw(hnp.arrays(np.bool_, (b, t)))
    first = draw(hnp.arrays(np.int64, (b,), elements=st.integers(0, t - 1)))
    action[np.arange(b), first] = True
    obs = draw(hnp.arrays(np.bool_, (b, t))) & ~action
    lp = draw(_arr((b, t), -4.0, -0.01))
    ref_lp = np.minimum(lp + draw(_arr((b, t), -1.5, 1.5)), 0.0)
    labels = draw(hnp.arrays(np.bool_, (b,)))
    z0 = draw(st.floats(0.0, 1.0))
    return lp, make_batch(action, obs, ref_lp, labels, z0)


def fixed_batch(seed=0, b=B, t=T, carry=True):
    rng = np.random.default_rng(seed)
    action = rng.uniform(size=(b, t)) < 0.6
    action[np.arange(b), rng.integers(0, t, b)] = True
    obs = (rng.uniform(size=(b, t)) < 0.5) & ~action
    lp = -rng.uniform(0.01, 4.0, (b, t))
    ref_lp = np.minimum(lp + rng.uniform(-1.5, 1.5, (b, t)), 0.0)
    labels = rng.uniform(size=b) < 0.5
    return lp, make_batch(action, obs, ref_lp, labels, rng.uniform(0, 1), carry)


def rows_map(batch, f):
    """Applies ``f`` to every per-row field (leading axis B) of the batch."""
    return jax.tree.map(lambda x: f(np.asarray(x)) if np.ndim(x) >= 1 else x, batch)


# -- 1. the NumPy reference -----------------------------------------------------------------------


@over(CASES)
@per_case
@given(data=pair_batches())
@example(data=fixed_batch(1))
def test_matches_numpy_reference(case, data):
    lp, batch = data
    (value, metrics), grad = vg(case, lp, batch)
    ref_value, ref_grad, ref_metrics = case.reference(lp, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert metrics["loss"] == value
    assert all(np.isfinite(v) for v in metrics.values())
    for key, expected in ref_metrics.items():
        assert metrics[key] == pytest.approx(expected, rel=1e-10, abs=1e-12), key


@over(CASES)
@settings(max_examples=1)
@given(data=pair_batches())
def test_counted_normalizers_equal_carried_ones(case, data):
    # The same batch without carried normalizers (num_rows counted: every row has an action).
    lp, batch = data
    counted = batch.replace(num_rows=None, num_action_tokens=None, num_obs_tokens=None)
    v0, m0 = case.term()(jnp.asarray(lp), counted)
    (v1, _), _ = vg(case, lp, batch)
    np.testing.assert_allclose(float(v0), v1, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(float(v0), case.reference(lp, counted)[0], rtol=1e-10)


# -- 2. masked positions ------------------------------------------------------------------------


@over(CASES)
@per_case
@given(data=pair_batches(), fill=st.sampled_from([np.inf, -np.inf, np.nan, 1e30, -1e30, 200.0]))
def test_masked_positions_are_nan_safe(case, data, fill):
    lp, batch = data
    masked = np.asarray(batch.action_mask) == 0
    bad = batch.replace(ref_logprobs=np.where(masked, fill, np.asarray(batch.ref_logprobs)))
    (value, metrics), grad = vg(case, np.where(masked, fill, lp), bad)
    (value_ok, _), grad_ok = vg(case, lp, batch)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    assert np.all(grad[masked] == 0.0)
    np.testing.assert_allclose(value, value_ok, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(grad, grad_ok, rtol=1e-12, atol=1e-15)


# -- 3. micro-batching, permutation, padding, swap ----------------------------------------------


def pad_rows(lp, batch, rows=B):
    """``lp`` and every per-row field padded with zero rows (all-padding pairs) to ``rows``."""

    def pad(x):
        x = np.asarray(x)
        return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])

    return pad(lp), rows_map(batch, pad)


@over(SPLITTABLE)
@per_case
@given(data=pair_batches(), k=st.sampled_from([1, 2, 4]))
def test_split_batch_reproduces_full_batch(case, data, k):
    # k = 2, 4 cut the 8 rows into chunks of 4 and 2 rows: whole pairs. KTO rows are not pairs:
    # k = 3 (chunks of 3, 3, 2 rows) is exact too. Micro-batches are padded back to 8 rows with
    # zero rows (one compilation): in-graph, such rows count for nothing.
    if not case.paired and k == 4:
        k = 3
    lp, batch = data
    (v_full, _), g_full = vg(case, lp, batch)
    values, grads = [], []
    for sl, part in zip(losses.row_slices(B, k), losses.split_batch(batch, k), strict=True):
        rows = part.shape[0]
        (v, _), g = vg(case, *pad_rows(lp[sl], part))
        assert np.all(g[rows:] == 0)
        values.append(v)
        grads.append(g[:rows])
    np.testing.assert_allclose(sum(values), v_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-12, atol=1e-14)


def _sort_ties(lp, batch) -> bool:
    """Whether AOT's sort keys (S_c − S_r, R_c − R_r, c, ρ over pairs) have a tie."""
    _, _, S, R, _ = ref._rows(lp, batch)
    S, R = np.asarray(S).reshape(-1, 2), np.asarray(R).reshape(-1, 2)
    keys = [S[:, 0] - S[:, 1], R[:, 0] - R[:, 1], S[:, 0] - R[:, 0], S[:, 1] - R[:, 1]]
    return any(len(np.unique(k)) < len(k) for k in keys)


@over(CASES)
@per_case
@given(data=pair_batches(), seed=st.integers(0, 2**31 - 1))
def test_pair_permutation_invariance(case, data, seed):
    # Pairs move together (rows 2k, 2k+1); KTO rows move freely.
    lp, batch = data
    rng = np.random.default_rng(seed)
    if case.paired:
        pairs = rng.permutation(B // 2)
        perm = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
    else:
        perm = rng.permutation(B)
    (v0, m0), g0 = vg(case, lp, batch)
    (v1, m1), g1 = vg(case, lp[perm], rows_map(batch, lambda x: x[perm]))
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    if not (case.sorts and _sort_ties(lp, batch)):  # at ties a sort's gradient is not unique
        np.testing.assert_allclose(g1, g0[perm], rtol=1e-12, atol=1e-14)
    for key in m0:
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-12, atol=1e-14)


@over(CASES)
@per_case
@given(data=pair_batches(t=T - 2), fill=st.sampled_from([np.nan, -np.inf, -3.0]))
def test_padding_columns_change_nothing(case, data, fill):
    # (8, 4) padded with two columns (mask 0, logprobs `fill`) to the compiled (8, 6); the
    # unpadded side is the NumPy reference. (Extra all-padding *pairs* are a check_batch error.)
    lp, batch = data

    def pad(x, value):
        return np.pad(np.asarray(x), ((0, 0), (0, 2)), constant_values=value)

    padded = batch.replace(
        action_mask=pad(batch.action_mask, 0.0),
        obs_mask=pad(batch.obs_mask, 0.0),
        ref_logprobs=pad(batch.ref_logprobs, fill),
    )
    v0, g0, _ = case.reference(lp, batch)
    (v1, m1), g1 = vg(case, pad(lp, fill), padded)
    np.testing.assert_allclose(v1, v0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g1[:, : T - 2], g0, rtol=1e-9, atol=1e-12)
    assert np.all(g1[:, T - 2 :] == 0)
    assert all(np.isfinite(v) for v in m1.values())


@over(PAIRED)
@per_case
@given(data=pair_batches())
@example(data=fixed_batch(2))
def test_swapping_chosen_and_rejected_flips_the_margin(case, data):
    lp, batch = data
    swap = np.arange(B).reshape(-1, 2)[:, ::-1].reshape(-1)
    (_, m0), _ = vg(case, lp, batch)
    (_, m1), _ = vg(case, lp[swap], rows_map(batch, lambda x: x[swap]))
    assert m1["reward_margin"] == pytest.approx(-m0["reward_margin"], rel=1e-12, abs=1e-14)
    assert m1["chosen_reward"] == pytest.approx(m0["rejected_reward"], rel=1e-12, abs=1e-14)
    assert m1["rejected_reward"] == pytest.approx(m0["chosen_reward"], rel=1e-12, abs=1e-14)
    assert m1["reward_accuracy"] + m0["reward_accuracy"] <= 1.0 + 1e-12  # ties count in neither


def test_swap_accuracy_complements_without_ties():
    lp, batch = fixed_batch(3)
    swap = np.arange(B).reshape(-1, 2)[:, ::-1].reshape(-1)
    t = losses.dpo()
    _, m0 = t(lp, batch)
    _, m1 = t(lp[swap], rows_map(batch, lambda x: x[swap]))
    assert float(m0["reward_accuracy"]) + float(m1["reward_accuracy"]) == 1.0


# -- 4. jit, vmap -------------------------------------------------------------------------------


@over(CASES)
@per_case_eager
@given(data=pair_batches())
@example(data=fixed_batch(4))
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
def test_vmap_over_a_stack_of_batches(case):
    t = case.term()
    (lp0, b0), (lp1, b1) = fixed_batch(5), fixed_batch(6)
    stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), b0, b1)
    values, metrics = jax.vmap(t)(jnp.stack([lp0, lp1]), stacked)
    expected = [float(t(jnp.asarray(lp0), b0)[0]), float(t(jnp.asarray(lp1), b1)[0])]
    np.testing.assert_allclose(np.asarray(values), expected, rtol=1e-13, atol=1e-15)
    assert metrics["loss"].shape == (2,)


# -- 5. golden values: docs/sources.md#preference-terms (β = 0.1) ------------------------------------------

# S_c = −10, R_c = −12, S_r = −15, R_r = −14, N_c = 4, N_r = 5: c = 2, ρ = −1, Δ = 3, x = 0.3.
GOLDEN_MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], f64)
GOLDEN_LP = np.array([[-2.5, -2.5, -2.5, -2.5, np.nan], [-3.0] * 5])
GOLDEN_REF = np.array([[-3.0, -3.0, -3.0, -3.0, np.inf], [-2.8] * 5])
GOLDEN = {
    ("sigmoid", 0.0): 0.55436,
    ("hinge", 0.0): 0.7,
    ("ipo", 0.0): 18.49,
    ("robust", 0.1): 0.51686,
    ("sigmoid", 0.1): 0.58436,  # cDPO
    ("bco_pair", 0.0): 1.24254,
    ("sppo_hard", 0.0): 25.0,
    ("nca_pair", 0.0): 1.31941,
    ("apo_zero", 0.0): 0.92519,
    ("apo_down", 0.0): 0.97539,
    ("exo_pair", 1e-3): 2.25820,
    ("discopop", 0.0): 0.74036,
    ("sigmoid_norm", 0.0): 0.65876,
    ("aot", 0.0): 0.55436,  # one pair: AOT reduces to sigmoid
    ("aot_unpaired", 0.0): 0.55436,
}


def close5(x: float, golden: float) -> bool:
    """``x`` agrees with a table value of the reference: within half a unit of its 5th
    significant digit, or of its last printed decimal if that is finer (1.31941)."""
    decimals = len(repr(golden).split(".")[1]) if "." in repr(golden) else 0
    unit = min(10.0 ** (math.floor(math.log10(abs(golden))) - 4), 10.0**-decimals)
    return abs(x - golden) <= 0.5 * unit


def golden_batch():
    return losses.Batch(action_mask=GOLDEN_MASK, ref_logprobs=GOLDEN_REF)


@pytest.mark.parametrize(
    "loss_type, eps", sorted(GOLDEN), ids=[f"{k}-{e}" for k, e in sorted(GOLDEN)]
)
def test_dpo_golden_values(loss_type, eps):
    t = losses.dpo(beta=0.1, loss_type=loss_type, label_smoothing=eps)
    value, metrics = t(GOLDEN_LP, golden_batch())
    assert close5(float(value), GOLDEN[loss_type, eps])
    # the NumPy reference agrees on the same golden input
    ref_value = ref.dpo_ref(
        np.nan_to_num(GOLDEN_LP), golden_batch(), loss_type=loss_type, label_smoothing=eps
    )[0]
    assert close5(ref_value, GOLDEN[loss_type, eps])
    # §4.3 metrics: TRL/tinker margin 0.3 (β-scaled), fw-ai margin 3 (= margin/β), accuracy 1
    assert float(metrics["reward_margin"]) == pytest.approx(0.3, rel=1e-12)
    assert float(metrics["reward_margin"]) / 0.1 == pytest.approx(3.0, rel=1e-12)
    assert float(metrics["reward_accuracy"]) == 1.0
    assert float(metrics["chosen_reward"]) == pytest.approx(0.2, rel=1e-12)
    assert float(metrics["rejected_reward"]) == pytest.approx(-0.1, rel=1e-12)


def test_dpo_golden_gradient():
    # ∂/∂S_c = −β(1 − σ(x)) = −0.042556, +0.042556 for S_r; spread on each action token.
    b = golden_batch()
    g = np.asarray(jax.grad(lambda x: losses.dpo()(x, b)[0])(jnp.asarray(GOLDEN_LP)))
    np.testing.assert_allclose(g[0, :4], -0.042556, rtol=1e-5)
    np.testing.assert_allclose(g[1], 0.042556, rtol=1e-5)
    assert g[0, 4] == 0.0


def test_ipo_is_per_token_averaged_not_summed():
    # Peer difference (§4.1): TRL averages per token (18.49); OpenRLHF DPOLoss(ipo=True) sums
    # (4.0). Ours is TRL's.
    value = float(losses.dpo(loss_type="ipo")(GOLDEN_LP, golden_batch())[0])
    assert value == pytest.approx(18.49, rel=1e-12)
    assert value != pytest.approx(4.0)
    # ... hence invariant to repeating every completion's tokens (same per-token logps).
    lp2 = np.concatenate([GOLDEN_LP, GOLDEN_LP], axis=1)
    b2 = losses.Batch(
        action_mask=np.concatenate([GOLDEN_MASK] * 2, 1),
        ref_logprobs=np.concatenate([GOLDEN_REF] * 2, 1),
    )
    assert float(losses.dpo(loss_type="ipo")(lp2, b2)[0]) == pytest.approx(value, rel=1e-12)
    assert float(losses.dpo(loss_type="sigmoid")(lp2, b2)[0]) != pytest.approx(0.55436, rel=1e-3)


def test_simpo_golden():
    # β = 2, γ = 1, average logps −2.5 vs −3.0: −logσ(0) = 0.69315.
    lp = np.array([[-2.0, -3.0, np.nan], [-3.0, -3.0, -3.0]])
    b = losses.Batch(action_mask=np.array([[1.0, 1, 0], [1, 1, 1]]))
    assert close5(float(losses.simpo(beta=2.0, gamma=1.0)(lp, b)[0]), 0.69315)
    t = losses.cpo(beta=2.0, loss_type="simpo", simpo_gamma=1.0, cpo_alpha=0.0)
    assert close5(float(t(lp, b)[0]), 0.69315)


def test_orpo_golden():
    # ℓ_c = −0.5, ℓ_r = −1.0: lor = 0.97408, logσ(lor) = −0.32030; TRL adds β·0.32030 =
    # +0.032030 to the NLL (β = 0.1); fw-ai adds +0.32030 per pair (λ = 1).
    lp = np.array([[-0.25, -0.75], [-1.0, -1.0]])
    b = losses.Batch(action_mask=np.ones((2, 2)))
    for beta, added in ((0.1, 0.032030), (1.0, 0.32030)):
        loss, m = losses.orpo(beta=beta)(lp, b)
        assert close5(float(m["log_odds_chosen"]), 0.97408)
        assert close5(float(m["log_odds_ratio"]), -0.32030)
        assert float(m["nll"]) == pytest.approx(0.5, rel=1e-12)
        assert close5(float(loss) - float(m["nll"]), added)


def test_kto_golden():
    # c = 2, ρ = −1, KL log-ratios [0.5, −0.1] so z0 = 0.2: chosen 0.45512, rejected 0.47004,
    # loss 0.46258.
    kl_lp = np.array([[-1.0, -0.5], [-2.0, np.nan]])
    kl_batch = losses.Batch(
        action_mask=np.array([[1.0, 1.0], [1.0, 0.0]]),
        ref_logprobs=np.array([[-1.5, -0.5], [-1.9, 0.3]]),
    )
    z0 = losses.kto_kl_baseline(kl_lp, kl_batch)
    assert z0.shape == () and float(z0) == pytest.approx(0.2, rel=1e-12)
    assert ref.kto_kl_baseline_ref(np.nan_to_num(kl_lp), kl_batch) == pytest.approx(0.2)
    b = golden_batch().replace(labels=np.array([1.0, 0.0]), kl_baseline=z0)
    loss, m = losses.kto()(GOLDEN_LP, b)
    assert close5(float(loss), 0.46258)
    for row, expected in ((0, 0.45512), (1, 0.47004)):  # each row alone: its own loss
        single = losses.Batch(
            action_mask=GOLDEN_MASK[row : row + 1],
            ref_logprobs=GOLDEN_REF[row : row + 1],
            labels=np.array([1.0 - row]),
            kl_baseline=z0,
        )
        value = float(losses.kto()(GOLDEN_LP[row : row + 1], single)[0])
        assert close5(value, expected)
    assert float(m["kl_baseline"]) == pytest.approx(0.2)
    assert float(m["reward_margin"]) == pytest.approx(0.3, rel=1e-12)


def test_kto_kl_baseline_is_clamped_at_zero_and_stop_gradient():
    b = losses.Batch(action_mask=np.ones((2, 1)), ref_logprobs=np.array([[-1.0], [-1.0]]))
    lp = jnp.array([[-2.0], [-1.5]])
    assert float(losses.kto_kl_baseline(lp, b)) == 0.0
    lp_pos = jnp.array([[-0.5], [-0.9]])
    assert float(losses.kto_kl_baseline(lp_pos, b)) == pytest.approx(0.3)
    assert not np.any(jax.grad(lambda x: losses.kto_kl_baseline(x, b))(lp_pos))
    assert float(jax.jit(losses.kto_kl_baseline)(lp_pos, b)) == pytest.approx(0.3)


# -- 6. regressions for the peer bugs and differences of §4 --------------------------------------


def test_sigmoid_without_smoothing_is_trl_plain_dpo():
    # TRL #3906 removed label smoothing from `sigmoid`; with ε = 0 ours is exactly −logσ(x).
    lp, batch = fixed_batch(7)
    _, _, S, R, _ = ref._rows(lp, batch)
    x = [0.1 * ((S[2 * k] - R[2 * k]) - (S[2 * k + 1] - R[2 * k + 1])) for k in range(B // 2)]
    expected = sum(math.log1p(math.exp(-v)) for v in x) / (B // 2)
    assert float(losses.dpo()(lp, batch)[0]) == pytest.approx(expected, rel=1e-12)


SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")


@pytest.mark.parametrize("loss_type", [t for t in losses.DPO_LOSS_TYPES if t not in SMOOTHED])
def test_label_smoothing_is_refused_where_it_has_no_effect(loss_type):
    # TRL silently ignores label_smoothing for these loss types; here it is an error.
    with pytest.raises(ValueError, match="label_smoothing=0.1 has no effect"):
        losses.dpo(loss_type=loss_type, label_smoothing=0.1)


def test_label_smoothing_scope_in_cpo_and_exo_needs_a_positive_epsilon():
    with pytest.raises(ValueError, match="label_smoothing must be in \\(0.0, 1.0\\)"):
        losses.dpo(loss_type="exo_pair")
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0.0, 0.5\\)"):
        losses.dpo(loss_type="robust", label_smoothing=0.5)
    for lt in ("hinge", "ipo"):
        with pytest.raises(ValueError, match="has no effect"):
            losses.cpo(loss_type=lt, label_smoothing=0.1)
    assert losses.cpo(loss_type="simpo", label_smoothing=0.1).config["label_smoothing"] == 0.1


def test_smoothing_changes_exactly_the_types_that_read_it():
    lp, batch = fixed_batch(8)
    for lt in ("sigmoid", "robust", "aot", "aot_unpaired"):
        v0 = float(losses.dpo(loss_type=lt)(lp, batch)[0])
        v1 = float(losses.dpo(loss_type=lt, label_smoothing=0.1)(lp, batch)[0])
        assert v0 != v1, lt


def test_cpo_default_adds_the_nll_and_simpo_is_cpo_without_it():
    # TRL's CPO `simpo` adds cpo_alpha·NLL with cpo_alpha = 1.0 by default: pure SimPO needs 0.
    lp, batch = fixed_batch(9)
    pure = float(losses.simpo()(lp, batch)[0])
    assert float(losses.cpo(loss_type="simpo", cpo_alpha=0.0)(lp, batch)[0]) == pure
    with_nll, m = losses.cpo(loss_type="simpo")(lp, batch)
    assert float(with_nll) == pytest.approx(pure + float(m["nll"]), rel=1e-12)


def test_orpo_and_cpo_nll_cover_only_action_tokens():
    # TRL's ORPO NLL includes prompt tokens; ours reads action tokens only: logprobs elsewhere
    # (prompt, observation) change nothing.
    lp, batch = fixed_batch(10)
    other = np.where(np.asarray(batch.action_mask) > 0, lp, -7.0)
    for t in (losses.orpo(), losses.cpo()):
        assert float(t(other, batch)[0]) == float(t(lp, batch)[0])


def test_orpo_mean_logprob_clamp_keeps_log1mexp_finite():
    # A completion whose tokens all have logprob 0 (or a float32 hair above) would give
    # log(1 − e^0) = −inf; the clamp at −1e-6 keeps value and gradient finite.
    lp = jnp.array([[0.0, 1e-5], [-1.0, -2.0]])
    b = losses.Batch(action_mask=jnp.ones((2, 2)))
    (value, m), g = jax.value_and_grad(losses.orpo(), has_aux=True)(lp, b)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(g)))
    v_ref, g_ref, _ = ref.orpo_ref(np.asarray(lp), b)
    assert float(value) == pytest.approx(v_ref, rel=1e-12)
    np.testing.assert_allclose(np.asarray(g), g_ref, rtol=1e-10, atol=1e-14)


def test_odd_rows_are_refused_not_dropped():
    # tinker-cookbook drops a trailing unpaired datum silently; here it is an error.
    lp = np.full((3, 2), -1.0)
    b = losses.Batch(action_mask=np.ones((3, 2)), ref_logprobs=np.full((3, 2), -1.0))
    with pytest.raises(ValueError, match="3 rows, an odd"):
        losses.dpo()(lp, b)
    with pytest.raises(ValueError, match="3 rows, an odd"):
        jax.jit(losses.dpo())(lp, b)
    with pytest.raises(ValueError, match="odd row count"):
        losses.check_batch(b, lp, term=losses.dpo())


def test_microbatch_values_are_shares_not_means():
    # fw-ai backprops the sum of micro-batch *means* (k times the full mean's gradient with k
    # micro-batches); ours: the micro-batch values are shares that sum to the full mean.
    lp, batch = fixed_batch(11)
    t = losses.dpo()
    full = float(t(lp, batch)[0])
    parts = [
        float(t(lp[sl], part)[0])
        for sl, part in zip(losses.row_slices(B, 2), losses.split_batch(batch, 2), strict=True)
    ]
    assert sum(parts) == pytest.approx(full, rel=1e-12)
    alone = [
        float(t(lp[sl], part.replace(num_rows=None))[0])
        for sl, part in zip(losses.row_slices(B, 2), losses.split_batch(batch, 2), strict=True)
    ]
    assert sum(alone) == pytest.approx(2 * full, rel=1e-12)  # each alone is its own mean


def test_kto_baseline_is_data_the_micro_batches_share():
    # TRL computes z0 from the (gathered) batch; a per-micro-batch z0 would differ. The field is
    # never sliced, so every micro-batch carries the full batch's z0.
    lp, batch = fixed_batch(12)
    z0 = losses.kto_kl_baseline(lp, batch)
    batch = batch.replace(kl_baseline=z0)
    for part in losses.split_batch(batch, 4):
        assert float(part.kl_baseline) == float(z0)
    z_parts = [
        float(losses.kto_kl_baseline(lp[sl], part))
        for sl, part in zip(losses.row_slices(B, 4), losses.split_batch(batch, 4), strict=True)
    ]
    assert any(z != pytest.approx(float(z0)) for z in z_parts)


def test_apo_zero_unpaired_is_kto_with_zero_baseline():
    lp, batch = fixed_batch(13)
    a = float(losses.kto(loss_type="apo_zero_unpaired")(lp, batch.replace(kl_baseline=None))[0])
    k = float(losses.kto()(lp, batch.replace(kl_baseline=np.array(0.0)))[0])
    assert a == pytest.approx(k, rel=1e-12)


def test_aot_sorts_across_pairs():
    # Two one-token pairs: S_c − S_r = (1, 3), R_c − R_r = (2, 0). Per pair (sigmoid) the margins
    # are Δ = (−1, 3); AOT matches sorted quantiles: d = (1, 3) − (0, 2) = (1, 1).
    lp = np.array([[-1.0], [-2.0], [-1.0], [-4.0]])
    b = losses.Batch(
        action_mask=np.ones((4, 1)), ref_logprobs=np.array([[-1.0], [-3.0], [-2.0], [-2.0]])
    )
    beta = 0.1
    aot = float(losses.dpo(loss_type="aot")(lp, b)[0])
    assert aot == pytest.approx(math.log1p(math.exp(-beta * 1.0)), rel=1e-12)
    sig = float(losses.dpo(loss_type="sigmoid")(lp, b)[0])
    expected_sig = (math.log1p(math.exp(beta)) + math.log1p(math.exp(-3 * beta))) / 2
    assert sig == pytest.approx(expected_sig, rel=1e-12)
    assert aot == pytest.approx(ref.dpo_ref(lp, b, loss_type="aot")[0], rel=1e-12)
    # unpaired: c = (0, 1), ρ = (1, −2) → d = sort(c) − sort(ρ) = (0 − (−2), 1 − 1) = (2, 0)
    unpaired = float(losses.dpo(loss_type="aot_unpaired")(lp, b)[0])
    expected = (math.log1p(math.exp(-2 * beta)) + math.log(2)) / 2
    assert unpaired == pytest.approx(expected, rel=1e-12)


# -- 7. β limits ----------------------------------------------------------------------------------


def test_small_beta_limits():
    lp, batch = fixed_batch(15)
    P = B // 2
    beta = 1e-7
    value, grad = jax.value_and_grad(lambda x: losses.dpo(beta=beta)(x, batch)[0])(lp)
    # β → 0: −logσ(x) → log 2, ∂L/∂S_c → −β/(2P), ∂L/∂S_r → +β/(2P).
    assert float(value) == pytest.approx(math.log(2), abs=1e-5)
    m = np.asarray(batch.action_mask)
    sign = np.where(np.arange(B) % 2 == 0, -1.0, 1.0)[:, None]
    np.testing.assert_allclose(np.asarray(grad) / beta, sign * m / (2 * P), rtol=1e-4, atol=1e-12)
    # hinge: for x < 1 the loss is 1 − x, so the gradient is exactly ∓β/P.
    hinge = jax.grad(lambda x: losses.dpo(beta=beta, loss_type="hinge")(x, batch)[0])(lp)
    np.testing.assert_allclose(np.asarray(hinge), beta * sign * m / P, rtol=1e-12)


def test_simpo_margin_is_gamma_over_beta():
    # −logσ(β(Δ − γ/β)): at Δ = γ/β the loss is log 2 for every β.
    b = losses.Batch(action_mask=np.ones((2, 1)))
    for beta, gamma in ((0.1, 0.5), (2.0, 1.0), (5.0, 0.2)):
        lp = jnp.array([[-1.0], [-1.0 - gamma / beta]])
        v = float(losses.simpo(beta=beta, gamma=gamma)(lp, b)[0])
        assert v == pytest.approx(math.log(2), rel=1e-9)


# -- 8. bad pairs: check_batch errors, NaN-safe traced term -------------------------------------


def _pair_batch(action):
    action = np.asarray(action, f64)
    return losses.Batch(action_mask=action, ref_logprobs=np.full(action.shape, -1.0))


@pytest.mark.parametrize(
    "term", [losses.dpo(), losses.simpo(), losses.cpo(), losses.orpo()], ids=repr
)
def test_check_batch_names_the_pair_and_the_rule(term):
    lp = np.full((4, 3), -1.0)
    good = _pair_batch(np.ones((4, 3)))
    losses.check_batch(good, lp, term=term)
    rejected_empty = _pair_batch([[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="pair 1 has an empty rejected completion \\(row 3"):
        losses.check_batch(rejected_empty, lp, term=term)
    chosen_empty = _pair_batch([[0, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match="pair 0 has an empty chosen completion \\(row 0"):
        losses.check_batch(chosen_empty, lp, term=term)
    with pytest.raises(ValueError, match="odd row count"):
        losses.check_batch(_pair_batch(np.ones((3, 3))), lp[:3], term=term)
    with pytest.raises(ValueError, match="num_rows = 5 is odd"):
        losses.check_batch(good.replace(num_rows=np.array(5.0)), lp, term=term)
    with pytest.raises(ValueError, match="fold term 'pref'.*pair 1 has an empty rejected"):
        losses.check_batch(rejected_empty, lp, term=losses.fold(("pref", term)))


def test_check_batch_kto_rules():
    lp = np.full((3, 2), -1.0)
    b = losses.Batch(
        action_mask=np.array([[1.0, 1], [1, 0], [0, 0]]),
        ref_logprobs=np.full((3, 2), -1.0),
        labels=np.array([1.0, 0, 1]),
        kl_baseline=np.array(0.1),
    )
    with pytest.raises(ValueError, match="kto: row 2 has an empty completion"):
        losses.check_batch(b, lp, term=losses.kto())
    full = b.replace(action_mask=np.ones((3, 2)))
    losses.check_batch(full, lp, term=losses.kto())  # odd rows are fine: not pairs
    with pytest.raises(ValueError, match="kl_baseline.*kto_kl_baseline"):
        losses.check_batch(full.replace(kl_baseline=None), lp, term=losses.kto())
    losses.check_batch(
        full.replace(kl_baseline=None), lp, term=losses.kto(loss_type="apo_zero_unpaired")
    )
    with pytest.raises(ValueError, match="needs batch field 'labels'"):
        losses.check_batch(full.replace(labels=None), lp, term=losses.kto())
    with pytest.raises(ValueError, match="needs batch field 'kl_baseline'"):
        losses.kto()(lp, full.replace(kl_baseline=None))


@over(CASES)
def test_empty_completions_are_nan_safe_and_count_for_nothing(case):
    # Data check_batch rejects: pair 1 has an empty rejected completion, pair 3 is all padding.
    # Traced, the term stays finite; those pairs (KTO: rows) contribute 0 with zero gradient.
    lp, batch = fixed_batch(16)
    action = np.asarray(batch.action_mask).copy()
    action[3] = 0.0
    action[6:] = 0.0
    obs = np.where(action > 0, 0.0, np.asarray(batch.obs_mask))
    obs[3] = obs[6:] = 0.0
    bad = batch.replace(action_mask=action, obs_mask=obs, num_rows=None)
    bad_lp = np.where(action > 0, lp, np.nan)
    bad = bad.replace(ref_logprobs=np.where(action > 0, np.asarray(batch.ref_logprobs), np.nan))
    bad = losses.with_normalizers(bad.replace(num_action_tokens=None, num_obs_tokens=None))
    (value, metrics), grad = vg(case, bad_lp, bad)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    dead = [2, 3, 6, 7] if case.paired else [3, 6, 7]
    assert np.all(grad[dead] == 0.0)
    v_ref, g_ref, _ = case.reference(np.nan_to_num(bad_lp), bad)
    np.testing.assert_allclose(value, v_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, g_ref, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="empty"):
        losses.check_batch(bad, term=case.term())


# -- 9. constructors ----------------------------------------------------------------------------


@over(CASES)
def test_config_holds_every_keyword_and_rebuilds_the_term(case):
    t = case.term()
    json.dumps(dict(t.config))
    assert set(t.config) == set(inspect.signature(getattr(losses, case.ctor)).parameters)
    rebuilt = getattr(losses, t.kind)(**t.config)
    assert rebuilt.config == t.config and t.kind == case.ctor and t.twin is None
    lp, batch = fixed_batch(17)
    assert float(rebuilt(lp, batch)[0]) == float(t(lp, batch)[0])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: losses.dpo(beta=0.0), "dpo: beta must be > 0"),
        (lambda: losses.dpo(beta=-1), "dpo: beta must be > 0"),
        (lambda: losses.dpo(beta=True), "dpo: beta must be a number"),
        (lambda: losses.dpo(loss_type="kto"), "dpo: unknown loss_type 'kto'"),
        (lambda: losses.dpo(label_smoothing=0.6), "label_smoothing must be in \\[0.0, 0.5\\]"),
        (lambda: losses.dpo(label_smoothing=-0.1), "label_smoothing must be in"),
        (lambda: losses.dpo(discopop_tau=0.1), "discopop_tau=0.1 has no effect"),
        (lambda: losses.dpo(loss_type="discopop", discopop_tau=0), "discopop_tau must be > 0"),
        (lambda: losses.cpo(loss_type="simpo", cpo_alpha=-1), "cpo_alpha must be >= 0"),
        (lambda: losses.cpo(simpo_gamma=1.0), "simpo_gamma=1.0 has no effect"),
        (lambda: losses.cpo(loss_type="dpo"), "cpo: unknown loss_type"),
        (lambda: losses.cpo(alpha=float("nan")), "alpha must be finite"),
        (lambda: losses.simpo(gamma=-0.1), "simpo: gamma must be >= 0"),
        (lambda: losses.simpo(label_smoothing=0.7), "label_smoothing must be in"),
        (lambda: losses.orpo(beta=0), "orpo: beta must be > 0"),
        (lambda: losses.kto(desirable_weight=-1), "desirable_weight must be >= 0"),
        (lambda: losses.kto(undesirable_weight="1"), "undesirable_weight must be a number"),
        (lambda: losses.kto(loss_type="sigmoid"), "kto: unknown loss_type"),
    ],
)
def test_constructor_errors_name_the_parameter_and_rule(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_declared_reads_and_requires():
    pair = {"action_mask", "obs_mask", "num_rows"}
    assert losses.dpo().reads == pair | {"ref_logprobs"}
    assert losses.dpo().requires == {"action_mask", "ref_logprobs"}
    assert losses.dpo(loss_type="sft").reads == pair
    for t in (losses.simpo(), losses.cpo(), losses.orpo()):
        assert t.reads == pair and t.requires == {"action_mask"}
    assert losses.kto().reads == pair | {"ref_logprobs", "labels", "kl_baseline"}
    assert "kl_baseline" not in losses.kto(loss_type="apo_zero_unpaired").reads


@pytest.mark.parametrize(
    "field", ["sampling_logprobs", "advantages", "weights", "teacher_logprobs"]
)
def test_undeclared_fields_change_nothing(field):
    lp, batch = fixed_batch(18)
    garbage = {
        "sampling_logprobs": np.full((B, T), np.nan),
        "advantages": np.full((B,), np.nan),
        "weights": np.full((B, T), np.nan),
        "teacher_logprobs": np.full((B, T), np.nan),
    }[field]
    for t in (losses.dpo(), losses.cpo(), losses.orpo(), losses.kto(), losses.simpo()):
        v0 = float(t(lp, batch)[0])
        assert float(t(lp, batch.replace(**{field: garbage}))[0]) == v0


def test_fold_with_sft_and_split():
    # A fold of a preference term with another term keeps the split exact (whole pairs).
    lp, batch = fixed_batch(19)
    t = losses.fold(losses.dpo(), losses.sft_cross_entropy())
    full = float(t(lp, batch)[0])
    parts = sum(
        float(t(lp[sl], part)[0])
        for sl, part in zip(losses.row_slices(B, 2), losses.split_batch(batch, 2), strict=True)
    )
    assert parts == pytest.approx(full, rel=1e-12)


# -- 10. the NumPy reference's own derivatives, and the doctests --------------------------------


@pytest.mark.parametrize("loss_type", [t for t in losses.DPO_LOSS_TYPES if not t.startswith("aot")])
def test_reference_derivatives_match_finite_differences(loss_type):
    eps = 0.2 if loss_type in ("sigmoid", "robust", "exo_pair") else 0.0
    kw = dict(beta=0.3, eps=eps, tau=0.4)
    for S_c, S_r in ((-10.0, -15.0), (-3.0, -2.0), (-7.5, -7.0)):

        def f(sc, sr):
            return ref.dpo_pair(loss_type, sc, -12.0, sr, -14.0, 4.0, 5.0, **kw)[0]

        _, d_c, d_r = ref.dpo_pair(loss_type, S_c, -12.0, S_r, -14.0, 4.0, 5.0, **kw)
        fd_c, fd_r = ref.finite_difference(f, S_c, S_r)
        assert d_c == pytest.approx(fd_c, rel=1e-6, abs=1e-8)
        assert d_r == pytest.approx(fd_r, rel=1e-6, abs=1e-8)


def test_reference_cpo_orpo_kto_derivatives_match_finite_differences():
    for lt in losses.CPO_LOSS_TYPES:
        for alpha in (0.0, 0.2):
            kw = dict(beta=0.7, eps=0.1 if lt in ("sigmoid", "simpo") else 0.0, alpha=alpha)
            _, d_c, d_r, _, _ = ref.cpo_pair(lt, -6.0, -8.0, 3.0, 4.0, **kw)
            fd = ref.finite_difference(
                lambda a, b: ref.cpo_pair(lt, a, b, 3.0, 4.0, **kw)[0], -6.0, -8.0
            )
            assert (d_c, d_r) == pytest.approx(fd, rel=1e-6, abs=1e-8)
    _, d_c, d_r, *_ = ref.orpo_pair(-2.0, -5.0, 3.0, 4.0, beta=0.4)
    fd = ref.finite_difference(lambda a, b: ref.orpo_pair(a, b, 3.0, 4.0, beta=0.4)[0], -2.0, -5.0)
    assert (d_c, d_r) == pytest.approx(fd, rel=1e-6, abs=1e-8)
    for label in (0.0, 1.0):
        _, d = ref.kto_row(1.3, label, beta=0.5, z0=0.2, w_d=1.5, w_u=0.7)
        fd, _ = ref.finite_difference(
            lambda a, b: ref.kto_row(a, label, beta=0.5, z0=0.2, w_d=1.5, w_u=0.7)[0], 1.3, 0.0
        )
        assert d == pytest.approx(fd, rel=1e-6)


def test_docstring_examples_run():
    module = importlib.import_module("losses._preference")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 6 and result.failed == 0
