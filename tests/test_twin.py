"""Built-in twins (`losses.builtin_twin`, mirrors losses/_twin.py): which terms have an exact
built-in server kernel, with which name and config, and that folding the term's reduction into
the advantages reproduces both the term and the documented kernel formula.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import losses
from tests.cases import MIS_SEQ, MIS_TOK, SHAPE, TIS_SEQ, TIS_TOK, adv_BT
from tests.strategies import policy_batches

#: (term, expected twin). Threshold values compare with approx.
TWINS = [
    (losses.importance_sampling(), ("importance_sampling", {})),
    # The Fireworks reinforce kernel (undocumented; the cookbook twin's unclipped ratio weight).
    (losses.reinforce(ratio_weight=True, reduction="token_sum"), ("reinforce", {})),
    (losses.reinforce(ratio_weight=True), ("reinforce", {})),
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
    extra = {"ratio_weight": True} if twin[0] == "reinforce" else {}
    kernel = getattr(losses, twin[0])(reduction="token_sum", **extra, **twin[1])
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
        losses.reinforce(ratio_weight=True, ratio_cap=2.0, reduction="token_sum"),
        losses.reinforce(ratio_weight=True, kl_coef=0.1),
        losses.gmpo(reduction="token_sum"),
        losses.sapo(reduction="token_sum"),
        losses.sft_cross_entropy(),
        losses.fold(losses.ppo(), losses.echo_env()),
        object(),
    ],
    # repr, except the plain object (its address differs between pytest-xdist workers)
    ids=lambda t: "plain-object" if type(t) is object else repr(t),
)
def test_builtin_twin_is_none_when_no_kernel_is_exact(term):
    assert losses.builtin_twin(term) is None


def _fw_kernel(name, cfg, lp, q, adv, mask):
    """A built-in ``loss_fn`` written from the docs/training-api.md#builtin-kernels table (independent of
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


def test_docstring_examples_run():
    result = doctest.testmod(importlib.import_module("losses._twin"))
    assert result.failed == 0
