"""Distillation terms (losses/_distill.py): NumPy references, golden values, properties.

Golden values are docs/sources.md#distillation (sampled-token and top-K worked examples, GKD
JSD), §2.1 (exact enumeration over a vocabulary of 3) and §7 (top-K entropy). The per-case
properties run on one shape, (4, 6) (top-K: (4, 6, 3)), and the (2, 6) micro-batches of
`split_batch`, so each case compiles twice (`tests.cases.value_and_grad`, which also checks on
every call that no gradient reaches the batch and that the metrics are stop-gradient).
"""

from __future__ import annotations

import dataclasses
import doctest
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import losses
from losses import _distill
from tests import numpy_ref_distill as ref
from tests.cases import freeze, spec
from tests.cases import value_and_grad as vg
from tests.strategies import _arr, policy_batches

B, T, K = 4, 6, 3
per_case = settings(max_examples=max(3, settings.default.max_examples // 5))


# -- cases --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DCase:
    id: str
    ctor: str
    kwargs: tuple

    @property
    def config(self) -> dict:
        return dict(self.kwargs)

    @property
    def topk(self) -> bool:
        return self.ctor.startswith("topk_")

    @property
    def spec(self):
        return spec(self.ctor, **self.config)

    def term(self) -> losses.Term:
        return getattr(losses, self.ctor)(**self.config)

    def reference(self, lp, batch):
        if not self.topk:
            return ref.reverse_kl_ref(lp, batch, **self.config)
        cfg = self.term().config  # resolved renormalize
        opts = {k: cfg[k] for k in ("renormalize", "tail")}
        if self.ctor == "topk_jsd":
            opts["beta"] = cfg["beta"]
        return ref.topk_ref(
            self.ctor,
            lp,
            batch,
            coef=cfg["coef"],
            reduction=cfg["reduction"],
            max_tokens=cfg["max_tokens"],
            **opts,
        )


def _case(i, ctor, **kwargs):
    return DCase(id=f"d{i:02d}-{ctor}", ctor=ctor, kwargs=freeze(kwargs))


RKL = "reverse_kl_distillation"
CASES = [
    _case(0, RKL),
    _case(1, RKL, reduction="token_sum", discount=0.5, coef=0.7),
    _case(2, RKL, form="k2", reduction="seq_mean_token_mean"),
    _case(3, RKL, form="k3"),
    _case(4, RKL, form="k3", reduction="seq_mean_token_sum_norm", max_tokens=8, coef=2.0),
    _case(5, RKL, form="ref_kl"),
    _case(6, RKL, form="ref_kl", kl_tau=0.05, prob_delta_low=0.05, reduction="seq_mean_token_sum"),
    _case(10, "topk_forward_kl"),
    _case(11, "topk_forward_kl", tail=True),
    _case(12, "topk_forward_kl", renormalize="both", reduction="seq_mean_token_mean"),
    _case(13, "topk_forward_kl", renormalize="teacher", reduction="token_sum", coef=0.5),
    _case(14, "topk_reverse_kl"),
    _case(15, "topk_reverse_kl", tail=True, coef=0.5, reduction="seq_mean_token_sum"),
    _case(16, "topk_jsd"),
    _case(17, "topk_jsd", beta=0.3, tail=True, reduction="token_sum"),
]
SAMPLED = [c for c in CASES if not c.topk]
TOPK = [c for c in CASES if c.topk]


def over(cases):
    return pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])


# -- strategies ---------------------------------------------------------------------------------


@st.composite
def sampled_batches(draw, shapes=((B, T),)):
    """`policy_batches` plus teacher logprobs near the current logprobs."""
    lp, batch = draw(policy_batches(shapes=list(shapes)))
    teacher = np.minimum(lp + draw(_arr(lp.shape, -1.5, 1.5)), 0.0)
    return lp, batch.replace(teacher_logprobs=teacher)


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@st.composite
def topk_batches(draw, shapes=((B, T, K),)):
    """(student logprobs[B, T, K], Batch with teacher_topk_logprobs): the K entries are the first
    K of a (K + 2)-token log-softmax, so every top-K mass is < 1 (the tail stays off its clamp)."""
    b, t, k = draw(st.sampled_from(list(shapes)))
    action = draw(hnp.arrays(np.bool_, (b, t)))
    obs = draw(hnp.arrays(np.bool_, (b, t))) & ~action
    zs = draw(_arr((b, t, k + 2), -3.0, 3.0))
    zt = draw(_arr((b, t, k + 2), -3.0, 3.0))
    batch = losses.Batch(
        action_mask=action.astype(np.float64),
        obs_mask=obs.astype(np.float64),
        teacher_topk_logprobs=_log_softmax(zt)[..., :k],
    )
    return _log_softmax(zs)[..., :k], batch


def fixed_sampled(seed=0, b=B, t=T):
    """A deterministic (logprobs, Batch) like `sampled_batches`."""
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.05, 4.0, (b, t))
    old = np.minimum(lp + rng.uniform(-1, 1, (b, t)), 0)
    action = rng.uniform(size=(b, t)) < 0.7
    batch = losses.Batch(
        action_mask=action.astype(float),
        obs_mask=(~action & (rng.uniform(size=(b, t)) < 0.5)).astype(float),
        sampling_logprobs=np.minimum(old + rng.uniform(-1, 1, (b, t)), 0),
        old_logprobs=old,
        teacher_logprobs=np.minimum(lp + rng.uniform(-1.5, 1.5, (b, t)), 0),
    )
    return lp, batch


def fixed_topk(seed=0, b=B, t=T, k=K):
    """A deterministic (logprobs[B, T, K], Batch) like `topk_batches`."""
    rng = np.random.default_rng(seed)
    action = rng.uniform(size=(b, t)) < 0.7
    batch = losses.Batch(
        action_mask=action.astype(float),
        obs_mask=(~action & (rng.uniform(size=(b, t)) < 0.5)).astype(float),
        teacher_topk_logprobs=_log_softmax(rng.uniform(-3, 3, (b, t, k + 2)))[..., :k],
    )
    return _log_softmax(rng.uniform(-3, 3, (b, t, k + 2)))[..., :k], batch


def draw_for(case):
    return topk_batches() if case.topk else sampled_batches()


def _away_from_kinks(case, lp, batch):
    """The verl clamp at 0 is a kink: keep finite differences away from it."""
    if case.ctor == "topk_forward_kl" and case.term().config["renormalize"] == "none":
        if not case.config.get("tail"):
            t = np.asarray(batch.teacher_topk_logprobs)
            d = (np.exp(t) * (t - lp)).sum(-1)
            assume(not np.any((np.asarray(batch.action_mask) > 0) & (np.abs(d) < 1e-4)))


# -- 1. NumPy reference -------------------------------------------------------------------------


@over(CASES)
@per_case
@given(data=st.data())
def test_matches_numpy_reference(case, data):
    lp, batch = data.draw(draw_for(case))
    _away_from_kinks(case, lp, batch)
    (value, metrics), grad = vg(case.spec, lp, batch)
    ref_value, ref_grad = case.reference(lp, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    if case.topk:  # central finite differences, step 1e-6: their error grows as the tail
        # 1 - sum(p) shrinks (a drawn student = teacher with a 1% tail: FD 1.7e-9, true gradient 0)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-8)
    else:
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert metrics["loss"] == value
    assert all(np.isfinite(v) for v in metrics.values())
    action = np.asarray(batch.action_mask) > 0
    assert metrics["num_tokens"] == action.sum()
    if not action.any():
        return
    if case.topk:
        t = np.asarray(batch.teacher_topk_logprobs)
        assert metrics["teacher_mass"] == pytest.approx(np.exp(t).sum(-1)[action].mean())
        assert metrics["student_mass"] == pytest.approx(np.exp(lp).sum(-1)[action].mean())
        cfg = case.term().config
        approx = "tail" if cfg["tail"] else {"both": "renormalized"}.get(cfg["renormalize"])
        t_approx = "renormalized" if cfg["renormalize"] == "teacher" else approx or "truncated"
        s_approx = approx or "truncated"
        h_t = np.mean([ref.topk_entropy_ref(list(x), t_approx) for x in t[action]])
        h_s = np.mean([ref.topk_entropy_ref(list(x), s_approx) for x in lp[action]])
        assert metrics["teacher_entropy"] == pytest.approx(h_t, rel=1e-10)
        assert metrics["student_entropy"] == pytest.approx(h_s, rel=1e-10)
    else:
        teacher = np.asarray(batch.teacher_logprobs)
        assert metrics["teacher_kl"] == pytest.approx((lp - teacher)[action].mean(), rel=1e-10)


@pytest.mark.parametrize(
    "opts",
    [
        ("topk_forward_kl", dict(tail=True)),
        ("topk_forward_kl", dict(renormalize="both")),
        ("topk_forward_kl", dict(renormalize="teacher")),
        ("topk_forward_kl", dict()),
        ("topk_reverse_kl", dict(renormalize="both")),
        ("topk_reverse_kl", dict(tail=True)),
    ],
)
def test_topk_closed_form_gradients_match_finite_differences(opts):
    # The docstring gradient formulas against the NumPy finite difference, on random positions.
    kind, kw = opts
    rng = np.random.default_rng(3)
    for _ in range(20):
        s = list(_log_softmax(rng.normal(size=K + 2))[:K])
        t = list(_log_softmax(rng.normal(size=K + 2))[:K])
        full = dict(renormalize=kw.get("renormalize", "none"), tail=kw.get("tail", False))
        fd = ref.topk_grad_fd(kind, s, t, **full)
        np.testing.assert_allclose(ref.topk_grad_analytic(kind, s, t, **full), fd, atol=1e-8)


# -- 2. masked positions ------------------------------------------------------------------------


@over(CASES)
@per_case
@given(data=st.data(), fill=st.sampled_from([np.inf, -np.inf, np.nan, 1e30, -1e30, 200.0]))
def test_masked_positions_are_nan_safe(case, data, fill):
    lp, batch = data.draw(draw_for(case))
    masked = np.asarray(batch.action_mask) == 0
    if case.topk:
        m3 = masked[..., None]
        bad_lp = np.where(m3, fill, lp)
        changes = {
            "teacher_topk_logprobs": np.where(m3, fill, np.asarray(batch.teacher_topk_logprobs))
        }
    else:
        bad_lp = np.where(masked, fill, lp)
        opposite = -fill if np.isfinite(fill) else fill
        changes = {
            name: np.where(masked, value, np.asarray(batch.get(name)))
            for name, value in (
                ("teacher_logprobs", opposite),
                ("old_logprobs", fill),
                ("sampling_logprobs", opposite),
            )
        }
    (value, metrics), grad = vg(case.spec, bad_lp, batch.replace(**changes))
    (value_ok, _), grad_ok = vg(case.spec, lp, batch)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    assert np.all(grad[masked] == 0.0)
    np.testing.assert_allclose(value, value_ok, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(grad, grad_ok, rtol=1e-12, atol=1e-15)


_BIG = float(np.finfo(np.float64).max)


@over(TOPK)
@pytest.mark.parametrize(
    "fills", [(np.nan, -np.inf), (np.inf, -_BIG), (-1e30, 0.5), (_BIG, np.nan), (-_BIG, _BIG)]
)
def test_masked_topk_entries_with_unequal_fills_change_nothing(case, fills):
    # The student and teacher entries off the mask hold different garbage (the closed-form
    # gradient reads them through a sanitiser, not a mask): value, gradient and metrics are
    # exactly those of the clean batch.
    lp, batch = fixed_topk(3)
    m3 = (np.asarray(batch.action_mask) == 0)[..., None]
    teacher = np.where(m3, fills[1], np.asarray(batch.teacher_topk_logprobs))
    (value, metrics), grad = vg(
        case.spec, np.where(m3, fills[0], lp), batch.replace(teacher_topk_logprobs=teacher)
    )
    (value_ok, metrics_ok), grad_ok = vg(case.spec, lp, batch)
    assert np.all(np.isfinite(grad)) and np.all(grad[m3[..., 0]] == 0.0)
    assert value == value_ok and metrics == metrics_ok
    np.testing.assert_array_equal(grad, grad_ok)


@over(TOPK)
def test_topk_forward_mode_and_second_derivative_agree_with_reverse_mode(case):
    # The closed-form gradient is a custom JVP: jax.jvp gives the directional derivative the
    # reverse-mode gradient implies, and the gradient is itself differentiable (finite
    # differences of the gradient along the direction).
    lp, batch = fixed_topk(5)
    term = case.term()
    f = jax.jit(lambda x: term(x, batch)[0])
    direction = np.random.default_rng(0).normal(size=lp.shape)
    _, tangent = jax.jvp(f, (jnp.asarray(lp),), (jnp.asarray(direction),))
    grad = jax.grad(f)(jnp.asarray(lp))
    np.testing.assert_allclose(float(tangent), float(np.sum(grad * direction)), rtol=1e-10)
    hvp = jax.jvp(jax.grad(f), (jnp.asarray(lp),), (jnp.asarray(direction),))[1]
    eps = 1e-6
    fd = (jax.grad(f)(lp + eps * direction) - jax.grad(f)(lp - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(hvp), np.asarray(fd), rtol=1e-5, atol=1e-8)


# -- 3. micro-batching, permutation, padding ----------------------------------------------------


def _pad_rows(lp, batch, rows):
    def pad(x):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] == rows:
            return x
        return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])

    return pad(lp), jax.tree.map(pad, batch)


@over(CASES)
@per_case
@given(data=st.data(), k=st.sampled_from([2, 3, 4]))
def test_split_batch_reproduces_full_batch(case, data, k):
    lp, batch = data.draw(draw_for(case))
    (v_full, _), g_full = vg(case.spec, lp, batch)
    values, grads = [], []
    for sl, part in zip(losses.row_slices(B, k), losses.split_batch(batch, k), strict=True):
        rows = part.shape[0]
        (v, _), g = vg(case.spec, *_pad_rows(lp[sl], part, B // 2))
        assert np.all(g[rows:] == 0)
        values.append(v)
        grads.append(g[:rows])
    np.testing.assert_allclose(sum(values), v_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-12, atol=1e-14)


@over(CASES)
@per_case
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_row_permutation_invariance(case, data, seed):
    lp, batch = data.draw(draw_for(case))
    perm = np.random.default_rng(seed).permutation(B)
    permuted = jax.tree.map(lambda x: x[perm] if x.ndim >= 1 else x, batch)
    (v0, _), g0 = vg(case.spec, lp, batch)
    (v1, _), g1 = vg(case.spec, lp[perm], permuted)
    np.testing.assert_allclose(v1, v0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, g0[perm], rtol=1e-12, atol=1e-14)


@over(CASES)
@per_case
@given(data=st.data(), fill=st.sampled_from([np.nan, -np.inf, -3.0]))
def test_padding_rows_and_columns_change_nothing(case, data, fill):
    # A (2, 4[, K]) batch padded with two rows and two columns to the compiled shape; the
    # unpadded side is the NumPy reference (no extra compilation).
    shapes = ((B - 2, T - 2, K),) if case.topk else ((B - 2, T - 2),)
    lp, batch = data.draw(topk_batches(shapes) if case.topk else sampled_batches(shapes))
    _away_from_kinks(case, lp, batch)

    def pad(x, value):
        x = np.asarray(x)
        widths = [(0, 2), (0, 2)] + [(0, 0)] * (x.ndim - 2)
        return np.pad(x, widths[: x.ndim], constant_values=value)

    fields = {}
    for name, value in batch.fields.items():
        if value is None or name.startswith("num_"):
            continue
        fields[name] = pad(value, 0.0 if name in ("action_mask", "obs_mask", "weights") else fill)
    v0, g0 = case.reference(lp, batch)
    (v1, m1), g1 = vg(case.spec, pad(lp, fill), losses.Batch(**fields))
    tol = dict(rtol=1e-6, atol=1e-9) if case.topk else dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(v1, v0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g1[: B - 2, : T - 2], g0, **tol)
    assert np.all(g1[B - 2 :] == 0) and np.all(g1[:, T - 2 :] == 0)
    assert all(np.isfinite(v) for v in m1.values())


# -- 4. jit, vmap -------------------------------------------------------------------------------


@over(CASES)
def test_jit_equals_eager_and_vmap_over_stacked_batches(case):
    lp, batch = fixed_topk(7) if case.topk else fixed_sampled(7)
    t = case.term()
    v_eager, m_eager = t(jnp.asarray(lp), batch)
    (v_jit, m_jit), _ = vg(case.spec, lp, batch)
    np.testing.assert_allclose(v_jit, float(v_eager), rtol=1e-13, atol=1e-15)
    assert set(m_jit) == set(m_eager)
    for key in m_eager:
        assert m_eager[key].shape == ()
        np.testing.assert_allclose(m_jit[key], float(m_eager[key]), rtol=1e-13, atol=1e-15)
    other = jax.tree.map(lambda x: x[::-1] if x.ndim >= 1 else x, batch)
    stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), batch, other)
    values, _ = jax.vmap(t)(jnp.stack([lp, lp[::-1]]), stacked)
    v_other, _ = t(jnp.asarray(lp[::-1]), other)
    np.testing.assert_allclose(
        np.asarray(values), [float(v_eager), float(v_other)], rtol=1e-13, atol=1e-15
    )


# -- 5. golden values (docs/sources.md#distillation) --------------------------------------------------------


def assert_golden(actual, expected):
    """Equal to a reference value as printed: 5 significant digits (or 5 decimals, for the
    values the reference gives as 0.0xxxx)."""
    actual, expected = np.atleast_1d(np.asarray(actual, float)), np.atleast_1d(expected)
    for a, e in zip(actual, expected, strict=True):
        exponent = np.floor(np.log10(abs(e))) if e != 0 else -5
        half_unit = max(0.5 * 10 ** (exponent - 4), 0.5e-5)
        assert abs(a - e) <= half_unit + 1e-12, (a, e)


S5_S = np.array([[-1.0, -0.5, -2.0]])
S5_T = np.array([[-1.2, -0.4, -1.0]])


def _s5_batch(mask=None):
    mask = np.ones((1, 3)) if mask is None else mask
    return losses.Batch(action_mask=mask, sampling_logprobs=S5_S, teacher_logprobs=S5_T)


def _value_grad(term, lp, batch):
    (value, metrics), grad = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(
        jnp.asarray(lp)
    )
    return float(value), metrics, np.asarray(grad)


@pytest.mark.parametrize(
    "discount, expected",
    [(0.0, [-0.2, 0.1, 1.0]), (0.5, [0.1, 0.6, 1.0]), (1.0, [0.9, 1.1, 1.0])],
)
def test_golden_tinker_advantages_with_discount(discount, expected):
    adv = losses.distillation_advantages(S5_S, S5_T, np.ones((1, 3)), discount=discount)
    assert_golden(np.asarray(adv)[0], expected)
    rkl = np.asarray(losses.distillation_advantages(S5_S, S5_T, np.ones((1, 3)), coef=2.0))
    np.testing.assert_allclose(rkl[0], [-0.4, 0.2, 2.0], rtol=1e-12)


@pytest.mark.parametrize("form", ["importance_sampling", "ref_kl"])
def test_golden_sampled_token_loss_at_the_sampler(form):
    # §5: at lp = s (γ = 0) the importance_sampling loss is -0.9 with gradient [0.2, -0.1, -1.0],
    # the same as prime-rl ref_kl at r = 1.
    term = losses.reverse_kl_distillation(form=form, reduction="token_sum")
    value, metrics, grad = _value_grad(term, S5_S, _s5_batch())
    assert_golden(value, -0.9)
    assert_golden(grad[0], [0.2, -0.1, -1.0])
    assert_golden(metrics["teacher_kl"], -0.3)  # mean of rkl
    assert float(metrics["ratio_mean"]) == 1.0


def test_golden_verl_direct_k3():
    term = losses.reverse_kl_distillation(form="k3", reduction="token_sum")
    per_token = []
    for j in range(3):
        mask = np.zeros((1, 3))
        mask[0, j] = 1
        per_token.append(_value_grad(term, S5_S, _s5_batch(mask))[0])
    assert_golden(per_token, [0.01873, 0.00517, 0.71828])
    _, _, grad = _value_grad(term, S5_S, _s5_batch())
    assert_golden(grad[0], [0.18127, -0.10517, -1.71828])


def _topk_batch(teacher_probs):
    t = np.log(np.asarray(teacher_probs, np.float64))[None, None, :]
    return losses.Batch(action_mask=np.ones((1, 1)), teacher_topk_logprobs=t)


def _lp(probs):
    return np.log(np.asarray(probs, np.float64))[None, None, :]


def test_golden_verl_forward_kl_topk():
    value, metrics, _ = _value_grad(
        losses.topk_forward_kl(), _lp([0.3, 0.1]), _topk_batch([0.6, 0.2])
    )
    assert_golden(value, 0.55452)
    assert float(metrics["teacher_mass"]) == pytest.approx(0.8)
    assert float(metrics["student_mass"]) == pytest.approx(0.4)


def test_golden_sdft_reverse_kl():
    term = losses.topk_reverse_kl()
    value, _, grad = _value_grad(term, _lp([0.2, 0.2]), _topk_batch([0.6, 0.2]))
    assert_golden(value, 0.14384)
    assert_golden(grad[0, 0], [-0.27465, 0.27465])


def test_golden_trl_tail_bucket_forward_kl():
    t = np.array([[[-0.2]]])
    b = losses.Batch(action_mask=np.ones((1, 1)), teacher_topk_logprobs=t)
    value, _, _ = _value_grad(losses.topk_forward_kl(tail=True), np.array([[[-0.5]]]), b)
    assert_golden(value, 0.10513)
    # Without the tail, top-1 renormalised on both sides is trivially 0 (why TRL adds it).
    value, _, grad = _value_grad(
        losses.topk_forward_kl(renormalize="both"), np.array([[[-0.5]]]), b
    )
    assert value == 0.0 and np.all(grad == 0.0)


def test_sdft_forward_kl_is_the_cross_entropy_up_to_the_teacher_entropy():
    # renormalize="teacher": KL(q̂‖p) = Σ q̂ log q̂ - Σ q̂ s; derived value ln 2.5 for teacher
    # [0.6, 0.2] (q̂ = [0.75, 0.25]) and student [0.3, 0.1]; gradient -q̂ (sdft's CE weights).
    term = losses.topk_forward_kl(renormalize="teacher")
    value, metrics, grad = _value_grad(term, _lp([0.3, 0.1]), _topk_batch([0.6, 0.2]))
    assert value == pytest.approx(np.log(2.5), rel=1e-12)
    np.testing.assert_allclose(grad[0, 0], [-0.75, -0.25], rtol=1e-12)
    qh = np.array([0.75, 0.25])
    assert float(metrics["teacher_entropy"]) == pytest.approx(-(qh * np.log(qh)).sum())


@pytest.mark.parametrize("beta, expected", [(0.5, 0.04620), (0.0, 0.18379), (1.0, 0.19204)])
@pytest.mark.parametrize("tail", [False, True])
def test_golden_gkd_jsd_full_vocabulary(beta, expected, tail):
    # K = the whole vocabulary of 3: renormalising is a no-op and the tail bucket is empty.
    term = losses.topk_jsd(beta=beta, tail=tail)
    value, _, grad = _value_grad(term, _lp([0.4, 0.4, 0.2]), _topk_batch([0.7, 0.2, 0.1]))
    assert_golden(value, expected)
    assert np.all(np.isfinite(grad))


def test_jsd_ends_are_the_forward_and_reverse_kl():
    lp, batch = _lp([0.4, 0.35, 0.1]), _topk_batch([0.5, 0.3, 0.15])
    for beta, other in ((0.0, losses.topk_forward_kl), (1.0, losses.topk_reverse_kl)):
        for kw in (dict(renormalize="both"), dict(tail=True)):
            a = _value_grad(losses.topk_jsd(beta=beta, **kw), lp, batch)
            b = _value_grad(other(**kw), lp, batch)
            assert a[0] == pytest.approx(b[0], rel=1e-12)
            np.testing.assert_allclose(a[2], b[2], rtol=1e-12)


@pytest.mark.parametrize(
    "approx, k, expected",
    [
        ("truncated", 2, 0.70777),
        ("tail", 2, 1.02965),
        ("renormalized", 2, 0.66156),
        ("truncated", 4, 1.16828),
    ],
)
def test_golden_topk_entropy(approx, k, expected):
    x = np.log(np.array([0.5, 0.3, 0.1, 0.1]))[:k]
    assert_golden(losses.topk_entropy(x, approx=approx), expected)
    assert_golden(ref.topk_entropy_ref(list(x), approx), expected)


def test_golden_entropy_gradient_wrt_logits():
    z = np.log(np.array([0.5, 0.3, 0.1, 0.1]))
    g = jax.grad(lambda z: losses.topk_entropy(jax.nn.log_softmax(z)))(jnp.asarray(z))
    assert_golden(g, [-0.23757, 0.01071, 0.11343, 0.11343])


def test_topk_entropy_bounds_and_shapes():
    rng = np.random.default_rng(0)
    full = _log_softmax(rng.normal(size=(5, 7, 10)))
    top = -np.sort(-full, axis=-1)[..., :4]
    h = np.asarray(losses.topk_entropy(full))
    trunc = np.asarray(losses.topk_entropy(top, approx="truncated"))
    tail = np.asarray(losses.topk_entropy(top, approx="tail"))
    assert h.shape == (5, 7)
    assert np.all(trunc <= tail + 1e-12) and np.all(tail <= h + 1e-12)
    with pytest.raises(ValueError, match="approx"):
        losses.topk_entropy(top, approx="exact")


# -- 6. expected gradients by exact enumeration (§2.1, §5) --------------------------------------

P3 = np.array([0.5, 0.3, 0.2])
Q3 = np.array([0.2, 0.5, 0.3])
MU3 = np.array([0.4, 0.4, 0.2])
REVERSE_GRAD = [0.34624, -0.22039, -0.12585]
FORWARD_GRAD = [0.3, -0.2, -0.1]


def _expected_grad_z(term, sampler):
    """E_{y ~ sampler}[∂L/∂lp(y)·(e_y - p)] and E[L] over the vocabulary of 3 (p = P3)."""
    f = jax.jit(jax.value_and_grad(lambda lp, b: term(lp, b)[0]))
    grad_z, value = np.zeros(3), 0.0
    for y in range(3):
        b = losses.Batch(
            action_mask=np.ones((1, 1)),
            sampling_logprobs=np.log([[sampler[y]]]),
            teacher_logprobs=np.log([[Q3[y]]]),
        )
        v, g = f(np.log([[P3[y]]]), b)
        value += sampler[y] * float(v)
        grad_z += sampler[y] * float(g[0, 0]) * (np.eye(3)[y] - P3)
    return grad_z, value


@pytest.mark.parametrize(
    "kwargs, sampler, expected",
    [
        (dict(), P3, REVERSE_GRAD),
        (dict(form="k2"), P3, REVERSE_GRAD),
        (dict(form="ref_kl", kl_tau=0.0, prob_delta_low=1.0), P3, REVERSE_GRAD),
        # prime-rl's sg(t - lp)·r stays unbiased off-policy (y ~ μ ≠ p).
        (dict(form="ref_kl", kl_tau=0.0, prob_delta_low=1.0), MU3, REVERSE_GRAD),
        # verl's direct k3 descends the forward KL(q‖p): ∇ = p - q (§2.1).
        (dict(form="k3"), P3, FORWARD_GRAD),
    ],
)
def test_on_policy_expected_gradient_is_the_true_divergence_gradient(kwargs, sampler, expected):
    term = losses.reverse_kl_distillation(reduction="token_sum", **kwargs)
    grad_z, value = _expected_grad_z(term, sampler)
    assert_golden(grad_z, expected)
    # And against autodiff of the exact divergences.
    z = jnp.log(jnp.asarray(P3))
    rkl = jax.grad(lambda z: jnp.sum(jax.nn.softmax(z) * (jax.nn.log_softmax(z) - np.log(Q3))))
    fkl = jax.grad(lambda z: jnp.sum(Q3 * (np.log(Q3) - jax.nn.log_softmax(z))))
    exact = rkl(z) if expected is REVERSE_GRAD else fkl(z)
    np.testing.assert_allclose(grad_z, np.asarray(exact), rtol=1e-12, atol=1e-14)
    if kwargs.get("form") in (None, "k3") and sampler is P3:
        assert_golden(value, 0.22380)  # E_p[estimator] = KL(p‖q)


def test_importance_sampling_form_is_biased_off_policy():
    # Its advantage is frozen at the sampler's logprobs: E_μ[r·(log μ - log q)·∇lp] =
    # E_p[(log μ - log q)·∇lp] (derived), not ∇KL(p‖q).
    grad_z, _ = _expected_grad_z(losses.reverse_kl_distillation(reduction="token_sum"), MU3)
    derived = sum(P3[y] * (np.log(MU3[y]) - np.log(Q3[y])) * (np.eye(3)[y] - P3) for y in range(3))
    np.testing.assert_allclose(grad_z, derived, rtol=1e-12, atol=1e-14)
    assert not np.allclose(grad_z, REVERSE_GRAD, atol=1e-3)


@pytest.mark.parametrize("discount, exact", [(1.0, True), (0.5, False), (0.0, False)])
def test_discount_one_is_the_exact_sequence_level_reverse_kl_gradient(discount, exact):
    # Two tokens from a vocabulary of 3, the second conditioned on the first; exact enumeration
    # of the score-function gradient against autodiff of the sequence-level KL(P‖Q) (§5: γ = 1
    # is exact; γ < 1 drops part of the future KL and is biased).
    rng = np.random.default_rng(0)
    v = 3
    z0, z1 = rng.normal(size=v), rng.normal(size=(v, v))
    lq0 = np.log(rng.dirichlet(np.ones(v)))
    lq1 = np.log(rng.dirichlet(np.ones(v), size=v))

    def seq_kl(z0, z1):
        lp0, lp1 = jax.nn.log_softmax(z0), jax.nn.log_softmax(z1, axis=-1)
        joint = lp0[:, None] + lp1
        return jnp.sum(jnp.exp(joint) * (joint - lq0[:, None] - lq1))

    g0_true, g1_true = jax.grad(seq_kl, argnums=(0, 1))(jnp.asarray(z0), jnp.asarray(z1))
    p0, p1 = np.asarray(jax.nn.softmax(z0)), np.asarray(jax.nn.softmax(z1, axis=-1))
    term = losses.reverse_kl_distillation(reduction="token_sum", discount=discount)
    f = jax.jit(jax.grad(lambda lp, b: term(lp, b)[0]))
    g0, g1 = np.zeros(v), np.zeros((v, v))
    for y0, y1 in itertools.product(range(v), range(v)):
        lp = np.log([[p0[y0], p1[y0, y1]]])
        b = losses.Batch(
            action_mask=np.ones((1, 2)),
            sampling_logprobs=lp,
            teacher_logprobs=np.array([[lq0[y0], lq1[y0, y1]]]),
        )
        g = np.asarray(f(lp, b))[0]
        prob = p0[y0] * p1[y0, y1]
        g0 += prob * g[0] * (np.eye(v)[y0] - p0)
        g1[y0] += prob * g[1] * (np.eye(v)[y1] - p1[y0])
    np.testing.assert_allclose(g1, np.asarray(g1_true), atol=1e-14)  # last token: always exact
    assert np.allclose(g0, np.asarray(g0_true), rtol=1e-12, atol=1e-14) == exact


# -- 7. the importance-sampling twin route ------------------------------------------------------


@pytest.mark.parametrize("reduction", losses.REDUCTIONS)
@pytest.mark.parametrize("discount", [0.0, 0.7, 1.0])
def test_importance_sampling_form_equals_the_kernel_on_distillation_advantages(reduction, discount):
    max_tokens = 8 if reduction == "seq_mean_token_sum_norm" else None
    rng = np.random.default_rng(1)
    lp = -rng.uniform(0.1, 3, (3, 5))
    old = np.minimum(lp + rng.uniform(-0.5, 0.5, lp.shape), 0)
    teacher = np.minimum(lp + rng.uniform(-1, 1, lp.shape), 0)
    mask = (rng.uniform(size=lp.shape) < 0.7).astype(float)
    task_adv = rng.normal(size=3)
    batch = losses.Batch(action_mask=mask, sampling_logprobs=old, teacher_logprobs=teacher)
    kw = dict(reduction=reduction, max_tokens=max_tokens)
    distill = losses.reverse_kl_distillation(coef=0.6, discount=discount, **kw)
    assert distill.twin is None and losses.builtin_twin(distill) is None
    adv = losses.distillation_advantages(old, teacher, mask, coef=0.6, discount=discount)
    kernel = losses.importance_sampling(**kw)
    a = _value_grad(distill, lp, batch)
    b = _value_grad(kernel, lp, batch.replace(advantages=adv))
    assert a[0] == pytest.approx(b[0], rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(a[2], b[2], rtol=1e-12, atol=1e-14)
    # The cookbook's A += ...: a fold with the task term is the kernel on the summed advantages.
    folded = losses.fold(losses.importance_sampling(**kw), distill)
    c = _value_grad(folded, lp, batch.replace(advantages=task_adv))
    task_bt = np.broadcast_to(task_adv[:, None], lp.shape)
    d = _value_grad(kernel, lp, batch.replace(advantages=task_bt + np.asarray(adv)))
    assert c[0] == pytest.approx(d[0], rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(c[2], d[2], rtol=1e-12, atol=1e-14)


@settings(max_examples=max(5, settings.default.max_examples // 2))
@given(
    data=sampled_batches(shapes=((2, 5), (4, 7))),
    discount=st.sampled_from([0.0, 0.3, 1.0]),
    coef=st.sampled_from([0.5, 1.0]),
    fill=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_distillation_advantages_match_numpy(data, discount, coef, fill):
    lp, batch = data
    mask = np.asarray(batch.action_mask)
    s = np.where(mask > 0, np.asarray(batch.old_logprobs), fill)
    t = np.where(mask > 0, np.asarray(batch.teacher_logprobs), -fill)
    got = np.asarray(losses.distillation_advantages(s, t, mask, coef=coef, discount=discount))
    expected = ref.distillation_advantages_ref(s, t, mask, coef=coef, discount=discount)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    jitted = jax.jit(
        functools.partial(losses.distillation_advantages, coef=coef, discount=discount)
    )
    np.testing.assert_allclose(np.asarray(jitted(s, t, mask)), got, rtol=1e-14, atol=1e-15)
    assert np.all(got[mask == 0] == 0)


# -- 8. peer bugs and traps the reference lists --------------------------------------------------


def test_verl_truncated_forward_kl_is_clamped_at_zero():
    # verl forward_kl_topk: no renormalisation and no tail, so the sum can be negative; it is
    # clamp_min(0) per token (zero gradient there), never a negative loss.
    lp, batch = _lp([0.6, 0.3]), _topk_batch([0.3, 0.1])  # student covers more than the teacher
    value, _, grad = _value_grad(losses.topk_forward_kl(), lp, batch)
    raw = (np.array([0.3, 0.1]) * (np.log([0.3, 0.1]) - np.log([0.6, 0.3]))).sum()
    assert raw < 0 and value == 0.0 and np.all(grad == 0.0)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_empty_mask_gives_zero_not_nan(case):
    # TRL _reduce_divergence_loss: a batch with no valid token must not divide 0/0.
    lp, batch = fixed_topk(4) if case.topk else fixed_sampled(4)
    batch = batch.replace(action_mask=np.zeros(batch.shape))
    (value, metrics), grad = vg(case.spec, lp, batch)
    assert value == 0.0 and np.all(grad == 0.0)
    assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize(
    "term",
    [
        losses.topk_forward_kl(tail=True),
        losses.topk_reverse_kl(tail=True),
        losses.topk_jsd(beta=0.4, tail=True),
        losses.topk_jsd(beta=0.0, tail=True),
    ],
    ids=["fwd", "rev", "jsd", "jsd0"],
)
def test_tail_bucket_stays_finite_when_top_k_holds_all_the_mass(term):
    # TRL clamps log Σ e^x ≤ -1e-7 before log(1 - Σ): with K = the vocabulary (or rounding
    # above 1) the tail is finite and so is the gradient.
    for student in ([0.4, 0.4, 0.2], [0.40001, 0.4, 0.2]):
        value, metrics, grad = _value_grad(term, _lp(student), _topk_batch([0.7, 0.2, 0.1]))
        assert np.isfinite(value) and np.all(np.isfinite(grad))
        assert all(np.isfinite(float(v)) for v in metrics.values())
    # The clamp is TRL's: a full-mass tail bucket holds 1 - e^(-1e-7) ≈ 1e-7.
    x = np.log([0.7, 0.2, 0.1])
    extra = float(losses.topk_entropy(x, approx="tail") - losses.topk_entropy(x))
    tau = -np.expm1(-1e-7)
    assert extra == pytest.approx(-tau * np.log(tau), rel=1e-6)


def test_forward_means_teacher_to_student_naming():
    # rllm's naming trap (§2.2): here "forward" is KL(teacher‖student), "reverse" KL(student‖
    # teacher), for the top-K terms as for the sampled-token reverse KL.
    p, q = np.array([0.4, 0.4, 0.2]), np.array([0.7, 0.2, 0.1])
    batch = _topk_batch(q)
    fwd = _value_grad(losses.topk_forward_kl(renormalize="both"), _lp(p), batch)[0]
    rev = _value_grad(losses.topk_reverse_kl(), _lp(p), batch)[0]
    assert fwd == pytest.approx((q * np.log(q / p)).sum(), rel=1e-12)
    assert rev == pytest.approx((p * np.log(p / q)).sum(), rel=1e-12)


def test_micro_batch_token_count_is_the_optimizer_batch_one():
    # prime-rl divides by its own micro-batch's token count and TRL by a local count unless
    # num_items_in_batch is passed (#4719): here micro-batches carry the full count, so a
    # micro-batch with fewer tokens is not up-weighted.
    lp, batch = fixed_sampled(5)
    mask = np.zeros((B, T))
    mask[0, :5] = 1
    mask[2:, 0] = 1
    batch = batch.replace(action_mask=mask, obs_mask=np.zeros((B, T)))
    term = losses.reverse_kl_distillation(form="k3")
    full = _value_grad(term, lp, batch)[0]
    parts = [
        _value_grad(term, lp[sl], part)[0]
        for sl, part in zip(losses.row_slices(B, 2), losses.split_batch(batch, 2), strict=True)
    ]
    assert sum(parts) == pytest.approx(full, rel=1e-12)
    naive = [
        _value_grad(term, lp[sl], losses.Batch(**{**part.fields, "num_action_tokens": None}))[0]
        for sl, part in zip(losses.row_slices(B, 2), losses.split_batch(batch, 2), strict=True)
    ]
    assert not np.isclose(sum(naive), full)


# -- 9. constructors, metadata, validation -------------------------------------------------------


@over(CASES)
def test_term_metadata(case):
    t = case.term()
    assert t.kind == case.ctor and t.twin is None and t.data_weights is None
    rebuilt = getattr(losses, t.kind)(**t.config)
    assert rebuilt.config == t.config
    if case.topk:
        assert {"action_mask", "teacher_topk_logprobs"} <= t.requires
        assert t.validate is not None
    else:
        assert {"action_mask", "teacher_logprobs"} <= t.requires
        anchored = t.config["form"] in ("importance_sampling", "ref_kl")
        assert ("old_logprobs" in t.requires) == anchored
    assert t.requires <= t.reads
    assert not t.is_zero
    assert getattr(losses, case.ctor)(**{**case.config, "coef": 0.0}).is_zero


def test_zero_coef_terms_vanish_in_a_fold():
    lp, batch = fixed_sampled(5)
    base = losses.reverse_kl_distillation(form="k3")
    folded = losses.fold(base, ("zero", losses.reverse_kl_distillation(coef=0.0)))
    a, b = _value_grad(base, lp, batch), _value_grad(folded, lp, batch)
    assert a[0] == b[0] and np.array_equal(a[2], b[2])


@pytest.mark.parametrize(
    "ctor, kwargs, match",
    [
        (RKL, dict(form="k1"), "form"),
        (RKL, dict(coef=-1.0), "coef"),
        (RKL, dict(discount=1.5), "discount"),
        (RKL, dict(form="k3", discount=0.5), "discount applies only"),
        (RKL, dict(kl_tau=0.01), "kl_tau applies only"),
        (RKL, dict(form="k2", prob_delta_low=0.1), "prob_delta_low applies only"),
        (RKL, dict(form="ref_kl", kl_tau=-1.0), "kl_tau"),
        (RKL, dict(reduction="mean"), "reduction"),
        (RKL, dict(max_log_ratio=0.0), "max_log_ratio"),
        ("topk_forward_kl", dict(renormalize="student"), "renormalize"),
        ("topk_forward_kl", dict(tail=True, renormalize="both"), "tail=True"),
        ("topk_forward_kl", dict(tail=1), "tail must be a bool"),
        ("topk_reverse_kl", dict(renormalize="teacher"), "renormalize"),
        ("topk_reverse_kl", dict(renormalize="none"), "do not form distributions"),
        ("topk_jsd", dict(renormalize="none"), "do not form distributions"),
        ("topk_jsd", dict(beta=1.5), "beta"),
        ("topk_jsd", dict(coef=float("nan")), "coef"),
        ("topk_jsd", dict(reduction="seq_mean_token_sum_norm"), "max_tokens"),
    ],
)
def test_constructor_validation(ctor, kwargs, match):
    with pytest.raises(ValueError, match=match):
        getattr(losses, ctor)(**kwargs)


def test_distillation_advantages_validation():
    with pytest.raises(ValueError, match="same"):
        losses.distillation_advantages(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="discount"):
        losses.distillation_advantages(S5_S, S5_T, np.ones((1, 3)), discount=-0.1)


def test_topk_terms_refuse_token_logprobs_and_missing_teacher():
    lp, batch = fixed_topk(6)
    term = losses.topk_forward_kl()
    with pytest.raises(ValueError, match=r"expected \[B, T, K\]"):
        term(lp[..., 0], batch)
    with pytest.raises(ValueError, match=r"expected \[B, T, K\]"):
        term(lp[..., :2], batch)
    with pytest.raises(ValueError, match="teacher_topk_logprobs"):
        term(lp, batch.replace(teacher_topk_logprobs=None))
    with pytest.raises(ValueError, match="needs batch field"):
        losses.reverse_kl_distillation()(lp[..., 0], losses.Batch(action_mask=np.ones((B, T))))
    with pytest.raises(ValueError, match="logprobs has shape"):
        losses.reverse_kl_distillation(form="k3")(lp, batch.replace(teacher_logprobs=lp[..., 0]))


def test_topk_host_validation_names_row_and_column():
    lp, batch = fixed_topk(6)
    mask = np.zeros((B, T))
    mask[1, 2] = 1
    batch = batch.replace(action_mask=mask, obs_mask=np.zeros((B, T)))
    term = losses.topk_reverse_kl()
    losses.check_batch(batch, term=term)
    losses.check_batch(batch, lp, term=term)  # [B, T, K] student logprobs: each K checked
    bad = np.asarray(lp).copy()
    bad[1, 2, 1] = 0.5
    with pytest.raises(ValueError, match=r"logprobs\[row 1, column 2\] = 0\.5 > 0"):
        losses.check_batch(batch, bad, term=term)
    term.validate(batch, lp)
    t = np.asarray(batch.teacher_topk_logprobs).copy()
    t[1, 2] = np.log([0.7, 0.5, 0.1])
    with pytest.raises(ValueError, match=r"teacher_topk_logprobs\[row 1, column 2\].*mass"):
        losses.check_batch(batch.replace(teacher_topk_logprobs=t), term=term)
    bad = lp.copy()
    bad[1, 2, 1] = np.nan
    with pytest.raises(ValueError, match=r"row 1, column 2, k 1"):
        term.validate(batch, bad)
    bad[1, 2] = np.log([0.9, 0.6, 0.1])
    with pytest.raises(ValueError, match=r"logprobs\[row 1, column 2\].*mass"):
        term.validate(batch, bad)
    with pytest.raises(ValueError, match="shape"):
        term.validate(batch, lp[..., 0])


def test_float32_inputs_stay_float32_and_finite():
    terms = [losses.topk_forward_kl(tail=True), losses.topk_jsd()]
    terms += [losses.reverse_kl_distillation(form=f) for f in losses.REVERSE_KL_FORMS]
    for term in terms:
        lp, batch = fixed_topk(8) if term.kind.startswith("topk") else fixed_sampled(8)
        b32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), batch)
        f = jax.jit(jax.value_and_grad(lambda x, b, term=term: term(x, b)[0]))
        value, grad = f(jnp.asarray(lp, jnp.float32), b32)
        assert value.dtype == grad.dtype == jnp.float32, term
        assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))


def test_docstring_examples_run():
    result = doctest.testmod(_distill, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 6 and result.failed == 0
