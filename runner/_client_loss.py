"""The client-loss adapter: any `losses` term on any `Trainer`, without torch.

This re-implements the SDK's ``forward_backward_custom`` (docs/training-api.md#custom-losses)
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
    pad_fields,
    row_bucket,
    row_views,
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
#: Buckets of at most this many entries (rows × length) also skip XLA:CPU's parallel task
#: assignment (`SMALL_BUCKET_PASSES`): splitting the few elementwise ``[B, T]`` fusions over the
#: thread pool costs more in dispatch than it saves there (jitted call -13% at ``[64, 1024]``,
#: -4-5% at ``[64, 4096]`` / ``[256, 1024]`` on the 2-core benchmark machine; at ``[256, 4096]``
#: runs disagreed, so larger buckets keep the split). Only the scheduling changes: results are
#: bit-identical, and each bucket still compiles once (in one of the two jits).
SMALL_BUCKET = 1 << 18
SMALL_BUCKET_PASSES = "cpu-parallel-task-assigner"


@functools.cache
def _compiler_options(backend: str, small: bool = False) -> dict[str, str] | None:
    """`CPU_COMPILER_OPTIONS` when they apply to ``backend`` and this XLA accepts them (with
    ``small``: also without parallel task assignment, for buckets up to `SMALL_BUCKET`)."""
    if backend != "cpu" or "xla_disable_hlo_passes" in os.environ.get("XLA_FLAGS", ""):
        return None
    options = dict(CPU_COMPILER_OPTIONS)
    if small:
        options["xla_disable_hlo_passes"] += "," + SMALL_BUCKET_PASSES
    try:
        probe = jax.jit(lambda x: x.sum(), compiler_options=options)
        probe.lower(np.zeros((2, 2), np.float32)).compile()
    except Exception:  # an XLA without these options: compile with its defaults
        return None if not small else _compiler_options(backend)
    return options


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
        self._spare: tuple[tuple, _Buffers] | None = None
        self._spare_lock = threading.Lock()

        def traced(lp_BT, batch):
            self.compile_count += 1  # runs at trace time only: counts compilations
            return term(lp_BT, batch)

        value_and_grad = jax.value_and_grad(traced, has_aux=True)

        # The (value, metrics) treedef of each (kind, spec) (set at trace time; a term's outputs
        # depend on which batch fields are present, not on their shapes).
        self._treedefs: dict[Any, Any] = {}

        # The jitted functions take the padded fields as a flat tuple and build the `losses.Batch`
        # inside the trace (``spec`` = the field and normalizer names, static): no host `Batch`
        # per call, and the arguments flatten in C++.
        def value_and_weights(lp_BT, arrays, norm_values, spec):
            # The linear CE pass needs -dL/dlogprobs: negating inside the jit is free (fused).
            # The loss, the metrics and whether any entry is invalid (the value rules of
            # `losses.check_batch`, one fused pass) come back as one vector: one host transfer.
            batch = _make_batch(spec, arrays, norm_values)
            (value, metrics), grad = value_and_grad(lp_BT, batch)
            bad = losses.any_violation(batch, lp_BT)
            packed, treedef = _pack_scalars((value, dict(metrics), bad))
            self._treedefs[("grad", spec)] = treedef
            return packed, -grad

        def value_only(lp_BT, arrays, norm_values, spec):
            # The builtin path's metrics: the term's value and metrics, no gradient.
            batch = _make_batch(spec, arrays, norm_values)
            value, metrics = term(lp_BT, batch)
            bad = losses.any_violation(batch, lp_BT)
            packed, treedef = _pack_scalars((value, dict(metrics), bad))
            self._treedefs[("value", spec)] = treedef
            return packed

        # Per kind: (the jit for larger buckets, the jit for buckets up to `SMALL_BUCKET`).
        backend = jax.default_backend()
        large, small = _compiler_options(backend), _compiler_options(backend, small=True)
        self._jits: dict[str, tuple[Any, Any]] = {}
        for kind, fn in (("grad", value_and_weights), ("value", value_only)):
            big = jax.jit(fn, static_argnums=3, compiler_options=large)
            little = (
                big if small == large else jax.jit(fn, static_argnums=3, compiler_options=small)
            )
            self._jits[kind] = (big, little)

    def shapes(self, seqs: Sequence[Seq]) -> tuple[int, int]:
        """The ``(rows, length)`` bucket the sequences pad to (`runner._padding` rules)."""
        length = bucket(max(s.num_targets for s in seqs), self.length_buckets)
        return row_bucket(len(seqs), length=length), length

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
        (packed, weights), spec, lengths = self._run("grad", logprobs, seqs, norms)
        weights = np.asarray(weights)  # the host buffer itself on CPU (read-only)
        value, metrics = self._unpack(self._treedefs[("grad", spec)], packed, seqs, logprobs, norms)
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
        packed, spec, _ = self._run("value", logprobs, seqs, norms)
        return self._unpack(self._treedefs[("value", spec)], packed, seqs, logprobs, norms)

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

    def _run(self, kind, logprobs, seqs, norms):
        """Pads ``logprobs`` and the fields into reused aligned buffers and runs the ``kind`` jit.

        Returns ``(outputs, spec, lengths)``.
        """
        if len(logprobs) != len(seqs):
            raise ValueError(f"got {len(logprobs)} logprob arrays for {len(seqs)} sequences")
        arrays = [lp if type(lp) is np.ndarray else np.asarray(lp) for lp in logprobs]
        lengths = [len(s.tokens) - 1 for s in seqs]  # `Seq.num_targets`
        if [a.shape for a in arrays] != [(n,) for n in lengths]:
            for i, (a, n) in enumerate(zip(arrays, lengths, strict=True)):
                if a.shape != (n,):
                    raise ValueError(
                        f"sequence {i}: logprobs have shape {a.shape}, expected ({n},)"
                    )
        length = bucket(max(lengths), self.length_buckets)
        rows = row_bucket(len(lengths), length=length)
        # A trainer's padded forward in this very bucket and dtype is the input as it is.
        given = logprobs.padded if isinstance(logprobs, RaggedArrays) else None
        reuse_lp = (
            given is not None
            and given.shape == (rows, length)
            and given.dtype == np.dtype(self.dtype)
        )
        names = batch_field_names(seqs)
        columns = [[s.inputs[name] for s in seqs] for name in names]
        for name, col in zip(names, columns, strict=True):
            # Every field is padded to the sequences' row lengths (one ``dirty`` for the set).
            try:
                ok = list(map(len, col)) == lengths
            except TypeError:  # a 0-d array
                ok = False
            if not ok:
                _raise_field_shape(name, col, lengths)
        if not reuse_lp:
            columns.insert(0, arrays)
        key = (rows, length, names if reuse_lp else ("logprobs", *names))
        # Aligned host buffers are used by XLA:CPU in place (no copy). They are refilled only
        # after the computation that read them has finished (its outputs are on the host), and
        # only their previously filled entries are re-zeroed (``dirty``: per-row filled length,
        # one array for the whole set, since every field of a row has the same length).
        buffers = self._take_buffers(key, len(columns))
        pad_fields(
            columns,
            length,
            rows,
            self.dtype,
            out=buffers.host,
            dirty=[buffers.dirty] * len(columns),
            lengths=np.array(lengths, np.int64),
            views=buffers.views,
        )
        inputs = buffers.inputs
        lp_BT, fields = (given, tuple(inputs)) if reuse_lp else (inputs[0], tuple(inputs[1:]))
        # Carried normalizers travel as one vector (one argument), in name order (so that
        # the same names always trace the same function).
        norm_names: tuple[str, ...] = ()
        norm_values = None
        if norms:
            norm_names = tuple(sorted(norms))
            values = [np.asarray(norms[k], dtype=self.dtype) for k in norm_names]
            norm_values = np.stack(values) if all(v.ndim == 0 for v in values) else tuple(values)
        spec = (names, norm_names)
        fn = self._jits[kind][rows * length <= SMALL_BUCKET]
        with self._lock:
            out = fn(lp_BT, fields, norm_values, spec)
        jax.block_until_ready(out)
        self._give_back(key, buffers)
        return out, spec, lengths

    def _unpack(self, treedef, packed, seqs, logprobs, norms):
        value, metrics, bad = jax.tree.unflatten(treedef, np.asarray(packed).tolist())
        if bad or norms is not None and not _valid_norms(norms):
            self.check(seqs, norms, logprobs)  # raises, naming the entry
            raise ValueError(  # pragma: no cover - the two forms of the rules disagree
                f"client loss input: {int(bad)} entries break the value rules"
            )
        return value, metrics

    def _take_buffers(self, key: tuple, count: int) -> _Buffers:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0] == key:
            return spare[1]
        rows, length = key[0], key[1]
        return _Buffers.make(count, (rows, length), self.dtype)

    def _give_back(self, key: tuple, buffers: _Buffers) -> None:
        with self._spare_lock:
            self._spare = (key, buffers)

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


def _make_batch(spec: tuple, arrays: tuple, norm_values: Any) -> losses.Batch:
    """The `losses.Batch` of the padded ``arrays`` (named by ``spec``) and the normalizers.

    Without its own ``old_logprobs`` a sequence's anchor is its ``sampling_logprobs`` (the
    `losses.Batch` default): one buffer, read once inside the jit.
    """
    names, norm_names = spec
    fields = dict(zip(names, arrays, strict=True))
    if norm_names:
        values = norm_values if isinstance(norm_values, tuple) else list(norm_values)
        fields.update(zip(norm_names, values, strict=True))
    return losses.Batch(**fields)


def _raise_field_shape(name: str, column: Sequence[np.ndarray], lengths: Sequence[int]) -> None:
    """The `runner.validate_seqs` error for the first row of ``column`` of the wrong shape."""
    for i, (a, n) in enumerate(zip(column, lengths, strict=True)):
        if np.shape(a) != (n,):
            raise ValueError(
                f"sequence {i}: field '{name}' has shape {np.shape(a)}, expected ({n},) "
                f"(one entry per target token: len(tokens) - 1)"
            )


@dataclasses.dataclass
class _Buffers:
    """One set of padded host buffers of a bucket, reused from call to call.

    ``host``: the 64-byte aligned numpy buffers (filled in place); ``views``: their row views
    (`runner._padding.row_views`, made once); ``dirty``: int64 ``[rows]``, how many leading
    entries of each row may be non-zero (in every buffer); ``inputs``: what the jitted call
    takes, the JAX arrays that alias ``host`` when XLA aliases them (made once: converting each
    numpy argument costs ~5-10 us per call), else ``host`` itself.
    """

    host: list[np.ndarray]
    views: list[np.ndarray]
    dirty: np.ndarray
    inputs: list[Any]

    @classmethod
    def make(cls, count: int, shape: tuple[int, int], dtype: Any) -> _Buffers:
        host = [aligned_zeros(shape, dtype) for _ in range(count)]
        inputs: list[Any] = host
        if jax.default_backend() == "cpu":
            arrays = [jax.device_put(h) for h in host]
            # Only a true alias sees the refills; otherwise keep handing over the numpy buffers.
            if all(_aliases(a, h) for a, h in zip(arrays, host, strict=True)):
                inputs = arrays
        return cls(host, row_views(host), np.zeros(shape[0], np.int64), inputs)


def _aliases(array: Any, host: np.ndarray) -> bool:
    try:
        return array.unsafe_buffer_pointer() == host.ctypes.data
    except Exception:  # pragma: no cover - a runtime without buffer pointers
        return False


def _valid_norms(norms: Mapping[str, float]) -> bool:
    return all(np.isfinite(float(v)) and float(v) >= 0 for v in norms.values())
