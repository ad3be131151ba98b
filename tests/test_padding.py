"""Padding with reused buffers, and the client adapter's weights path (`value_and_weights`)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import losses
from runner import Seq, normalizers
from runner._client_loss import ClientLoss
from runner._padding import batch_field_names, pad_fields, pad_ragged, seqs_to_batch, unpad

ROWS, LENGTH = 8, 16


def fresh_pad(columns, rows=ROWS, length=LENGTH):
    """Independent reference: zeros, then each row written by plain indexing."""
    out = []
    for col in columns:
        ref = np.zeros((rows, length), np.float32)
        for i, a in enumerate(col):
            ref[i, : len(a)] = a
        out.append(ref)
    return out


ragged_batch = st.lists(
    st.integers(0, LENGTH), min_size=1, max_size=ROWS
)  # row lengths of one fill; 0-length rows are allowed


@settings(max_examples=60, deadline=None)
@given(fills=st.lists(ragged_batch, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_reused_buffers_with_dirty_lengths_equal_fresh_padding(fills, seed):
    # A sequence of fills of one pair of buffers, with more or fewer rows and longer or shorter
    # rows each time: only the stale entries are re-zeroed, and every fill equals a fresh pad.
    rng = np.random.default_rng(seed)
    out = [np.full((ROWS, LENGTH), np.nan, np.float32) for _ in range(2)]  # garbage at first
    dirty = [np.full(ROWS, LENGTH, np.int64) for _ in range(2)]  # ... which is all "dirty"
    for lengths in fills:
        columns = [[rng.normal(size=n) for n in lengths] for _ in range(2)]
        got = pad_fields(columns, LENGTH, ROWS, out=out, dirty=dirty)
        assert got[0] is out[0] and got[1] is out[1]  # filled in place
        for g, ref in zip(got, fresh_pad(columns), strict=True):
            np.testing.assert_array_equal(g, ref)
        for d in dirty:
            np.testing.assert_array_equal(d, list(lengths) + [0] * (ROWS - len(lengths)))


@settings(max_examples=60, deadline=None)
@given(fills=st.lists(ragged_batch, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_one_shared_dirty_array_with_given_lengths_equals_fresh_padding(fills, seed):
    # The client loss's form: every field of a row has the row's length, so one ``dirty`` array
    # (the same object for all fields) and the lengths are given once. Rows may be empty or
    # exactly the padded length, and each fill may have more or fewer rows than the last.
    rng = np.random.default_rng(seed)
    out = [np.full((ROWS, LENGTH), np.nan, np.float32) for _ in range(3)]
    dirty = np.full(ROWS, LENGTH, np.int64)
    for lengths in fills:
        columns = [[rng.normal(size=n) for n in lengths] for _ in range(3)]
        got = pad_fields(
            columns, LENGTH, ROWS, out=out, dirty=[dirty] * 3, lengths=np.array(lengths, np.int64)
        )
        for g, o, ref in zip(got, out, fresh_pad(columns), strict=True):
            assert g is o
            np.testing.assert_array_equal(g, ref)
        np.testing.assert_array_equal(dirty, list(lengths) + [0] * (ROWS - len(lengths)))


def test_pad_fields_casts_like_row_assignment():
    # float64 beyond float32 becomes inf (reported later by the value check), without a warning;
    # integer, bool and float16 rows are converted exactly.
    import warnings

    columns = [
        [np.array([1e39, -1e39, 0.5]), np.array([1, 0], np.uint8)],
        [np.array([True, False, True]), np.array([0.5, 1.0], np.float16)],
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pad_fields(columns, 4, 2)
    np.testing.assert_array_equal(got[0], [[np.inf, -np.inf, 0.5, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(got[1], [[1, 0, 1, 0], [0.5, 1, 0, 0]])


def test_batch_field_names_fast_and_slow_paths_agree():
    seqs, _ = make_seqs(np.random.default_rng(5), 3)
    names = batch_field_names(seqs)
    # Other (non-batch) keys that differ between sequences take the general path: same answer.
    mixed = [
        Seq(s.tokens, dict(s.inputs, **({"note": np.zeros(1)} if i else {})))
        for i, s in enumerate(seqs)
    ]
    assert batch_field_names(mixed) == names
    # A batch field only some sequences have is still named, with the first one lacking it.
    lacking = [seqs[0], seqs[1], Seq(seqs[2].tokens, dict(seqs[2].inputs, weights=np.ones(1)))]
    with pytest.raises(ValueError, match="sequence 0: missing field 'weights'"):
        batch_field_names(lacking)


def test_pad_without_dirty_zeroes_a_given_buffer_and_fresh_buffers_are_aligned():
    arrays = [np.arange(3.0), np.arange(5.0)]
    out = np.full((4, 8), 7.0, np.float32)
    np.testing.assert_array_equal(pad_ragged(arrays, 8, 4, out=out), fresh_pad([arrays], 4, 8)[0])
    fresh = pad_ragged(arrays, 8, 4)
    assert fresh.ctypes.data % 64 == 0
    np.testing.assert_array_equal(unpad(fresh, [3, 5])[1], np.arange(5.0))


def test_pad_fields_errors_name_the_rule():
    with pytest.raises(ValueError, match="rows for 1 padded rows"):
        pad_fields([[np.zeros(2), np.zeros(2)]], 4, 1)
    with pytest.raises(ValueError, match=r"fields have \[2, 1\] rows"):
        pad_fields([[np.zeros(2), np.zeros(2)], [np.zeros(2)]], 4, 2)
    with pytest.raises(ValueError, match="out must be 1 arrays of shape"):
        pad_fields([[np.zeros(2)]], 4, 2, out=[np.zeros((2, 5), np.float32)])


def make_seqs(rng, n, lengths=(4, 30)):
    seqs, lps = [], []
    for _ in range(n):
        t = int(rng.integers(*lengths))
        kind = rng.integers(0, 3, t)
        action = (kind == 1).astype(float)
        inputs = dict(
            action_mask=action,
            obs_mask=(kind == 2).astype(float),
            advantages=rng.normal() * action,
            sampling_logprobs=-rng.uniform(0.1, 2.0, t) * action,
            ref_logprobs=-rng.uniform(0.1, 2.0, t) * action,
        )
        seqs.append(Seq(np.zeros(t + 1, np.int64), inputs))
        lps.append(-rng.uniform(0.05, 3.0, t).astype(np.float32))
    return seqs, lps


TERM = losses.fold(
    losses.grpo(kl_coef=0.05, clip_high=0.28),
    losses.echo_env(coef=0.05, normalization="token_mean"),
)


def test_value_and_weights_are_the_negated_gradients_as_read_only_views():
    seqs, lps = make_seqs(np.random.default_rng(0), 5)
    client = ClientLoss(TERM)
    value, metrics, weights = client.value_and_weights(lps, seqs)
    value2, metrics2, grads = client.value_and_grads(lps, seqs)
    assert value == value2 and metrics == metrics2
    assert client.compile_count == 1  # both methods share one jitted function
    for w, g, s in zip(weights, grads, seqs, strict=True):
        assert w.shape == (s.num_targets,) and w.dtype == np.float32 and not w.flags.writeable
        assert g.dtype == np.float64 and g.flags.writeable
        np.testing.assert_array_equal(g, -w.astype(np.float64))
    # Exactly zero where the term reads nothing (neither action nor observation).
    for w, s in zip(weights, seqs, strict=True):
        idle = (s.inputs["action_mask"] == 0) & (s.inputs["obs_mask"] == 0)
        assert np.all(w[idle] == 0)


def test_norms_counted_in_the_term_equal_the_host_normalizers():
    # value_and_weights(norms=None) lets the jitted term count N and the token totals; they must
    # agree with `normalizers(seqs)` passed explicitly, including a row with nothing to learn.
    seqs, lps = make_seqs(np.random.default_rng(1), 6)
    empty = np.zeros(9)
    seqs.append(Seq(np.zeros(10, np.int64), {k: empty for k in seqs[0].inputs}))
    lps.append(np.full(9, -1.0, np.float32))
    client = ClientLoss(TERM)
    own = client.value_and_weights(lps, seqs)
    given_norms = client.value_and_weights(lps, seqs, normalizers(seqs))
    assert client.compile_count == 2  # with and without carried normalizers
    np.testing.assert_allclose(own[0], given_norms[0], rtol=1e-6)
    for a, b in zip(own[2], given_norms[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_reused_buffers_do_not_leak_between_calls_of_one_bucket():
    rng = np.random.default_rng(2)
    seqs1, lps1 = make_seqs(rng, 7, lengths=(20, 30))
    seqs2, lps2 = make_seqs(rng, 5, lengths=(17, 25))  # same (8, 32) bucket, fewer/shorter rows
    reused = ClientLoss(TERM)
    reused.value_and_weights(lps1, seqs1)
    first = reused.value_and_weights(lps2, seqs2)
    fresh = ClientLoss(TERM).value_and_weights(lps2, seqs2)
    assert reused.compile_count == 1
    assert first[0] == fresh[0] and first[1] == fresh[1]
    for a, b in zip(first[2], fresh[2], strict=True):
        np.testing.assert_array_equal(a, b)


def test_small_and_large_bucket_jits_give_identical_results(monkeypatch):
    # Buckets up to SMALL_BUCKET compile without XLA:CPU's parallel task assignment; that
    # changes only how the work is scheduled, never a value.
    import runner._client_loss as client_loss

    seqs, lps = make_seqs(np.random.default_rng(6), 7)
    small = ClientLoss(TERM, dtype=np.float32)
    monkeypatch.setattr(client_loss, "SMALL_BUCKET", 0)  # every bucket takes the other jit
    large = ClientLoss(TERM, dtype=np.float32)
    got_large = large.value_and_weights(lps, seqs)
    monkeypatch.undo()
    got_small = small.value_and_weights(lps, seqs)
    assert small.compile_count == large.compile_count == 1
    assert got_small[0] == got_large[0] and got_small[1] == got_large[1]
    for a, b in zip(got_small[2], got_large[2], strict=True):
        np.testing.assert_array_equal(a, b)


def test_reused_buffers_across_lengths_rows_and_norms_equal_fresh_calls():
    # One adapter called with batches of other lengths and row counts (several of the same
    # bucket, one of another in between), with and without carried normalizers in any key
    # order, must give exactly what a fresh adapter gives each time; carried normalizers in
    # another order must not compile again.
    rng = np.random.default_rng(7)
    reused = ClientLoss(TERM)
    batches = [
        make_seqs(rng, 8, lengths=(31, 33)),  # up to the bucket's full length (32)
        make_seqs(rng, 3, lengths=(1, 6)),  # another bucket
        make_seqs(rng, 5, lengths=(17, 20)),
        make_seqs(rng, 8, lengths=(1, 3)),
    ]
    for seqs, lps in batches:
        norms = normalizers(seqs)
        for carried in (None, norms, dict(reversed(list(norms.items())))):
            got = reused.value_and_weights(lps, seqs, carried)
            want = ClientLoss(TERM).value_and_weights(lps, seqs, carried)
            assert got[0] == want[0] and got[1] == want[1]
            for a, b in zip(got[2], want[2], strict=True):
                np.testing.assert_array_equal(a, b)
    shapes = {reused.shapes(seqs) for seqs, _ in batches}
    assert reused.compile_count == 2 * len(shapes)  # with and without normalizers, per bucket


def test_value_and_weights_names_a_field_of_the_wrong_length():
    seqs, lps = make_seqs(np.random.default_rng(8), 3, lengths=(5, 9))
    short = dict(seqs[2].inputs, obs_mask=np.zeros(seqs[2].num_targets - 1))
    bad = [seqs[0], seqs[1], Seq(seqs[2].tokens, short)]
    n = seqs[2].num_targets
    with pytest.raises(
        ValueError, match=rf"sequence 2: field 'obs_mask' has shape \({n - 1},\), expected \({n},\)"
    ):
        ClientLoss(TERM).value_and_weights(lps, bad)


def test_batch_with_logprobs_and_field_errors():
    seqs, lps = make_seqs(np.random.default_rng(3), 3)
    lp_BT, batch = seqs_to_batch(seqs, length=32, rows=4, norms=None, logprobs=lps)
    assert lp_BT.shape == batch.action_mask.shape == (4, 32)
    assert batch.num_rows == normalizers(seqs)["num_rows"]
    no_norms = seqs_to_batch(seqs, length=32, rows=4, norms=None, count_in_term=True)
    assert no_norms.num_rows is None and no_norms.num_action_tokens is None
    assert batch_field_names(seqs) == (
        "action_mask",
        "obs_mask",
        "advantages",
        "sampling_logprobs",
        "ref_logprobs",
    )
    partial = [seqs[0], Seq(seqs[1].tokens, {"action_mask": seqs[1].inputs["action_mask"]})]
    with pytest.raises(ValueError, match="sequence 1: missing field 'obs_mask'"):
        batch_field_names(partial)
    with pytest.raises(ValueError, match="sequence 0: missing required field 'action_mask'"):
        batch_field_names([Seq(seqs[0].tokens, {"obs_mask": seqs[0].inputs["obs_mask"]})])


@pytest.mark.parametrize(
    "values, error",
    [
        # finite in float64 but not in float32, the dtype the runner computes in (issue #11)
        (np.array([0.0, 1e308, 1e308]), r"value 1e\+308 at target 1 overflows float32"),
        (np.array([3e38, 3e38, -3e38]), None),  # float64 entries inside the float32 range
        (np.array([1e38, 1e38, 1e38], np.float32), None),  # the sum overflows; entries finite
        (np.array([1, 2, 3], np.uint8), None),
        (np.array([0.0, np.inf, -np.inf]), "non-finite value inf at target 1"),  # sum is nan
        (np.array([0.0, 1.0, np.nan]), "non-finite value nan at target 2"),
        (np.array([1 + 1j, 0, 0]), r"must be numeric \(real\), got complex128"),
        (np.array([True, False, True]), r"must be numeric \(real\), got bool"),
    ],
)
def test_validate_seqs_finiteness_fast_path_is_exact(values, error):
    # validate_seqs proves finiteness from one sum per float32 field (min/max for wider floats,
    # which must also fit in float32) and looks entry by entry only when that fails: an
    # overflowing sum of finite entries must not be an error, and no numpy overflow warning may
    # leak to the caller.
    import warnings

    from runner import validate_seqs

    seqs = [
        Seq(np.zeros(4, np.int64), {"action_mask": np.ones(3)}),
        Seq(np.zeros(4, np.int64), {"action_mask": values}),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if error is None:
            validate_seqs(seqs)
        else:
            with pytest.raises(ValueError, match=f"sequence 1: field 'action_mask' .*{error}"):
                validate_seqs(seqs)
