"""The runner's data types (the `Trainer` protocol is `runner._protocols`; the kernel table
`runner._kernels`); this module imports neither.

A `Seq` mirrors a Fireworks/Tinker ``Datum``: the full token sequence ``x[0..N-1]`` (the model
input is ``x[:-1]``, the targets are ``x[1:]``) plus named per-token arrays of length ``N-1``,
each target-aligned (entry ``t`` describes target ``x[t+1]``). Built-in kernels read the inputs
they document (``weights``, ``logprobs``, ``advantages``); the client-loss adapter reads its own
fields (``action_mask``, ``obs_mask``, ``sampling_logprobs``, ...) and never sends them to the
trainer.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import losses
from runner._kernels import KERNELS

#: ``optim_step`` gradient-accumulation normalization modes (Fireworks ``GradAccNormalization``).
NORMALIZATIONS = ("none", "num_loss_tokens", "num_sequences")


@dataclasses.dataclass(frozen=True, eq=False)
class Seq:
    """One sequence at the trainer boundary.

    Attributes:
      tokens: int64[N] full token sequence, N ≥ 2.
      inputs: per-token float arrays of length N-1 (target-aligned), by name.
    """

    tokens: np.ndarray
    inputs: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def num_targets(self) -> int:
        return int(self.tokens.shape[0]) - 1

    @property
    def model_input(self) -> np.ndarray:
        return self.tokens[:-1]

    @property
    def targets(self) -> np.ndarray:
        return self.tokens[1:]

    def with_inputs(self, **inputs: np.ndarray) -> Seq:
        """A `Seq` with the same tokens and only the given inputs."""
        return Seq(self.tokens, inputs)


class NonFiniteUpdateError(ValueError):
    """A step's loss, gradient or optimizer update is not finite; it was not applied."""


#: The input names a `Seq` may carry: the `losses.Batch` data fields (one list, owned by
#: `losses`) and the builtin kernels' datum inputs (`runner._kernels`).
SEQ_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(losses.DATA_FIELDS + tuple(i for k in KERNELS.values() for i in k.inputs))
)


def make_seq(tokens: Any, index: int = 0, **inputs: Any) -> Seq:
    """Builds and validates a `Seq` (``index`` names the sequence in errors).

    Raises:
      ValueError: malformed tokens or inputs, or an input name not in `SEQ_FIELDS` (a misspelt
        field would otherwise be dropped silently, e.g. a zero ECHO term).
    """
    for name in inputs:
        if name not in SEQ_FIELDS:
            close = difflib.get_close_matches(name, SEQ_FIELDS, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise losses.UnknownFieldError(
                f"sequence {index}: unknown field {name!r}{hint} (known fields: "
                f"{', '.join(SEQ_FIELDS)})"
            )
    toks = np.asarray(tokens)
    if toks.ndim != 1:
        raise ValueError(f"sequence {index}: tokens must be rank 1, got shape {toks.shape}")
    if toks.size and not np.issubdtype(toks.dtype, np.integer):
        raise ValueError(f"sequence {index}: tokens must be integers, got dtype {toks.dtype}")
    toks = toks.astype(np.int64)
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in inputs.items()}
    seq = Seq(toks, arrays)
    validate_seqs([seq], offset=index)
    return seq


def validate_seqs(
    seqs: Sequence[Seq],
    *,
    required: Sequence[str] = (),
    vocab_size: int | None = None,
    max_len: int | None = None,
    offset: int = 0,
) -> None:
    """Raises ``ValueError`` naming the sequence and field for malformed sequences.

    Rules: at least one sequence; tokens are rank-1 integers with ≥ 2 entries (and within
    ``vocab_size``/``max_len`` when given); every input is rank 1 with length ``N-1``, real
    (integer or float) and finite; every field in ``required`` is present.
    """
    VALIDATIONS["validate_seqs"] += 1
    if len(seqs) == 0:
        raise ValueError("empty batch: at least one sequence is required")
    # The finiteness fast path sums each float field; an overflowing sum (huge finite entries)
    # or inf - inf is expected there and re-checked entry by entry, so numpy need not warn.
    with np.errstate(over="ignore", invalid="ignore"):
        for j, seq in enumerate(seqs):
            i = j + offset
            if not isinstance(seq, Seq):
                raise ValueError(f"sequence {i}: expected a runner.Seq, got {type(seq).__name__}")
            toks = seq.tokens
            if toks.ndim != 1 or toks.shape[0] < 2:
                raise ValueError(
                    f"sequence {i}: tokens must be rank 1 with at least 2 entries, got shape {toks.shape}"
                )
            if not np.issubdtype(toks.dtype, np.integer):
                raise ValueError(f"sequence {i}: tokens must be integers, got dtype {toks.dtype}")
            if vocab_size is not None and (toks.min() < 0 or toks.max() >= vocab_size):
                bad = int(np.argmax((toks < 0) | (toks >= vocab_size)))
                raise ValueError(
                    f"sequence {i}: token {int(toks[bad])} at position {bad} is outside the vocabulary "
                    f"[0, {vocab_size})"
                )
            if max_len is not None and toks.shape[0] - 1 > max_len:
                raise ValueError(
                    f"sequence {i}: model-input length {toks.shape[0] - 1} exceeds max_seq_len={max_len}"
                )
            n = toks.shape[0] - 1
            for name in required:
                if name not in seq.inputs:
                    raise ValueError(f"sequence {i}: missing required field '{name}'")
            for name, arr in seq.inputs.items():
                arr = np.asarray(arr)
                if arr.shape != (n,):
                    raise ValueError(
                        f"sequence {i}: field '{name}' has shape {arr.shape}, expected ({n},) "
                        f"(one entry per target token: len(tokens) - 1)"
                    )
                kind = arr.dtype.kind  # (cheaper than np.issubdtype per field)
                if kind not in _NUMERIC_KINDS:
                    raise ValueError(
                        f"sequence {i}: field '{name}' must be numeric (real), got {arr.dtype}"
                    )
                if kind != "f":  # integers are finite and far inside the float32 range
                    continue
                if arr.dtype.itemsize <= 4:
                    if math.isfinite(arr.sum()):
                        # A finite sum proves every entry finite (an inf or nan anywhere makes it
                        # inf or nan); an infinite sum may be an overflow: look entry by entry.
                        continue
                elif arr.size == 0 or (-_F32_MAX <= arr.min() and arr.max() <= _F32_MAX):
                    # Wider floats: every entry finite *and* inside float32, the dtype the runner
                    # computes in (nan fails both comparisons).
                    continue
                finite = np.isfinite(arr)
                if not finite.all():
                    t = int(np.argmin(finite))
                    raise ValueError(
                        f"sequence {i}: field '{name}' has a non-finite value {float(arr[t])} at "
                        f"target {t}"
                    )
                if arr.dtype.itemsize > 4:
                    big = np.abs(arr) > _F32_MAX
                    if big.any():
                        t = int(np.argmax(big))
                        raise ValueError(
                            f"sequence {i}: field '{name}' value {float(arr[t]):g} at target {t} "
                            f"overflows float32 (its largest value is {_F32_MAX:g})"
                        )


#: How many times `validate_seqs` ran in this process (tests count validations per step).
VALIDATIONS: collections.Counter[str] = collections.Counter()
_F32_MAX = float(np.finfo(np.float32).max)

#: ``dtype.kind`` of the accepted field dtypes: real numbers (signed, unsigned, float). Complex
#: fields are rejected: no kernel or loss reads them, and the wire has no complex dtype.
_NUMERIC_KINDS = "iuf"


@dataclasses.dataclass(frozen=True)
class AdamParams:
    """Adam(W) hyperparameters with the Fireworks ``AdamParams`` meaning and defaults.

    ``weight_decay`` is decoupled (AdamW); ``grad_clip_norm`` clips the global gradient norm
    before the update, 0 = off. Order at ``optim_step``: normalize the accumulated gradient, clip,
    update.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        checks = [
            ("learning_rate", self.learning_rate, 0.0, None),
            ("beta1", self.beta1, 0.0, 1.0),
            ("beta2", self.beta2, 0.0, 1.0),
            ("eps", self.eps, 0.0, None),
            ("weight_decay", self.weight_decay, 0.0, None),
            ("grad_clip_norm", self.grad_clip_norm, 0.0, None),
        ]
        for name, value, low, high in checks:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"AdamParams.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < low or (high is not None and value >= high):
                bound = f"in [{low}, {high})" if high is not None else f">= {low}"
                raise ValueError(f"AdamParams.{name} must be {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ForwardBackwardResult:
    """What ``forward_backward`` returns: per-sequence trainer logprobs and server metrics.

    ``metrics`` keys follow the Fireworks ``name:reduction`` convention (``loss:sum`` is the
    kernel's raw token-sum loss — for a linear client surrogate, *not* the user's loss).
    """

    logprobs: list[np.ndarray]
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled completion: its tokens and their sampling logprobs (float32[len(tokens)])."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str  # "stop" (a stop token was emitted, and is included) or "length"
