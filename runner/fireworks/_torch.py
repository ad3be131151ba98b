"""Optional torch bridge: a `losses` term as a closure for the SDK's ``forward_backward_custom``.

The SDK's custom-loss algorithm (docs/training-api.md#custom-losses) hands the closure torch
logprob tensors (``requires_grad``), calls ``loss.backward()`` and sends ``weights = -grad``
through a linear ``cross_entropy`` pass. `torch_loss_fn` computes the term's value and
``dL/dlogprobs`` in JAX (`runner.ClientLoss`) and returns the linear surrogate

    loss = value + Σ_i Σ_t g_it·lp_it − (Σ_i Σ_t g_it·lp_it).detach()

whose value is the JAX loss and whose gradient with respect to each ``lp_i`` is exactly the JAX
gradient ``g_i``. torch is imported only when the closure runs (extra ``foldloss[torch]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from runner._client_loss import ClientLoss
from runner._types import Seq, validate_seqs


def torch_loss_fn(
    term: Any,
    batch: Sequence[Seq],
    *,
    norms: Mapping[str, float] | None = None,
    client_loss: ClientLoss | None = None,
    dtype: Any = np.float32,
) -> Callable[[Sequence[Any], Sequence[Any]], tuple[Any, dict[str, float]]]:
    """The ``(data, logprobs_list) -> (loss, metrics)`` closure of ``term`` for
    ``FiretitanTrainingClient.forward_backward_custom``.

    Args:
      term: any `losses` term or fold.
      batch: the sequences, in the order of the datums passed to ``forward_backward_custom``,
        carrying the term's per-token inputs (``action_mask``, ``advantages``,
        ``sampling_logprobs``, ...). The datums themselves carry only ``target_tokens`` (the SDK
        rejects other keys on that path); build them with
        ``runner.fireworks.to_datums([s.with_inputs() for s in batch])``.
      norms: the optimizer batch's normalizers when ``batch`` is one micro-batch of it.
      client_loss: a `runner.ClientLoss` of ``term`` to reuse (its jit cache).
      dtype: float dtype of the JAX evaluation (``np.float64`` needs ``jax_enable_x64``).

    Returns:
      The closure. Its loss is a 0-d torch tensor (the logprobs' dtype) whose value is the JAX
      loss; its metrics are the term's metrics as floats.

    Raises:
      ValueError (when called): a datum count or ``target_tokens`` that does not match ``batch``.
    """
    seqs = list(batch)
    validate_seqs(seqs, required=("action_mask",))
    loss = client_loss if client_loss is not None else ClientLoss(term, dtype=dtype)

    def closure(data: Sequence[Any], logprobs_list: Sequence[Any]) -> tuple[Any, dict[str, float]]:
        import torch

        if len(data) != len(seqs) or len(logprobs_list) != len(seqs):
            raise ValueError(
                f"torch_loss_fn: got {len(data)} datums and {len(logprobs_list)} logprob tensors "
                f"for a batch of {len(seqs)} sequences"
            )
        for i, (datum, seq) in enumerate(zip(data, seqs, strict=True)):
            targets = datum.loss_fn_inputs.get("target_tokens")
            if targets is None or not np.array_equal(
                np.asarray(targets.to_numpy()).reshape(-1), seq.tokens[1:]
            ):
                raise ValueError(
                    f"torch_loss_fn: datum {i} target_tokens do not match sequence {i} of the batch"
                )
        lps = [lp.detach().cpu().reshape(-1).numpy() for lp in logprobs_list]
        value, metrics, grads = loss.value_and_grads(lps, seqs, norms)
        linear = None
        for lp, g in zip(logprobs_list, grads, strict=True):
            part = (lp.reshape(-1) * torch.tensor(g, dtype=lp.dtype, device=lp.device)).sum()
            linear = part if linear is None else linear + part
        ref = logprobs_list[0]
        total = linear - linear.detach() + torch.tensor(value, dtype=ref.dtype, device=ref.device)
        return total, metrics

    return closure
