"""foldloss `runner`: drive `losses` terms against a trainer (local JAX or Fireworks)."""

from runner._types import (
    BUILTIN_LOSSES,
    NORMALIZATIONS,
    AdamParams,
    ForwardBackwardResult,
    Sample,
    Seq,
    Trainer,
    make_seq,
    validate_seqs,
)

__all__ = [
    "BUILTIN_LOSSES",
    "NORMALIZATIONS",
    "AdamParams",
    "ForwardBackwardResult",
    "Sample",
    "Seq",
    "Trainer",
    "make_seq",
    "validate_seqs",
]
