"""`losses.split_batch` (mirrors losses/_split.py): carried normalizers, bad counts, extra fields.
That every term's micro-batches reproduce the full batch is a property of the case registry
(tests/test_term_properties.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

import losses


def test_split_batch_without_normalizers_would_differ():
    # Regression for the chunk-normalization bug (rllm #782, docs/echo.md#edge-cases): per-micro-batch
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
        action_mask=jnp.ones((3, 2)), extra={"extra_rows": jnp.arange(3.0), "scalar": jnp.ones(())}
    )
    for k in (0, 4, 1.5, True):
        with pytest.raises(ValueError, match="num_microbatches"):
            losses.split_batch(batch, k)
    parts = losses.split_batch(batch, 2)
    assert [p.shape[0] for p in parts] == [2, 1]
    np.testing.assert_array_equal(np.asarray(parts[1].extra["extra_rows"]), [2.0])
    assert parts[1].extra["scalar"].shape == ()
    assert float(parts[1].num_rows) == 3.0 and float(parts[1].num_action_tokens) == 6.0
