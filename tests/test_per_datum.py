"""`Term.per_datum`: a declared per-datum form is exactly a sum of one loss per row.

For every registered case (tests/cases.py) whose term declares it, the full-batch loss and its
gradient equal the sum over rows of the term on that row alone, given the batch constants the
client computes (`losses.per_datum_batch`); terms coupled across rows declare no form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses
from tests import cases


@functools.cache
def _both(term: losses.Term):
    """One jit: the full-batch value and gradient, and those of the sum of one-row losses."""

    def full(lp, batch):
        return term(lp, batch)[0]

    def rows(lp, batch):
        parts = losses.split_batch(batch, batch.shape[0])  # one row each, constants kept
        return sum(term(lp[i : i + 1], row)[0] for i, row in enumerate(parts))

    return jax.jit(
        lambda lp, batch: (jax.value_and_grad(full)(lp, batch), jax.value_and_grad(rows)(lp, batch))
    )


def test_the_declaration_is_the_split_property():
    """A case declares a per-datum form exactly when test_term_properties' split property (one-row
    micro-batches with the batch's normalizers: k = 3, 4) holds for it, i.e. is not skipped."""
    split = "test_split_batch_reproduces_full_batch"
    for case in cases.CASES:
        splits = not any(name == split for name, _ in case.skip)
        assert (case.term().per_datum is not None) == splits, case.id


@pytest.mark.parametrize(
    "term",
    [
        losses.fold(
            losses.grpo(
                correction=losses.mismatch_correction(kind="tis", cap=2.0, batch_normalize=True)
            ),
            losses.echo_env(coef=0.2),
        ),
    ],
    ids=["fold-grpo-batch-normalised-tis-echo"],
)
def test_rows_sum_to_the_batch_given_the_constants(term):
    """A batch-normalised correction needs ``is_weight_mean``; per_datum_batch computes it."""
    lp, batch = cases.fixed_batch(seed=3)
    with_constants = losses.per_datum_batch(term, batch)
    (v_full, g_full), (v_rows, g_rows) = _both(term)(jnp.asarray(lp), with_constants)
    np.testing.assert_allclose(float(v_rows), float(v_full), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(g_rows), np.asarray(g_full), rtol=1e-12, atol=1e-14)
    # Without the constant each row would divide by its own mean: not the batch's loss.
    (v_full, _), (v_rows, _) = _both(term)(jnp.asarray(lp), batch)
    assert abs(float(v_rows) - float(v_full)) > 1e-6


def test_coupled_terms_declare_no_form_and_folds_follow_their_parts():
    assert losses.clip_cov().per_datum is None
    assert losses.clip_cov(clip_cov_ratio=1.0).per_datum is None  # a random subset still
    assert losses.kl_cov().per_datum is None
    assert losses.kl_cov(kl_cov_ratio=1.0).per_datum is not None  # every token: no selection
    grpo, env = losses.grpo(), losses.echo_env(coef=0.1)
    assert losses.fold(grpo, env).per_datum is not None
    assert losses.fold(grpo, losses.clip_cov()).per_datum is None
    with pytest.raises(ValueError, match="clip_cov.*no per-datum form"):
        losses.per_datum_batch(losses.clip_cov(), cases.fixed_batch()[1])


def test_constants_are_computed_once_and_kept_when_carried():
    _, batch = cases.fixed_batch(seed=1)
    corr = losses.mismatch_correction(kind="tis", cap=2.0, batch_normalize=True)
    term = losses.grpo(correction=corr)
    out = losses.per_datum_batch(term, batch)
    assert float(out.is_weight_mean) == pytest.approx(
        float(losses.importance_weight_mean(batch, corr))
    )
    assert float(out.num_action_tokens) == float(np.sum(batch.action_mask))
    carried = losses.per_datum_batch(term, batch.replace(num_rows=jnp.asarray(9.0)))
    assert float(carried.num_rows) == 9.0
