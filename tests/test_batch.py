"""Batch construction, pytree behaviour, and every ValueError path of check_batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses


def good(**overrides):
    fields = dict(
        action_mask=np.array([[0.0, 1, 1], [1, 0, 0]]),
        obs_mask=np.array([[1.0, 0, 0], [0, 1, 0]]),
        advantages=np.array([1.0, -1.0]),
        sampling_logprobs=np.array([[0.0, -1.0, -2.0], [-0.5, 0.0, np.nan]]),
        ref_logprobs=np.array([[0.0, -1.1, -2.1], [-0.4, 0.0, 0.0]]),
        weights=np.zeros((2, 3)),
    )
    fields.update(overrides)
    return losses.Batch(**fields)


def test_batch_defaults_and_pytree_round_trip():
    b = good()
    assert b.old_logprobs is b.sampling_logprobs
    assert b.shape == (2, 3)
    leaves, treedef = jax.tree.flatten(b)
    again = jax.tree.unflatten(treedef, leaves)
    assert isinstance(again, losses.Batch)
    np.testing.assert_array_equal(np.asarray(again.action_mask), np.asarray(b.action_mask))
    doubled = jax.tree.map(lambda x: x * 2, b)
    np.testing.assert_array_equal(np.asarray(doubled.advantages), [2.0, -2.0])
    assert "action_mask=float64[2, 3]" in repr(b)


def test_batch_masks_become_float_and_extra_fields_are_allowed():
    b = losses.Batch(action_mask=np.array([[True, False]]), prompt_lengths=np.array([3]))
    assert jnp.issubdtype(b.action_mask.dtype, jnp.floating)
    assert b.extra_fields == ("prompt_lengths",)
    assert b.get("missing") is None
    with pytest.raises(AttributeError, match="no field 'missing'"):
        _ = b.missing
    with pytest.raises(AttributeError, match="immutable"):
        b.action_mask = None


def test_replace_keeps_other_fields_and_does_not_reset_old():
    b = good()
    b2 = b.replace(sampling_logprobs=np.zeros((2, 3)))
    assert b2.old_logprobs is b.old_logprobs
    np.testing.assert_array_equal(np.asarray(b2.sampling_logprobs), 0.0)


def test_jit_accepts_batch():
    b = good()
    out = jax.jit(lambda bb: jnp.sum(bb.action_mask))(b)
    assert float(out) == 3.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(action_mask=None), "'action_mask' is required"),
        (dict(action_mask=np.ones(3)), r"'action_mask' must be rank 2 \[B, T\]"),
        (dict(obs_mask=np.ones((2, 4))), r"'obs_mask' has shape \(2, 4\), expected \(2, 3\)"),
        (dict(weights=np.ones((3, 3))), r"'weights' has shape \(3, 3\)"),
        (dict(advantages=np.ones(3)), r"'advantages' has shape \(3,\), expected \[B\]"),
        (dict(num_rows=np.ones(2)), "'num_rows' must be a 0-d array"),
        (dict(extra=np.ones(5)), "extra field 'extra' has leading dimension 5, expected B=2"),
        (dict(_private=np.ones(2)), "may not start with '_'"),
        (dict(action_mask=np.array([["a"]], dtype=object)), "dtype object"),
    ],
)
def test_batch_constructor_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        good(**overrides)


def test_check_batch_accepts_a_good_batch():
    losses.check_batch(good(), logprobs=np.array([[-1.0, -1.0, -1.0], [-1.0, -2.0, np.inf]]))


@pytest.mark.parametrize(
    "overrides, logprobs, message",
    [
        (
            dict(action_mask=np.array([[0.0, 0.5, 1], [1, 0, 0]])),
            None,
            r"action_mask\[row 0, column 1\] = .*0\.5.*: masks must hold only 0 or 1",
        ),
        (
            dict(obs_mask=np.array([[1.0, 0, 0], [0, 2, 0]])),
            None,
            r"obs_mask\[row 1, column 1\] = 2: masks must hold only 0 or 1",
        ),
        (
            dict(obs_mask=np.array([[0.0, 1, 0], [0, 0, 0]])),
            None,
            r"action_mask and obs_mask overlap at row 0, column 1",
        ),
        (
            {},
            np.array([[-1.0, -1.0, np.nan], [-1.0, -1.0, -1.0]]),
            r"logprobs\[row 0, column 2\] = .*nan on an unmasked token: logprobs must be finite",
        ),
        (
            {},
            np.array([[-1.0, -1.0, -1.0], [-1.0, 0.5, -1.0]]),
            r"logprobs\[row 1, column 1\] = .*0\.5 > 0 on an unmasked token",
        ),
        ({}, np.zeros((2, 4)), r"logprobs has shape \(2, 4\), expected \(2, 3\)"),
        (
            dict(sampling_logprobs=np.array([[0.0, -np.inf, -1], [0, 0, 0]])),
            None,
            r"sampling_logprobs\[row 0, column 1\] = .*inf on an unmasked token",
        ),
        (
            dict(ref_logprobs=np.array([[0.0, -1, 3.0], [0, 0, 0]])),
            None,
            r"ref_logprobs\[row 0, column 2\] = 3 > 0",
        ),
        (
            dict(advantages=np.array([1.0, np.nan])),
            None,
            r"advantages\[row 1\] = .*nan: advantages must be finite",
        ),
        (
            dict(advantages=np.array([[0.0, 1, np.inf], [1, 0, 0]])),
            None,
            r"advantages\[row 0, column 2\] = .*inf: advantages must be finite",
        ),
        (
            dict(weights=np.array([[0.0, 0, 0], [0, np.nan, 0]])),
            None,
            r"weights\[row 1, column 1\] = .*nan: weights must be finite",
        ),
        (
            dict(num_rows=np.array(-1.0)),
            None,
            r"num_rows = -1\.0: normalizers must be finite and >= 0",
        ),
    ],
)
def test_check_batch_errors_name_field_row_and_rule(overrides, logprobs, message):
    with pytest.raises(ValueError, match=message):
        losses.check_batch(good(**overrides), logprobs=logprobs)


def test_check_batch_ignores_masked_garbage():
    b = good(advantages=np.array([[np.nan, 1, 1], [1, np.nan, np.nan]]))
    losses.check_batch(b, logprobs=np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, 5.0]]))
