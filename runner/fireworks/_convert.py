"""Runner ``Seq`` ⇄ Fireworks SDK ``Datum`` conversion and the Fireworks subset of the kernels.

A `runner.Seq` (full tokens ``x[0..N-1]`` plus target-aligned per-token inputs of length
``N-1``) becomes ``Datum(model_input=ModelInput.from_ints(x[:-1]), loss_fn_inputs={
"target_tokens": int64 x[1:], <field>: float32[N-1], ...})`` (docs/training-api.md#datum-layout).
Only float32 and int64 numpy arrays reach the SDK (it rejects jax arrays, bool, unsigned and
bfloat16 inputs); ``target_tokens`` is a zero-copy view when the tokens are already int64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fireworks.training.sdk import types

from runner._hosted import ModelInputCache as _HostedModelInputCache
from runner._kernels import GENERIC_KEYS, KERNELS, check_kernel_inputs, resolve_config, supported
from runner._padding import CheckedSeqs
from runner._types import Seq, validate_seqs

#: The builtin kernels `FireworksTrainer` uses by default, declared from the kernel table
#: (`runner._kernels`): every SDK ``types.LossFnType`` with a documented or inferred formula.
#: ``reinforce`` is left out of the default: it is capability-gated (``supports_reinforce``) and
#: its formula is undocumented; name it in ``FireworksTrainer(..., builtin_losses=...)`` to opt in
#: (see `OPT_IN_LOSSES`).
BUILTIN_LOSSES = supported(
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "dapo",
    "gspo",
    "dppo",
)
#: Kernels a `FireworksTrainer` runs only when asked to (``builtin_losses=``), with the trainer
#: capability (a ``FiretitanTrainingClient`` attribute) each needs.
OPT_IN_LOSSES: dict[str, str] = {name: "supports_reinforce" for name in supported("reinforce")}
#: Kernel-specific ``loss_fn_config`` keys per kernel, from the kernel table (every kernel also
#: takes the generic `runner._kernels.GENERIC_KEYS`, e.g. ``target_logprob_support``).
LOSS_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    name: tuple(k for k in KERNELS[name].keys if k not in GENERIC_KEYS)
    for name in (*BUILTIN_LOSSES, *OPT_IN_LOSSES)
}
#: Datum inputs per kernel (besides ``target_tokens``), from the kernel table.
KERNEL_INPUTS: dict[str, tuple[str, ...]] = {
    name: KERNELS[name].inputs for name in (*BUILTIN_LOSSES, *OPT_IN_LOSSES)
}


def builtin_config(loss_name: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validates a kernel's ``loss_fn_config``; returns a fresh JSON-ready dict for the SDK.

    Validation is the kernel table's (`runner._kernels.resolve_config`, the same on every
    backend). Only the keys the caller set are sent (the server applies its own defaults to the
    rest), and a key set to ``None`` (off / the kernel's default, e.g. ``eps_clip_c``) is not
    sent. Numbers become finite Python floats, strings stay strings from their allowed sets,
    bools stay bools. A ``losses.builtin_twin`` config (same key names) translates unchanged.

    Raises:
      ValueError: unknown kernel, unknown key (naming the allowed keys), or a bad value.
    """
    full = resolve_config(loss_name, config)
    return {k: full[k] for k, v in dict(config or {}).items() if v is not None}


class ModelInputCache(_HostedModelInputCache):
    """`runner._hosted.ModelInputCache` building the Fireworks SDK's ``types.ModelInput``."""

    def __init__(self, maxsize: int = 4096) -> None:
        super().__init__(types.ModelInput.from_ints, maxsize)


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
    """Kernel-level checks after `runner.validate_seqs` (`runner._kernels.check_kernel_inputs`)."""
    check_kernel_inputs(seqs, fields, loss_name)


def to_datum(
    seq: Seq,
    index: int = 0,
    fields: Sequence[str] = (),
    *,
    model_input: types.ModelInput | None = None,
    checked: bool = False,
) -> types.Datum:
    """One `Seq` as an SDK ``Datum`` (validate first with `to_datums`).

    Args:
      seq: the sequence.
      index: its position, for error messages.
      fields: per-token inputs to send (float32); ``target_tokens`` is always sent (int64).
      model_input: a ``ModelInput`` to reuse (default: built from ``seq.tokens[:-1]``).
      checked: the runner validated the values (float32-finite): convert without re-checking.

    Returns:
      ``Datum`` with ``loss_fn_inputs = {"target_tokens", *fields}``.
    """
    tokens = seq.tokens
    targets = tokens[1:] if tokens.dtype == np.int64 else tokens[1:].astype(np.int64)
    inputs = {"target_tokens": types.TensorData.from_numpy(targets)}
    for name in fields:
        arr = (
            np.asarray(seq.inputs[name], np.float32) if checked else _field_array(seq, index, name)
        )
        inputs[name] = types.TensorData.from_numpy(arr)
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
    # The runner's own path (`CheckedSeqs`) was validated where the data entered; only this
    # trainer's limits (token ids >= 0, max_seq_len) are checked again.
    checked = isinstance(seqs, CheckedSeqs)
    seqs = [_host_seq(s) if isinstance(s, Seq) else s for s in seqs]
    if not checked:
        validate_seqs(seqs, required=fields, max_len=max_seq_len)
    for i, seq in enumerate(seqs):
        if seq.tokens.min() < 0:
            t = int(np.argmin(seq.tokens))
            raise ValueError(f"sequence {i}: token {int(seq.tokens[t])} at position {t} is < 0")
        if checked and max_seq_len is not None and seq.tokens.shape[0] - 1 > max_seq_len:
            raise ValueError(
                f"sequence {i}: model-input length {seq.tokens.shape[0] - 1} exceeds "
                f"max_seq_len={max_seq_len}"
            )
    if not checked:
        check_fields(seqs, fields, loss_name)
    out = []
    for i, seq in enumerate(seqs):
        mi = cache.get(seq.tokens) if cache is not None else None
        out.append(to_datum(seq, i, fields, model_input=mi, checked=checked))
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
