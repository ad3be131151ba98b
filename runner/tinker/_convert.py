"""Runner ``Seq`` ⇄ tinker SDK ``Datum``, the kernels Tinker documents, and per-prompt seeds.

A `runner.Seq` (full tokens ``x[0..N-1]`` plus target-aligned per-token inputs of length
``N-1``) becomes ``Datum(model_input=ModelInput.from_ints(x[:-1]), loss_fn_inputs={
"target_tokens": int64 x[1:], <field>: float32[N-1], ...})`` — the layout of
docs/training-api.md#datum-layout, which the tinker SDK shares. Only float32 and int64 numpy
arrays reach the SDK (``TensorData.from_numpy`` keeps a writeable array without copying).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tinker import types

from runner._hosted import ModelInputCache as _HostedModelInputCache
from runner._kernels import KERNELS, check_kernel_inputs, resolve_config, supported
from runner._padding import CheckedSeqs
from runner._types import Seq, validate_seqs
from runner.tinker._seeds import CALL_SEEDS, prompt_seed  # noqa: F401 - re-exported

#: The builtin kernels Tinker documents (its ``LossFnType`` names in the kernel table):
#: `TinkerTrainer.builtin_losses`.
BUILTIN_LOSSES = supported("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
#: Datum inputs per kernel (besides ``target_tokens``), from the kernel table.
KERNEL_INPUTS: dict[str, tuple[str, ...]] = {name: KERNELS[name].inputs for name in BUILTIN_LOSSES}


def loss_config(loss_name: str, config: Mapping[str, Any] | None) -> dict[str, float | str]:
    """Validates a kernel's ``loss_fn_config`` with the kernel table; returns what to send.

    Only the keys the caller set are sent (the server applies its own defaults), keys set to
    ``None`` are left out, numbers become floats; a bool (no Tinker kernel takes one) is refused.

    Raises:
      ValueError: unknown kernel or key, a value breaking its rule (`resolve_config`).
    """
    full = resolve_config(loss_name, config)
    out: dict[str, float | str] = {}
    for key, value in dict(config or {}).items():
        if value is None:
            continue
        value = full[key]
        if isinstance(value, bool):
            raise ValueError(
                f"{loss_name}: loss_fn_config '{key}' is a bool, which tinker cannot send"
            )
        out[key] = value if isinstance(value, str) else float(value)
    return out


class ModelInputCache(_HostedModelInputCache):
    """`runner._hosted.ModelInputCache` building the Tinker SDK's ``types.ModelInput``."""

    def __init__(self, maxsize: int = 4096) -> None:
        super().__init__(types.ModelInput.from_ints, maxsize)


def to_datums(
    seqs: Sequence[Seq],
    fields: Sequence[str],
    *,
    loss_name: str | None = None,
    max_seq_len: int | None = None,
    cache: ModelInputCache | None = None,
) -> list[types.Datum]:
    """Validates `Seq`s and converts them to tinker ``Datum``s (errors name sequence and field).

    The runner's `CheckedSeqs` were validated where they entered: only the trainer's limits
    (``max_seq_len``, non-negative tokens) are checked again.

    Args:
      seqs: the sequences (non-empty).
      fields: the per-token inputs to send; each must be present, and no other may be (except
        ``target_tokens`` equal to ``tokens[1:]``).
      loss_name: the kernel (for messages).
      max_seq_len: the model-input length limit.
      cache: a `ModelInputCache`.
    """
    if isinstance(seqs, Seq) or not isinstance(seqs, Sequence):
        raise ValueError(f"expected a sequence of runner.Seq, got {type(seqs).__name__}")
    checked = isinstance(seqs, CheckedSeqs)
    if not checked:
        validate_seqs(seqs, required=fields, max_len=max_seq_len)
        check_kernel_inputs(seqs, fields, loss_name)
    out = []
    for i, seq in enumerate(seqs):
        tokens = np.asarray(seq.tokens)
        if tokens.min() < 0:
            t = int(np.argmin(tokens))
            raise ValueError(f"sequence {i}: token {int(tokens[t])} at position {t} is < 0")
        if max_seq_len is not None and tokens.shape[0] - 1 > max_seq_len:
            raise ValueError(
                f"sequence {i}: model-input length {tokens.shape[0] - 1} exceeds "
                f"max_seq_len={max_seq_len}"
            )
        targets = tokens[1:].astype(np.int64, copy=False)
        inputs = {"target_tokens": types.TensorData.from_numpy(np.ascontiguousarray(targets))}
        for name in fields:
            arr = np.asarray(seq.inputs[name], np.float32)
            if not checked and not np.isfinite(arr).all():
                t = int(np.argmin(np.isfinite(arr)))
                raise ValueError(
                    f"sequence {i}: field '{name}' value at target {t} is not a finite float32"
                )
            inputs[name] = types.TensorData.from_numpy(arr)
        model_input = cache.get(seq.tokens) if cache is not None else None
        if model_input is None:
            model_input = types.ModelInput.from_ints(tokens[:-1].tolist())
        out.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))
    return out


def output_logprobs(output: Any, seqs: Sequence[Seq], *, required: bool) -> list[np.ndarray]:
    """Per-sequence float32 logprobs of a ``ForwardBackwardOutput`` (``[]`` when the server
    sent none and ``required`` is False)."""
    outs = list(output.loss_fn_outputs or [])
    if not outs or any("logprobs" not in o for o in outs):
        if required:
            raise RuntimeError(
                f"the trainer returned no per-token 'logprobs' ({len(outs)} outputs for "
                f"{len(seqs)} sequences)"
            )
        return []
    if len(outs) != len(seqs):
        raise RuntimeError(f"the trainer returned {len(outs)} outputs for {len(seqs)} sequences")
    result = []
    for i, (o, seq) in enumerate(zip(outs, seqs, strict=True)):
        lp = np.asarray(o["logprobs"].to_numpy(), np.float32).reshape(-1)
        if lp.shape[0] != seq.num_targets:
            raise RuntimeError(
                f"sequence {i}: the trainer returned {lp.shape[0]} logprobs for "
                f"{seq.num_targets} targets"
            )
        result.append(lp)
    return result
