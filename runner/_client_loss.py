"""The client-loss adapter: any `losses` term on any `Trainer`, without torch.

This re-implements the SDK's ``forward_backward_custom`` (reference/fireworks-sdk.md §3.1, §3.4)
with JAX:

1. one ``forward`` for the current per-token logprobs (skipped when the caller passes a forward
   it already ran at the current weights — the SDK's ``precomputed_forward``);
2. pad to a ``(rows, length)`` bucket and run a jitted ``value_and_grad`` of the term (one
   compilation per bucket);
3. un-pad, and send ``weights = -dL/dlogprobs`` through the trainer's linear ``cross_entropy``
   ``forward_backward``: the server computes ``Σ -p·w``, whose gradient is exactly ``dL/dθ``.

The adapter reports the term's loss and metrics, never the surrogate's ``loss:sum``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

import losses
from runner._padding import (
    BATCH_FIELDS,
    DEFAULT_LENGTH_BUCKETS,
    PARALLEL_MIN_ENTRIES,
    _pool,
    aligned_zeros,
    bucket,
    pad_ragged,
    row_bucket,
    seqs_to_batch,
    unpad,
)
from runner._types import Seq, Trainer, validate_seqs

#: XLA:CPU options for the jitted loss. A loss term is a few elementwise maps plus a dozen
#: scalar reductions (the loss and its metrics). By default XLA:CPU hands each reduction to a
#: YNNPACK kernel and rewrites large reductions into a tree of ``reduce-window``s; neither fuses
#: with the elementwise producer, so every reduced ``[B, T]`` intermediate is written to memory
#: and read back. With both off, the producers fuse into the reductions: about 2-3x less time on
#: a [256, 4096] GRPO+KL+ECHO batch (benchmarks/loss_speed.py). The gradient is elementwise and
#: unchanged; float32 scalar sums are accumulated in vectorized order rather than as a tree
#: (~1e-7 relative on this batch). Applied only on the CPU backend, only if this XLA accepts
#: them, and not when ``XLA_FLAGS`` already sets ``xla_disable_hlo_passes``.
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "",
    "xla_disable_hlo_passes": "tree_reduction_rewriter",
}


@functools.cache
def _compiler_options(backend: str) -> dict[str, str] | None:
    """`CPU_COMPILER_OPTIONS` when they apply to ``backend`` and this XLA accepts them."""
    if backend != "cpu" or "xla_disable_hlo_passes" in os.environ.get("XLA_FLAGS", ""):
        return None
    try:
        probe = jax.jit(lambda x: x.sum(), compiler_options=CPU_COMPILER_OPTIONS)
        probe.lower(np.zeros((2, 2), np.float32)).compile()
    except Exception:  # an XLA without these options: compile with its defaults
        return None
    return dict(CPU_COMPILER_OPTIONS)


@dataclasses.dataclass
class PassCounter:
    """Trainer passes issued by the runner: ``forward()`` = 1F; ``forward_backward()`` = 1F + 1B."""

    forwards: int = 0
    backwards: int = 0

    def forward(self) -> None:
        self.forwards += 1

    def forward_backward(self) -> None:
        self.forwards += 1
        self.backwards += 1

    def as_metrics(self) -> dict[str, float]:
        return {"passes/forwards": float(self.forwards), "passes/backwards": float(self.backwards)}


def _to_float(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(dict(metrics)).items()}


class ClientLoss:
    """Evaluates a `losses` term on ragged trainer logprobs and returns per-sequence gradients.

    Args:
      term: any ``(logprobs[B, T], batch) -> (loss, metrics)`` term (e.g. a `losses.fold`).
      length_buckets: padded lengths (T); each distinct bucket compiles once.
      dtype: the float dtype of the padded batch (``np.float64`` needs jax x64 enabled).

    Attributes:
      compile_count: how many times the jitted loss was traced (one per new bucket shape).
    """

    def __init__(
        self,
        term: Any,
        *,
        length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
        dtype: Any = np.float32,
    ) -> None:
        if not callable(term):
            raise ValueError(f"ClientLoss: term must be callable, got {term!r}")
        self.term = term
        self.length_buckets = tuple(sorted(length_buckets))
        self.dtype = dtype
        self.compile_count = 0
        self._lock = threading.Lock()
        # One set of padded host buffers kept for the next call of the same bucket: fresh large
        # allocations page-fault on first write, which costs as much as the padding itself.
        self._spare: tuple[tuple, list[np.ndarray]] | None = None
        self._spare_lock = threading.Lock()

        def traced(lp_BT, batch):
            self.compile_count += 1  # runs at trace time only: counts compilations
            return term(lp_BT, batch)

        self._value_and_grad = jax.jit(
            jax.value_and_grad(traced, has_aux=True),
            compiler_options=_compiler_options(jax.default_backend()),
        )

    def shapes(self, seqs: Sequence[Seq]) -> tuple[int, int]:
        """The ``(rows, length)`` bucket the sequences pad to."""
        longest = max(s.num_targets for s in seqs)
        return row_bucket(len(seqs)), bucket(longest, self.length_buckets)

    def batch(self, seqs: Sequence[Seq], norms: Mapping[str, float] | None = None) -> losses.Batch:
        """The padded `losses.Batch` of ``seqs`` (normalizers default to the seqs' own)."""
        rows, length = self.shapes(seqs)
        # norms=None: the batch's own, computed from the padded masks (same as `normalizers`).
        return seqs_to_batch(seqs, length=length, rows=rows, norms=norms, dtype=self.dtype)

    def value_and_grads(
        self,
        logprobs: Sequence[np.ndarray],
        seqs: Sequence[Seq],
        norms: Mapping[str, float] | None = None,
    ) -> tuple[float, dict[str, float], list[np.ndarray]]:
        """``(loss, metrics, [dL/dlogprobs per sequence])`` from ragged logprobs (client side only).

        Args:
          logprobs: per-sequence trainer logprobs, ``len(seqs[i].tokens) - 1`` each.
          seqs: the sequences with the term's per-token inputs (``action_mask``, ...).
          norms: the optimizer batch's normalizers (`runner._padding.normalizers`) when ``seqs``
            is one micro-batch of a larger step; default = this batch's own.

        Returns:
          The term's loss, its metrics as floats, and the per-sequence gradients (float64 numpy).
        """
        if len(logprobs) != len(seqs):
            raise ValueError(f"got {len(logprobs)} logprob arrays for {len(seqs)} sequences")
        lengths, arrays = [], []
        for i, (lp, s) in enumerate(zip(logprobs, seqs, strict=True)):
            lp = np.asarray(lp)
            if lp.shape != (s.num_targets,):
                raise ValueError(
                    f"sequence {i}: logprobs have shape {lp.shape}, expected ({s.num_targets},)"
                )
            lengths.append(s.num_targets)
            arrays.append(lp)
        rows, length = self.shapes(seqs)
        names = tuple(n for n in BATCH_FIELDS if n in seqs[0].inputs)
        key = (rows, length, names)
        # Aligned host buffers are used by XLA:CPU in place (no copy). They are refilled only
        # after the computation that read them has finished (its outputs are on the host).
        bufs = self._take_buffers(key, len(names) + 1)
        # Large batches pad the logprobs on the shared pool while the main thread pads the
        # batch fields (also on the pool).
        pool = _pool() if rows * length >= PARALLEL_MIN_ENTRIES else None
        pad_lp = (arrays, length, rows, self.dtype, bufs[0])
        lp_job = pool.submit(pad_ragged, *pad_lp) if pool else None
        batch = seqs_to_batch(
            seqs,
            length=length,
            rows=rows,
            norms=norms,  # None: this batch's own, from the padded masks (= `normalizers`)
            dtype=self.dtype,
            out=dict(zip(names, bufs[1:], strict=True)),
        )
        lp_BT = lp_job.result() if lp_job else pad_ragged(*pad_lp)
        with self._lock:
            (value, metrics), grad = self._value_and_grad(lp_BT, batch)
        grads = unpad(np.asarray(grad), lengths, dtype=np.float64)
        value, metrics = float(value), _to_float(metrics)
        del lp_BT, batch
        self._give_back(key, bufs)
        return value, metrics, grads

    def _take_buffers(self, key: tuple, count: int) -> list[np.ndarray]:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0] == key:
            return spare[1]
        rows, length = key[0], key[1]
        return [aligned_zeros((rows, length), self.dtype) for _ in range(count)]

    def _give_back(self, key: tuple, bufs: list[np.ndarray]) -> None:
        with self._spare_lock:
            self._spare = (key, bufs)

    def __call__(
        self,
        trainer: Trainer,
        seqs: Sequence[Seq],
        *,
        forward: Sequence[np.ndarray] | None = None,
        norms: Mapping[str, float] | None = None,
        counter: PassCounter | None = None,
    ) -> tuple[float, dict[str, float]]:
        """One fused client pass: forward (unless given) → JAX gradient → linear CE backward.

        Args:
          trainer: any `Trainer`.
          seqs: sequences carrying the term's per-token inputs.
          forward: per-sequence logprobs already computed at the *current* weights for exactly
            these sequences in this order (no ``optim_step``/``load_state`` since); skips the
            forward pass.
          norms: normalizers of the whole optimizer batch (for micro-batches).
          counter: a `PassCounter` to record the trainer passes.

        Returns:
          ``(loss, metrics)`` of the term (never the surrogate's ``loss:sum``).
        """
        validate_seqs(seqs, required=("action_mask",))
        counter = counter if counter is not None else PassCounter()
        if forward is None:
            forward = trainer.forward([s.with_inputs() for s in seqs])
            counter.forward()
        elif len(forward) != len(seqs):
            raise ValueError(
                f"precomputed forward has {len(forward)} entries for {len(seqs)} sequences"
            )
        value, metrics, grads = self.value_and_grads(forward, seqs, norms)
        linear = [s.with_inputs(weights=-g) for s, g in zip(seqs, grads, strict=True)]
        result = trainer.forward_backward(linear, "cross_entropy")
        counter.forward_backward()
        metrics["surrogate_loss"] = float(result.metrics.get("loss:sum", float("nan")))
        return value, metrics
