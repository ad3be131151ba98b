"""SFT batch → cross-entropy `Seq` translation, and the collator that builds such batches.

The contract is SkyRL's native Fireworks SFT backend (`docs/sft.md` §2-4):
a collated batch holds left-padded ``sequences`` / ``attention_mask`` ``[B, L]`` and a
right-aligned, batch-normalized ``loss_mask`` ``[B, A]`` (weights summing to 1 over the batch).
`translate_sft_batch` turns it into one `runner.Seq` per supervised row, whose ``weights`` input
drives the trainer's built-in ``cross_entropy`` kernel (``loss = Σ w·(-logp[target])``, i.e. the
per-token mean NLL of the whole batch when the step uses no normalization).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runner._types import Seq, make_seq

_FIELDS = ("sequences", "attention_mask", "loss_mask")


def _matrix(name: str, value: Any, batch_size: int | None) -> np.ndarray:
    if value is None or not hasattr(value, "shape") or len(value.shape) != 2:
        raise ValueError(f"SFT batch requires rank-2 tensor field '{name}'")
    arr = np.asarray(value)
    if batch_size is not None and arr.shape[0] != batch_size:
        raise ValueError(
            f"SFT batch field '{name}' has the wrong batch dimension: {arr.shape[0]}, "
            f"expected {batch_size}"
        )
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"SFT batch requires rank-2 tensor field '{name}' with a numeric dtype")
    return arr


def sft_seq(model_input: Any, target_tokens: Any, weights: Any, index: int = 0) -> Seq:
    """One SFT datum as a `Seq` (SkyRL ``SFTDatumSpec``), after the final length check.

    Args:
      model_input: int[N] = ``tokens[:-1]``.
      target_tokens: int[N] = ``tokens[1:]``.
      weights: float[N] cross-entropy weights (target-aligned).
      index: the row, for error messages.

    Returns:
      `Seq` with ``tokens`` = ``model_input + [target_tokens[-1]]`` and inputs ``{"weights"}``.

    Raises:
      ValueError: ``SFT datum fields must all have length N, got {...}`` when the three lengths
        differ, or when the targets are not the model input shifted by one.
    """
    model_input = np.asarray(model_input, dtype=np.int64).reshape(-1)
    target_tokens = np.asarray(target_tokens, dtype=np.int64).reshape(-1)
    weights = np.asarray(weights, dtype=np.float64).reshape(-1)
    lengths = {
        "model_input": len(model_input),
        "target_tokens": len(target_tokens),
        "weights": len(weights),
    }
    if len(set(lengths.values())) != 1:
        raise ValueError(f"SFT datum fields must all have length {len(model_input)}, got {lengths}")
    if len(model_input) == 0:
        raise ValueError(f"sample {index} must contain at least two tokens")
    if not np.array_equal(model_input[1:], target_tokens[:-1]):
        raise ValueError(f"sample {index}: target_tokens must be model_input shifted by one token")
    tokens = np.concatenate([model_input, target_tokens[-1:]])
    return make_seq(tokens, index, weights=weights)


def translate_sft_batch(
    sequences: Any, attention_mask: Any, loss_mask: Any, *, max_seq_len: int
) -> list[Seq]:
    """Translates a collated SFT batch into cross-entropy `Seq`s (docs/sft.md#the-translation).

    For each row ``i``: strip the left padding by ``attention_mask`` (never by the pad id, so a
    real token equal to the pad id is kept); require ≥ 2 tokens; shift (``model_input =
    tokens[:-1]``, targets ``tokens[1:]``) and require ``len(model_input) <= max_seq_len``; read
    ``loss_mask[i]`` as finite non-negative floats; drop its left padding (the leading
    ``A - len(model_input)`` entries, which must be 0); right-align it:
    ``weights = [0]*(len(model_input) - len) + loss_mask[i]``, so ``weights[j]`` scores
    ``tokens[j+1]`` and the last ``A`` targets are the response. Rows whose weights are all 0
    (e.g. padding rows) are dropped. Weight values pass through unchanged.

    Args:
      sequences: int[B, L] left-padded token ids.
      attention_mask: [B, L], nonzero on real tokens: ``[0..0, 1..1]`` per row.
      loss_mask: float[B, A] right-aligned, batch-normalized per-token weights.
      max_seq_len: the trainer's model-input length limit.

    Returns:
      list of `Seq` (``tokens`` = the unpadded row, ``inputs = {"weights": float64[N-1]}``), one
      per row with a nonzero weight, in row order; ``[]`` for an empty batch (B = 0).

    Raises:
      ValueError: with the docs/sft.md#the-translation message fragments:
        ``requires rank-2 tensor field '<name>'``, ``field '<name>' has the wrong batch
        dimension``, ``attention_mask[i] must describe contiguous left padding``, ``sample i must
        contain at least two tokens``, ``has model-input length N, exceeding max_seq_len=M``,
        ``loss_mask[i] must contain finite non-negative weights``, ``loss_mask[i] supervises a
        token outside the sequence``, ``SFT batch has no supervised tokens``.
    """
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int | np.integer):
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    seqs = _matrix("sequences", sequences, None)
    batch_size = seqs.shape[0]
    attn = _matrix("attention_mask", attention_mask, batch_size)
    lmask = _matrix("loss_mask", loss_mask, batch_size)
    if seqs.size and not np.issubdtype(seqs.dtype, np.integer):
        raise ValueError(
            f"SFT batch field 'sequences' must hold integer token ids, got {seqs.dtype}"
        )
    if attn.shape != seqs.shape:
        raise ValueError(
            f"SFT batch field 'attention_mask' has shape {attn.shape}, expected {seqs.shape} "
            "(the shape of 'sequences')"
        )
    if batch_size == 0:
        return []
    present_BL = attn != 0
    weights_BA = lmask.astype(np.float64)
    out: list[Seq] = []
    for i in range(batch_size):
        present = present_BL[i]
        if np.any(present[:-1] & ~present[1:]):
            raise ValueError(f"attention_mask[{i}] must describe contiguous left padding")
        tokens = seqs[i][present]
        if len(tokens) < 2:
            if not np.any(weights_BA[i]):
                continue  # an all-padding (or one-token) row with nothing supervised: dropped
            raise ValueError(f"sample {i} must contain at least two tokens")
        model_input, target_tokens = tokens[:-1], tokens[1:]
        n = len(model_input)
        if n > max_seq_len:
            raise ValueError(
                f"sample {i} has model-input length {n}, exceeding max_seq_len={max_seq_len}"
            )
        action_weights = weights_BA[i]
        if not np.all(np.isfinite(action_weights)) or np.any(action_weights < 0):
            raise ValueError(f"loss_mask[{i}] must contain finite non-negative weights")
        if len(action_weights) > n:
            extra = len(action_weights) - n
            if np.any(action_weights[:extra] != 0):
                raise ValueError(f"loss_mask[{i}] supervises a token outside the sequence")
            action_weights = action_weights[extra:]
        weights = np.concatenate([np.zeros(n - len(action_weights)), action_weights])
        if not np.any(weights):
            continue
        out.append(sft_seq(model_input, target_tokens, weights, index=i))
    if not out:
        raise ValueError("SFT batch has no supervised tokens: every row's loss_mask is all zero")
    return out


def collate_sft(
    examples: Sequence[tuple[Any, ...]], pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collates demonstrations into the SFT batch contract (SkyRL ``DefaultCollator``, §2).

    Each example is ``(prompt_tokens, completion_tokens)`` — every completion token supervised —
    or ``(prompt_tokens, completion_tokens, completion_mask)`` with one non-negative weight per
    completion token (e.g. 1 on actions, 0 on environment observations). Rows are left-padded
    with ``pad_id``; the loss mask is left-padded with 0 to ``A = max completion length`` and
    divided by the batch's total supervision ``Σ mask`` (the supervised-token count for 0/1
    masks), so the weights sum to 1 (an all-zero batch stays zero).

    Args:
      examples: non-empty list of examples; each prompt has ≥ 1 token (the first token of a
        sequence is never a target) and each example ≥ 2 tokens in all.
      pad_id: the padding token id.

    Returns:
      ``(sequences int64[B, L], attention_mask int64[B, L], loss_mask float64[B, A])``.
    """
    if len(examples) == 0:
        raise ValueError("collate_sft: at least one example is required")
    rows, masks = [], []
    for i, ex in enumerate(examples):
        if not isinstance(ex, tuple | list) or len(ex) not in (2, 3):
            raise ValueError(
                f"collate_sft: example {i} must be (prompt, completion) or (prompt, completion, "
                "mask)"
            )
        prompt = np.asarray(ex[0], dtype=np.int64).reshape(-1)
        completion = np.asarray(ex[1], dtype=np.int64).reshape(-1)
        if len(prompt) < 1:
            raise ValueError(f"collate_sft: example {i} has an empty prompt (need ≥ 1 token)")
        if len(prompt) + len(completion) < 2:
            raise ValueError(
                f"collate_sft: example {i} must contain at least two tokens (prompt + completion)"
            )
        mask = np.ones(len(completion)) if len(ex) == 2 else np.asarray(ex[2], np.float64)
        if mask.shape != completion.shape:
            raise ValueError(
                f"collate_sft: example {i} has a mask of shape {mask.shape}, expected "
                f"{completion.shape} (one weight per completion token)"
            )
        if not np.all(np.isfinite(mask)) or np.any(mask < 0):
            raise ValueError(f"collate_sft: example {i} mask must be finite and non-negative")
        rows.append(np.concatenate([prompt, completion]))
        masks.append(mask)
    b = len(rows)
    length = max(len(r) for r in rows)
    width = max(len(m) for m in masks)
    sequences = np.full((b, length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((b, length), dtype=np.int64)
    loss_mask = np.zeros((b, width), dtype=np.float64)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        if len(row):
            sequences[i, length - len(row) :] = row
            attention_mask[i, length - len(row) :] = 1
        if len(mask):
            loss_mask[i, width - len(mask) :] = mask
    total = float(loss_mask.sum())
    if total > 0:
        loss_mask /= total
    return sequences, attention_mask, loss_mask
