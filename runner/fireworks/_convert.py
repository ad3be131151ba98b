"""Runner ``Seq`` ⇄ Fireworks SDK ``Datum`` conversion and the builtin-loss tables.

A `runner.Seq` (full tokens ``x[0..N-1]`` plus target-aligned per-token inputs of length
``N-1``) becomes ``Datum(model_input=ModelInput.from_ints(x[:-1]), loss_fn_inputs={
"target_tokens": int64 x[1:], <field>: float32[N-1], ...})`` (reference/fireworks-sdk.md §2.4).
Only float32 and int64 numpy arrays reach the SDK (it rejects jax arrays, bool, unsigned and
bfloat16 inputs); ``target_tokens`` is a zero-copy view when the tokens are already int64.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fireworks.training.sdk import types

from runner._types import Seq, check_kernel_inputs, validate_seqs

#: Builtin kernels (SDK ``types.LossFnType`` names) whose formulas `losses` terms express
#: (``losses.builtin_twin`` targets plus ``cross_entropy``). ``reinforce`` is left out: its
#: kernel is undocumented and capability-gated (``supports_reinforce``).
BUILTIN_LOSSES = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "dapo",
    "gspo",
    "dppo",
)
#: ``loss_fn_config`` keys per kernel (reference/fireworks-sdk.md §4; they coincide with the
#: keys ``losses.builtin_twin`` emits). Every kernel also takes ``target_logprob_support``
#: (§4.1; the SDK validates its value and capability client-side).
LOSS_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("ratio_log_cap",),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold", "ratio_log_cap"),
    "dro": ("beta",),
    "dapo": ("clip_low_threshold", "clip_high_threshold", "ratio_log_cap", "eps_clip_c"),
    "gspo": ("clip_low_threshold", "clip_high_threshold", "seq_ratio_log_cap"),
    "dppo": ("divergence", "threshold", "ratio_log_cap"),
}
_GENERIC_KEYS = ("target_logprob_support",)
_STRING_VALUES = {
    "divergence": ("binary_tv", "binary_kl"),
    "target_logprob_support": ("full_vocabulary", "sampling_support", "candidates"),
}
#: Datum inputs per kernel (besides ``target_tokens``).
KERNEL_INPUTS: dict[str, tuple[str, ...]] = {
    name: ("weights",) if name == "cross_entropy" else ("logprobs", "advantages")
    for name in BUILTIN_LOSSES
}


def builtin_config(loss_name: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validates a kernel's ``loss_fn_config``; returns a fresh JSON-ready dict.

    Translates a ``losses.builtin_twin`` config (same key names) into the SDK's
    ``loss_fn_config``: numbers become finite Python floats, ``divergence`` and
    ``target_logprob_support`` stay strings from their allowed sets.

    Raises:
      ValueError: unknown kernel, unknown key (naming the allowed keys), or a bad value.
    """
    if not isinstance(loss_name, str) or loss_name not in LOSS_CONFIG_KEYS:
        raise ValueError(f"unknown loss {loss_name!r}; expected one of {BUILTIN_LOSSES}")
    allowed = LOSS_CONFIG_KEYS[loss_name] + _GENERIC_KEYS
    out: dict[str, Any] = {}
    for key, value in dict(config or {}).items():
        if key not in allowed:
            raise ValueError(
                f"{loss_name}: unknown loss_fn_config key {key!r}; allowed keys: {allowed}"
            )
        if key in _STRING_VALUES:
            if value not in _STRING_VALUES[key]:
                raise ValueError(
                    f"{loss_name}: loss_fn_config '{key}' must be one of {_STRING_VALUES[key]}, "
                    f"got {value!r}"
                )
            out[key] = str(value)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float | np.number):
            raise ValueError(f"{loss_name}: loss_fn_config '{key}' must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise ValueError(f"{loss_name}: loss_fn_config '{key}' must be finite, got {value!r}")
        out[key] = float(value)
    return out


class ModelInputCache:
    """Reuses one ``ModelInput`` per live token array, so the forward and the linear backward of
    a client pass send the very same model input (the precomputed-forward invariant)."""

    def __init__(self, maxsize: int = 4096) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, types.ModelInput]] = {}
        self._maxsize = maxsize
        self._lock = threading.Lock()

    def get(self, tokens: np.ndarray) -> types.ModelInput:
        key = id(tokens)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0]() is tokens and hit[1] == tokens.shape[0]:
                return hit[2]
        model_input = types.ModelInput.from_ints(tokens[:-1].tolist())
        with self._lock:
            if len(self._entries) >= self._maxsize:
                self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
                if len(self._entries) >= self._maxsize:
                    self._entries.clear()
            self._entries[key] = (weakref.ref(tokens), tokens.shape[0], model_input)
        return model_input


def _field_array(seq: Seq, index: int, name: str) -> np.ndarray:
    arr = np.asarray(seq.inputs[name])
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"sequence {index}: field '{name}' must be a float array, got {arr.dtype}")
    with np.errstate(over="ignore"):  # an overflow is reported below, naming the field
        out = np.asarray(arr, dtype=np.float32)
    if not np.isfinite(out).all():
        t = int(np.argmin(np.isfinite(out)))
        raise ValueError(
            f"sequence {index}: field '{name}' value {float(arr[t])!r} at target {t} is not a "
            "finite float32"
        )
    return out


def check_fields(seqs: Sequence[Seq], fields: Sequence[str], loss_name: str | None) -> None:
    """Kernel-level checks after `runner.validate_seqs` (`runner._types.check_kernel_inputs`)."""
    check_kernel_inputs(seqs, fields, loss_name)


def to_datum(
    seq: Seq,
    index: int = 0,
    fields: Sequence[str] = (),
    *,
    model_input: types.ModelInput | None = None,
) -> types.Datum:
    """One `Seq` as an SDK ``Datum`` (validate first with `to_datums`).

    Args:
      seq: the sequence.
      index: its position, for error messages.
      fields: per-token inputs to send (float32); ``target_tokens`` is always sent (int64).
      model_input: a ``ModelInput`` to reuse (default: built from ``seq.tokens[:-1]``).

    Returns:
      ``Datum`` with ``loss_fn_inputs = {"target_tokens", *fields}``.
    """
    tokens = seq.tokens
    targets = tokens[1:] if tokens.dtype == np.int64 else tokens[1:].astype(np.int64)
    inputs = {"target_tokens": types.TensorData.from_numpy(targets)}
    for name in fields:
        inputs[name] = types.TensorData.from_numpy(_field_array(seq, index, name))
    if model_input is None:
        model_input = types.ModelInput.from_ints(tokens[:-1].tolist())
    return types.Datum(model_input=model_input, loss_fn_inputs=inputs)


def _host_seq(seq: Seq) -> Seq:
    """``seq`` with numpy arrays (jax arrays brought to the host, bfloat16 widened to float32);
    the same object when nothing changes (so its tokens keep their cached ``ModelInput``)."""
    tokens = seq.tokens if isinstance(seq.tokens, np.ndarray) else np.asarray(seq.tokens)
    changed = tokens is not seq.tokens
    inputs = {}
    for name, value in seq.inputs.items():
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype.kind == "V" and "float" in arr.dtype.name:  # ml_dtypes: bfloat16, float8
            arr = arr.astype(np.float32)
        changed = changed or arr is not value
        inputs[name] = arr
    return Seq(tokens, inputs) if changed else seq


def to_datums(
    seqs: Sequence[Seq],
    fields: Sequence[str] = (),
    *,
    loss_name: str | None = None,
    max_seq_len: int | None = None,
    cache: ModelInputCache | None = None,
) -> list[types.Datum]:
    """Validates `Seq`s and converts them to ``Datum``s (errors name the sequence and field).

    Args:
      seqs: the sequences (non-empty); numpy or jax arrays (bfloat16 inputs are widened).
      fields: per-token inputs to send; each must be present. Any other input is an error,
        except ``target_tokens`` equal to ``tokens[1:]`` (which is always sent anyway).
      loss_name: the kernel, for error messages (``None`` = a forward).
      max_seq_len: the trainer's model-input length limit.
      cache: a `ModelInputCache` to reuse model inputs across calls.

    Returns:
      One ``Datum`` per sequence, in order.
    """
    if isinstance(seqs, Seq) or not isinstance(seqs, Sequence):
        raise ValueError(f"expected a sequence of runner.Seq, got {type(seqs).__name__}")
    seqs = [_host_seq(s) if isinstance(s, Seq) else s for s in seqs]
    validate_seqs(seqs, required=fields, max_len=max_seq_len)
    for i, seq in enumerate(seqs):
        if seq.tokens.min() < 0:
            t = int(np.argmin(seq.tokens))
            raise ValueError(f"sequence {i}: token {int(seq.tokens[t])} at position {t} is < 0")
    check_fields(seqs, fields, loss_name)
    out = []
    for i, seq in enumerate(seqs):
        mi = cache.get(seq.tokens) if cache is not None else None
        out.append(to_datum(seq, i, fields, model_input=mi))
    return out


def output_logprobs(
    output: types.ForwardBackwardOutput, seqs: Sequence[Seq], *, required: bool
) -> list[np.ndarray]:
    """Per-sequence float32 logprobs from an SDK output (``TensorData.to_numpy``, zero-copy).

    Returns ``[]`` when the output carries no per-token logprobs and ``required`` is False (the
    cross-entropy backward may return only the aggregate loss).
    """
    outs = list(output.loss_fn_outputs or [])
    if not outs or any("logprobs" not in o for o in outs):
        if required:
            raise RuntimeError(
                "the trainer returned no per-token 'logprobs' "
                f"({len(outs)} outputs for {len(seqs)} sequences)"
            )
        return []
    if len(outs) != len(seqs):
        raise RuntimeError(f"the trainer returned {len(outs)} outputs for {len(seqs)} sequences")
    result = []
    for i, (o, seq) in enumerate(zip(outs, seqs, strict=True)):
        lp = o["logprobs"].to_numpy().reshape(-1)
        if lp.shape[0] != seq.num_targets:
            raise RuntimeError(
                f"sequence {i}: the trainer returned {lp.shape[0]} logprobs for "
                f"{seq.num_targets} targets"
            )
        result.append(lp)
    return result
