"""Shared hypothesis strategies. Shapes come from a few fixed sizes so jit compiles stay few.

The term configurations the properties run over are the case registry, tests/cases.py."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import losses

SHAPES = [(1, 1), (2, 5), (4, 7)]
f64 = np.float64


def _arr(shape, lo, hi):
    # Tiny magnitudes are mapped to 0: XLA flushes denormal products to zero on CPU.
    elements = st.floats(lo, hi, allow_nan=False, allow_subnormal=False, width=64).map(
        lambda x: 0.0 if abs(x) < 1e-30 else x
    )
    return hnp.arrays(f64, shape, elements=elements)


@st.composite
def batches(draw, shapes=SHAPES, token_advantages=None, with_obs=True, allow_empty=True):
    """(logprobs[B, T], Batch) with disjoint masks, anchors near logprobs, random advantages."""
    b, t = draw(st.sampled_from(shapes))
    action = draw(hnp.arrays(np.bool_, (b, t)))
    if with_obs:
        obs = draw(hnp.arrays(np.bool_, (b, t))) & ~action
    else:
        obs = np.zeros((b, t), bool)
    if not allow_empty and not action.any():
        action[0, 0] = True
        obs[0, 0] = False
    lp = draw(_arr((b, t), -8.0, -1e-3))
    old = np.minimum(lp + draw(_arr((b, t), -1.2, 1.2)), 0.0)
    ref = np.minimum(lp + draw(_arr((b, t), -1.5, 1.5)), 0.0)
    per_token = draw(st.booleans()) if token_advantages is None else token_advantages
    adv = draw(_arr((b, t) if per_token else (b,), -3.0, 3.0))
    weights = draw(_arr((b, t), -2.0, 2.0))
    batch = losses.Batch(
        action_mask=action.astype(f64),
        obs_mask=obs.astype(f64),
        advantages=adv,
        sampling_logprobs=old,
        ref_logprobs=ref,
        weights=weights,
    )
    return lp, batch


@st.composite
def policy_batches(draw, shapes=SHAPES, token_advantages=None, mismatch=True):
    """`batches` whose sampling logprobs differ from the anchor ``old_logprobs`` (ρ ≠ 1).

    ``old_logprobs`` stays as `batches` draws it (near ``logprobs``); ``sampling_logprobs`` is
    ``min(old + U(-1, 1), 0)``, so a mismatch correction has something to correct.
    """
    lp, batch = draw(batches(shapes=shapes, token_advantages=token_advantages))
    if mismatch:
        old = np.asarray(batch.old_logprobs)
        sampling = np.minimum(old + draw(_arr(old.shape, -1.0, 1.0)), 0.0)
        batch = batch.replace(sampling_logprobs=sampling)
    return lp, batch
