"""`runner._seeds`: every wire seed is an int32 that decodes to its call seed and row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner._seeds import (
    CALL_SEEDS,
    ROWS_PER_CALL,
    call_seed,
    check_hosted_call,
    decode_wire_seed,
    prompt_seed,
    sample_seed,
)


@settings(deadline=None, max_examples=200)
@given(
    seed=st.integers(0, CALL_SEEDS - 1),
    n=st.integers(1, 64),
    data=st.data(),
)
def test_every_row_of_a_hosted_call_has_an_int32_seed_that_decodes_to_it(seed, n, data):
    prompts = data.draw(st.integers(1, ROWS_PER_CALL // n))
    check_hosted_call(seed, prompts, n)
    i = data.draw(st.integers(0, prompts - 1))
    j = data.draw(st.integers(0, n - 1))
    w = sample_seed(seed, i, j, n)
    assert 0 <= w < 2**31
    assert decode_wire_seed(w) == (seed, i * n + j)
    assert sample_seed(seed, i, 0, n) == prompt_seed(seed, i, n)  # a prompt's first row


def test_calls_outside_the_int32_range_are_refused():
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*19\)"):
        check_hosted_call(CALL_SEEDS, 1, 1)
    with pytest.raises(ValueError, match="seed must be"):
        check_hosted_call(-1, 1, 1)
    with pytest.raises(ValueError, match="at most 4096 completions"):
        check_hosted_call(0, ROWS_PER_CALL // 2 + 1, 2)
    assert prompt_seed(CALL_SEEDS - 1, ROWS_PER_CALL - 1) == 2**31 - 1  # the largest


def test_call_seeds_are_reproducible_spread_and_below_the_bound():
    seeds = [call_seed(7, step, turn) for step in range(50) for turn in range(4)]
    assert seeds == [call_seed(7, step, turn) for step in range(50) for turn in range(4)]
    assert all(0 <= s < CALL_SEEDS for s in seeds)
    assert len(set(seeds)) == len(seeds)
    assert np.mean(seeds) == pytest.approx(CALL_SEEDS / 2, rel=0.15)
    assert call_seed(7, 0) != call_seed(8, 0)
