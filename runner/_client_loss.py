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
    DEFAULT_LENGTH_BUCKETS,
    CheckedSeqs,
    RaggedArrays,
    aligned_zeros,
    batch_field_names,
    bucket,
    row_bucket,
    seqs_to_batch,
)
from runner._protocols import Trainer
from runner._types import Seq, validate_seqs

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


def _structure(lp_BT: Any, batch: Any) -> Any:
    """The input tree structure, which fixes a term's (value, metrics) structure."""
    return jax.tree.structure((lp_BT, batch))


def _pack_scalars(tree: Any) -> tuple[jax.Array, Any]:
    """(one float32/64 vector of ``tree``'s scalar leaves, its treedef): one transfer, not ~20."""
    leaves, treedef = jax.tree.flatten(tree)
    dtype = jax.numpy.result_type(*leaves, jax.numpy.float32)
    return jax.numpy.stack([jax.numpy.asarray(x, dtype).reshape(()) for x in leaves]), treedef


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
        require_logprob_term(term, "ClientLoss")
        self.term = term
        self.length_buckets = tuple(sorted(length_buckets))
        self.dtype = dtype
        self.compile_count = 0
        self._lock = threading.Lock()
        # One set of padded host buffers kept for the next call of the same bucket: fresh large
        # allocations page-fault on first write, which costs as much as the padding itself.
        self._spare: tuple[tuple, list[np.ndarray], list[np.ndarray]] | None = None
        self._spare_lock = threading.Lock()

        def traced(lp_BT, batch):
            self.compile_count += 1  # runs at trace time only: counts compilations
            return term(lp_BT, batch)

        value_and_grad = jax.value_and_grad(traced, has_aux=True)

        # The (value, metrics) treedef of each traced input structure (set at trace time; a term's
        # outputs depend on which batch fields are present, not on their shapes).
        self._treedefs: dict[Any, Any] = {}

        def value_and_weights(lp_BT, batch, tied):
            # The linear CE pass needs -dL/dlogprobs: negating inside the jit is free (fused).
            # The loss, the metrics and whether any entry is invalid (the value rules of
            # `losses.check_batch`, one fused pass) come back as one vector: one host transfer.
            batch = _tie(batch, tied)
            (value, metrics), grad = value_and_grad(lp_BT, batch)
            bad = losses.any_violation(batch, lp_BT)
            packed, treedef = _pack_scalars((value, dict(metrics), bad))
            self._treedefs[_structure(lp_BT, batch)] = treedef
            return packed, -grad

        options = _compiler_options(jax.default_backend())
        self._value_and_weights = jax.jit(
            value_and_weights, static_argnums=2, compiler_options=options
        )

        def value_only(lp_BT, batch, tied):
            # The builtin path's metrics: the term's value and metrics, no gradient.
            batch = _tie(batch, tied)
            value, metrics = term(lp_BT, batch)
            bad = losses.any_violation(batch, lp_BT)
            packed, treedef = _pack_scalars((value, dict(metrics), bad))
            self._treedefs[("value", _structure(lp_BT, batch))] = treedef
            return packed

        self._value_only = jax.jit(value_only, static_argnums=2, compiler_options=options)

    def shapes(self, seqs: Sequence[Seq]) -> tuple[int, int]:
        """The ``(rows, length)`` bucket the sequences pad to (`runner._padding` rules)."""
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
          The term's loss, its metrics as floats, and the per-sequence gradients (fresh float64
          numpy arrays). `value_and_weights` returns their negation without the copies.
        """
        value, metrics, weights = self.value_and_weights(logprobs, seqs, norms)
        return value, metrics, [np.negative(w, dtype=np.float64) for w in weights]

    def value_and_weights(
        self,
        logprobs: Sequence[np.ndarray],
        seqs: Sequence[Seq],
        norms: Mapping[str, float] | None = None,
    ) -> tuple[float, dict[str, float], RaggedArrays]:
        """``(loss, metrics, [-dL/dlogprobs per sequence])``: the linear CE pass's ``weights``.

        Like `value_and_grads`, but each sequence's ``weights = -dL/dlogprobs`` comes back in the
        adapter's dtype as a read-only view of one padded output buffer (a `RaggedArrays`: no
        per-sequence copy; the buffer lives as long as any view of it). This is what the fused
        client pass sends.

        The values are checked by the rules of `losses.check_batch` inside the same jitted call
        (`losses.any_violation`, fused with the loss): 0/1 and disjoint masks, logprobs
        finite and ``≤ 0`` where read, finite advantages and weights, nothing that overflows
        the adapter's dtype. The sequences' shapes are assumed valid (`runner.validate_seqs`;
        `__call__` checks them).

        With ``norms=None`` the term counts the batch's normalizers itself, inside the jitted
        function (the same definition as `runner.normalizers`); a call with ``norms`` compiles
        separately from one without (one compilation per bucket for each).

        Raises:
          ValueError: a value breaks a rule (naming sequence, target and rule); nothing is
            returned for such a batch.
        """
        (packed, weights), lp_BT, batch, lengths = self._run(
            self._value_and_weights, logprobs, seqs, norms
        )
        weights = np.asarray(weights)  # the host buffer itself on CPU (read-only)
        value, metrics = self._unpack(
            self._treedefs[_structure(lp_BT, batch)], packed, seqs, logprobs, norms
        )
        return value, metrics, RaggedArrays(weights, lengths)

    def value_and_metrics(
        self,
        logprobs: Sequence[np.ndarray],
        seqs: Sequence[Seq],
        norms: Mapping[str, float] | None = None,
    ) -> tuple[float, dict[str, float]]:
        """``(loss, metrics)`` of the term, without its gradient (the builtin path's metrics).

        The same value checks as `value_and_weights`, in its own jitted function (no gradient
        is computed or transferred).
        """
        packed, lp_BT, batch, _ = self._run(self._value_only, logprobs, seqs, norms)
        treedef = self._treedefs[("value", _structure(lp_BT, batch))]
        return self._unpack(treedef, packed, seqs, logprobs, norms)

    def check(
        self,
        seqs: Sequence[Seq],
        norms: Mapping[str, float] | None = None,
        logprobs: Sequence[np.ndarray] | None = None,
    ) -> None:
        """The host form of the value rules on ``seqs`` (`losses.check_batch` in float64 with
        overflow of the adapter's dtype); raises ``ValueError`` naming sequence and target."""
        rows, length = self.shapes(seqs)
        kw = {} if logprobs is None else {"logprobs": [np.asarray(lp) for lp in logprobs]}
        padded = seqs_to_batch(seqs, length=length, rows=rows, norms=norms, dtype=np.float64, **kw)
        lp_BT, batch = padded if logprobs is not None else (None, padded)
        try:
            losses.check_batch(
                batch, logprobs=lp_BT, dtype=self.dtype, index_names=("sequence", "target")
            )
        except ValueError as exc:
            raise ValueError(f"client loss input: {exc}") from None

    def _run(self, fn, logprobs, seqs, norms):
        """Pads ``logprobs`` and the fields into reused aligned buffers and runs ``fn``."""
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
        # A trainer's padded forward in this very bucket and dtype is the input as it is.
        given = logprobs.padded if isinstance(logprobs, RaggedArrays) else None
        reuse_lp = (
            given is not None
            and given.shape == (rows, length)
            and given.dtype == np.dtype(self.dtype)
        )
        names = (*(() if reuse_lp else ("logprobs",)), *batch_field_names(seqs))
        key = (rows, length, names)
        # Aligned host buffers are used by XLA:CPU in place (no copy). They are refilled only
        # after the computation that read them has finished (its outputs are on the host), and
        # only their previously filled entries are re-zeroed (``dirty``: per-row filled length).
        bufs, dirty = self._take_buffers(key, len(names))
        padded = seqs_to_batch(
            seqs,
            length=length,
            rows=rows,
            norms=norms,
            dtype=self.dtype,
            out=dict(zip(names, bufs, strict=True)),
            dirty=dict(zip(names, dirty, strict=True)),
            count_in_term=True,  # norms=None: the term counts them, fused into the jit
            logprobs=None if reuse_lp else arrays,
        )
        lp_BT, batch = (given, padded) if reuse_lp else padded
        # Without its own old_logprobs a sequence's anchor is its sampling_logprobs: one buffer,
        # read once inside the jit (not as two arguments that XLA reads separately).
        tied = batch.sampling_logprobs is not None and batch.old_logprobs is batch.sampling_logprobs
        with self._lock:
            out = fn(lp_BT, batch, tied)
        jax.block_until_ready(out)
        self._give_back(key, bufs, dirty)
        return out, lp_BT, batch, lengths

    def _unpack(self, treedef, packed, seqs, logprobs, norms):
        value, metrics, bad = jax.tree.unflatten(treedef, np.asarray(packed).tolist())
        if bad or norms is not None and not _valid_norms(norms):
            self.check(seqs, norms, logprobs)  # raises, naming the entry
            raise ValueError(  # pragma: no cover - the two forms of the rules disagree
                f"client loss input: {int(bad)} entries break the value rules"
            )
        return value, metrics

    def _take_buffers(self, key: tuple, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0] == key:
            return spare[1], spare[2]
        rows, length = key[0], key[1]
        bufs = [aligned_zeros((rows, length), self.dtype) for _ in range(count)]
        return bufs, [np.zeros(rows, np.int64) for _ in range(count)]

    def _give_back(self, key: tuple, bufs: list[np.ndarray], dirty: list[np.ndarray]) -> None:
        with self._spare_lock:
            self._spare = (key, bufs, dirty)

    def __call__(
        self,
        trainer: Trainer,
        seqs: Sequence[Seq],
        *,
        forward: Sequence[np.ndarray] | None = None,
        norms: Mapping[str, float] | None = None,
        counter: PassCounter | None = None,
        checked: bool = False,
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
          checked: the caller (`StepRunner`) already ran `runner.validate_seqs` on ``seqs``.

        Returns:
          ``(loss, metrics)`` of the term (never the surrogate's ``loss:sum``).

        Raises:
          ValueError: malformed sequences or values (before any gradient reaches the trainer).
        """
        if not checked:
            validate_seqs(seqs, required=("action_mask",))
        seqs = seqs if isinstance(seqs, CheckedSeqs) else CheckedSeqs(seqs)
        counter = counter if counter is not None else PassCounter()
        if forward is None:
            forward = trainer.forward(CheckedSeqs([s.with_inputs() for s in seqs], seqs.padded))
            counter.forward()
        elif len(forward) != len(seqs):
            raise ValueError(
                f"precomputed forward has {len(forward)} entries for {len(seqs)} sequences"
            )
        value, metrics, weights = self.value_and_weights(forward, seqs, norms)
        seqs.padded["weights"] = weights.padded
        linear = CheckedSeqs(
            [s.with_inputs(weights=w) for s, w in zip(seqs, weights, strict=True)], seqs.padded
        )
        result = trainer.forward_backward(linear, "cross_entropy")
        counter.forward_backward()
        metrics["surrogate_loss"] = float(result.metrics.get("loss:sum", float("nan")))
        return value, metrics


def require_logprob_term(term: Any, where: str) -> None:
    """Raises ``ValueError`` unless ``term`` takes per-token logprobs (``Term.argument``): what
    every trainer returns, so the only terms the runner can train."""
    argument = getattr(term, "argument", "logprobs")
    if argument != "logprobs":
        raise ValueError(
            f"{where}: {term!r} takes {argument} as its first argument; a trainer returns "
            "per-token logprobs [B, T], so the runner trains only terms over logprobs (call "
            "`losses` directly for top-K distillation or a critic)"
        )


def _tie(batch: losses.Batch, tied: bool) -> losses.Batch:
    """``batch`` with ``old_logprobs`` the very array ``sampling_logprobs`` when ``tied``."""
    return batch.replace(old_logprobs=batch.sampling_logprobs) if tied else batch


def _valid_norms(norms: Mapping[str, float]) -> bool:
    return all(np.isfinite(float(v)) and float(v) >= 0 for v in norms.values())
