"""The mismatch correction (`losses.mismatch_correction`, mirrors losses/_correction.py): its
weights by hand, the identity in bypass mode, what it scales, bad hyperparameters. The corrected
terms themselves (TIS/MIS at token and sequence level) are cases of the registry
(tests/cases.py), checked against the NumPy reference by tests/test_term_properties.py.
"""

from __future__ import annotations

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses
from tests.cases import MIS_SEQ, MIS_TOK, TIS_SEQ, TIS_TOK
from tests.cases import fixed_batch as _fixed_batch


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


BAD = [
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
def test_correction_rejects_bad_hyperparameters(ctor, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ctor(**kwargs)


def test_docstring_examples_run():
    result = doctest.testmod(importlib.import_module("losses._correction"))
    assert result.failed == 0
