"""SFT batch → cross-entropy Seq translation (docs/sft.md#the-translation) and the collator."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runner import Seq
from runner.sft import collate_sft, sft_seq, translate_sft_batch


def _worked_batch():
    """The §3 worked example: two supervised rows and an all-zero row."""
    sequences = np.array([[10, 0, 11, 30, 31], [0, 20, 40, 41, 42], [0, 0, 7, 8, 9]])
    attention = np.array([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    loss_mask = np.array([[0.0, 0.25, 0.0], [0.0, 0.25, 0.5], [0.0, 0.0, 0.0]])
    return sequences, attention, loss_mask


def test_worked_example_preserves_collator_weights():
    seqs = translate_sft_batch(*_worked_batch(), max_seq_len=8)
    assert len(seqs) == 2  # the all-zero row is dropped
    a, b = seqs
    assert all(isinstance(s, Seq) for s in seqs)
    # Row 0: the 0 at position 1 equals the pad id but has attention 1: it is kept.
    np.testing.assert_array_equal(a.tokens, [10, 0, 11, 30, 31])
    np.testing.assert_array_equal(a.model_input, [10, 0, 11, 30])
    np.testing.assert_array_equal(a.targets, [0, 11, 30, 31])
    np.testing.assert_array_equal(a.inputs["weights"], [0, 0, 0.25, 0])
    # Row 1: A = 3 = len(model_input), nothing dropped from the loss mask.
    np.testing.assert_array_equal(b.tokens, [20, 40, 41, 42])
    np.testing.assert_array_equal(b.model_input, [20, 40, 41])
    np.testing.assert_array_equal(b.targets, [40, 41, 42])
    np.testing.assert_array_equal(b.inputs["weights"], [0, 0.25, 0.5])
    assert set(a.inputs) == {"weights"}
    assert sum(float(s.inputs["weights"].sum()) for s in seqs) == 1.0
    assert a.tokens.dtype == np.int64 and a.inputs["weights"].dtype == np.float64


def test_empty_batch_gives_no_seqs():
    empty = np.zeros((0, 4), dtype=np.int64)
    assert translate_sft_batch(empty, empty, np.zeros((0, 2)), max_seq_len=4) == []


def test_short_loss_mask_is_right_aligned():
    seqs = translate_sft_batch(
        np.array([[5, 6, 7, 8, 9]]), np.ones((1, 5)), np.array([[0.5, 0.5]]), max_seq_len=4
    )
    np.testing.assert_array_equal(seqs[0].inputs["weights"], [0, 0, 0.5, 0.5])


def test_max_seq_len_is_inclusive():
    seqs = translate_sft_batch(
        np.array([[1, 2, 3]]), np.ones((1, 3)), np.ones((1, 1)), max_seq_len=2
    )
    assert seqs[0].num_targets == 2


# -- §4 errors ------------------------------------------------------------------------------------

_S, _A, _L = _worked_batch()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(sequences=None), "requires rank-2 tensor field 'sequences'"),
        (dict(sequences=_S.tolist()), "requires rank-2 tensor field 'sequences'"),
        (dict(attention_mask=_A[0]), "requires rank-2 tensor field 'attention_mask'"),
        (dict(loss_mask=_L[None]), "requires rank-2 tensor field 'loss_mask'"),
        (dict(attention_mask=_A[:2]), "field 'attention_mask' has the wrong batch dimension"),
        (dict(loss_mask=_L[:1]), "field 'loss_mask' has the wrong batch dimension"),
    ],
)
def test_field_errors(kwargs, fragment):
    fields = dict(sequences=_S, attention_mask=_A, loss_mask=_L) | kwargs
    with pytest.raises(ValueError, match=fragment):
        translate_sft_batch(**fields, max_seq_len=8)


@pytest.mark.parametrize(
    "mask",
    [[0, 1, 0, 1, 1], [1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [0, 0, 1, 0, 0]],
    ids=["hole", "right-padding", "hole-at-start", "isolated"],
)
def test_non_contiguous_padding(mask):
    attention = _A.copy()
    attention[1] = mask
    with pytest.raises(
        ValueError, match=r"attention_mask\[1\] must describe contiguous left padding"
    ):
        translate_sft_batch(_S, attention, _L, max_seq_len=8)


@pytest.mark.parametrize("mask", [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]])
def test_fewer_than_two_tokens(mask):
    # A supervised row needs at least two tokens (an unsupervised one is dropped, below).
    attention, loss_mask = _A.copy(), _L.copy()
    attention[2] = mask
    loss_mask[2] = [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="sample 2 must contain at least two tokens"):
        translate_sft_batch(_S, attention, loss_mask, max_seq_len=8)


def test_length_over_limit():
    with pytest.raises(
        ValueError, match="sample 0 has model-input length 4, exceeding max_seq_len=3"
    ):
        translate_sft_batch(_S, _A, _L, max_seq_len=3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -0.25])
def test_invalid_weights(bad):
    loss_mask = _L.copy()
    loss_mask[1, 2] = bad
    with pytest.raises(
        ValueError, match=r"loss_mask\[1\] must contain finite non-negative weights"
    ):
        translate_sft_batch(_S, _A, loss_mask, max_seq_len=8)


def test_weight_outside_the_sequence():
    # Row 2 has 3 tokens → model_input length 2 < A = 3: its first loss-mask entry is padding.
    loss_mask = _L.copy()
    loss_mask[2] = [0.1, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"loss_mask\[2\] supervises a token outside the sequence"):
        translate_sft_batch(_S, _A, loss_mask, max_seq_len=8)


def test_every_row_unweighted():
    with pytest.raises(ValueError, match="SFT batch has no supervised tokens"):
        translate_sft_batch(_S, _A, np.zeros_like(_L), max_seq_len=8)


def test_datum_length_mismatch():
    with pytest.raises(
        ValueError,
        match=r"SFT datum fields must all have length 3, got \{'model_input': 3, "
        r"'target_tokens': 3, 'weights': 2\}",
    ):
        sft_seq([1, 2, 3], [2, 3, 4], [0.5, 0.5])
    np.testing.assert_array_equal(sft_seq([1, 2, 3], [2, 3, 4], [0, 0, 1]).tokens, [1, 2, 3, 4])


def test_bad_max_seq_len_and_shapes():
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        translate_sft_batch(_S, _A, _L, max_seq_len=0)
    with pytest.raises(ValueError, match="'attention_mask' has shape"):
        translate_sft_batch(_S, _A[:, 1:], _L, max_seq_len=8)
    with pytest.raises(ValueError, match="integer token ids"):
        translate_sft_batch(_S.astype(float), _A, _L, max_seq_len=8)


# -- collator -------------------------------------------------------------------------------------


def test_collate_layout():
    seqs, attn, lmask = collate_sft([([5, 6], [7, 8, 9]), ([4], [3])], pad_id=0)
    np.testing.assert_array_equal(seqs, [[5, 6, 7, 8, 9], [0, 0, 0, 4, 3]])
    np.testing.assert_array_equal(attn, [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    np.testing.assert_allclose(lmask, [[0.25, 0.25, 0.25], [0, 0, 0.25]])
    out = translate_sft_batch(seqs, attn, lmask, max_seq_len=16)
    np.testing.assert_allclose(out[0].inputs["weights"], [0, 0.25, 0.25, 0.25])
    np.testing.assert_allclose(out[1].inputs["weights"], [0.25])


def test_collate_with_completion_mask_and_errors():
    seqs, attn, lmask = collate_sft([([1, 2], [3, 4, 5], [1, 0, 1])], pad_id=9)
    np.testing.assert_allclose(lmask, [[0.5, 0, 0.5]])
    with pytest.raises(ValueError, match="at least one example"):
        collate_sft([])
    with pytest.raises(ValueError, match="example 1 has an empty prompt"):
        collate_sft([([1], [2]), ([], [2])])
    with pytest.raises(ValueError, match="example 0 must contain at least two tokens"):
        collate_sft([([1], [])])
    with pytest.raises(ValueError, match="example 0 has a mask of shape"):
        collate_sft([([1], [2, 3], [1])])
    with pytest.raises(ValueError, match="example 0 mask must be finite and non-negative"):
        collate_sft([([1], [2], [-1.0])])


_tokens = st.lists(st.integers(0, 50), max_size=7)


@given(
    examples=st.lists(
        st.tuples(_tokens.filter(len), _tokens).filter(lambda ex: len(ex[0]) + len(ex[1]) >= 2),
        min_size=1,
        max_size=5,
    ).filter(lambda exs: any(c for _, c in exs)),
    pad_id=st.sampled_from([0, 3, 50]),
)
def test_collate_translate_round_trip(examples, pad_id):
    seqs, attn, lmask = collate_sft(examples, pad_id=pad_id)
    n_supervised = sum(len(c) for _, c in examples)
    assert lmask.sum() == pytest.approx(1.0)
    out = translate_sft_batch(seqs, attn, lmask, max_seq_len=16)
    kept = [(p, c) for p, c in examples if c]  # rows without a completion are dropped
    assert len(out) == len(kept)
    for seq, (p, c) in zip(out, kept, strict=True):
        np.testing.assert_array_equal(seq.tokens, p + c)  # pad-id tokens inside are kept
        expected = np.array([0.0] * (len(p) - 1) + [1.0 / n_supervised] * len(c))
        np.testing.assert_allclose(seq.inputs["weights"], expected, rtol=1e-15)
    assert sum(s.inputs["weights"].sum() for s in out) == pytest.approx(1.0)


def test_all_padding_rows_without_supervision_are_dropped():
    """Issue #12 row 11: the docstring says such rows are dropped; they raised instead."""
    for mask in ([0, 0, 0, 0, 0], [0, 0, 0, 0, 1]):  # all padding; a single token
        attention = _A.copy()
        attention[2] = mask  # row 2's loss mask is all zero
        kept = translate_sft_batch(_S, attention, _L, max_seq_len=8)
        full = translate_sft_batch(_S, _A, _L, max_seq_len=8)
        assert len(kept) == len(full) == 2
        for a, b in zip(kept, full, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.inputs["weights"], b.inputs["weights"])
