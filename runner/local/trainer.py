"""`LocalTrainer`: the embedded default `runner.Trainer` (a small JAX transformer + optax AdamW).

Semantics follow the Fireworks training client (docs/training-api.md#builtin-kernels (and #the-optimizer-step),
docs/sft.md#normalisation-and-the-optimizer-step): built-in kernels are raw token sums over every target of every
sequence; the parameter gradient accumulates (sums) across ``forward_backward`` calls until
``optim_step``, which normalizes (optionally), clips the global norm, takes one AdamW step and
resets the accumulator.

Shapes are bucketed so that jit compiles once per bucket, not per call: the target length is
padded to a power of two ≥ 16 (capped at ``max_seq_len``) and the row count to a power-of-two
multiple of the device count (≥ `LocalTrainer.MIN_ROWS` for short rows, fewer for long ones:
`runner._padding.row_bucket`). Padded rows and positions are masked
out exactly (their logprobs are 0, their kernel weights 0).

One ``forward_backward`` is, in general, three jitted calls: the model forward returning
``(logprobs, pullback)`` (the `jax.vjp` pullback is a pytree of residuals), the kernel's
``value_and_grad`` on the logprobs (tiny; one compile per kernel config), and the pullback of
``dL/dlogprobs`` summed into the accumulator. That is 1 forward + 1 backward, exactly the chain
rule of ``jax.grad(term ∘ token_logprobs)``, and the model compiles once per bucket for all
kernels.

A kernel linear in the logprobs (``cross_entropy``: ``dL/dlogprobs = -weights`` is known from the
batch alone, `runner.local.kernels.linear_gradient`) on a decoder (``arch.fused_linear_loss``)
is one jitted call instead, `_linear_forward_backward_jit`: ``value_and_grad`` of ``Σ g·logprobs``
through the fused head (`runner.local.models.DecoderArch.linear_loss`), which forms each chunk's
logits once and never recomputes them (3 head products instead of 5), then the kernel's loss and
metrics on the logprobs and the accumulation. It compiles once per bucket for that kernel (in
addition to the generic model compile, when other kernels run too); the values and the gradient
are the generic path's up to floating-point summation order. The GPT-2 default has no fused head
and always takes the generic path.

Data parallelism: a 1-D `jax.sharding.Mesh` over ``jax.devices()`` (axis ``"data"``); padded
batch rows are sharded over it, parameters, optimizer state and the gradient accumulator are
replicated, and XLA inserts the cross-device gradient sum. One or several devices give the same
logprobs and gradients up to floating-point reduction order.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import losses
from runner import _padding
from runner._padding import CheckedSeqs, RaggedArrays, pad_ragged
from runner._types import (
    NORMALIZATIONS,
    AdamParams,
    ForwardBackwardResult,
    NonFiniteUpdateError,
    Sample,
    Seq,
    validate_seqs,
)
from runner.local import checkpoint, kernels, model, sampling
from runner.local import models as decoders
from runner.local.model import LocalTrainerConfig, Params
from runner.local.models import DecoderArch, Gpt2Arch
from runner.local.models import _trainer_io as hf_io

MIN_LEN_BUCKET = 16
_ARCH_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "max_seq_len",
    "tie_embeddings",
    "dtype",
)


def length_bucket(n: int, max_len: int) -> int:
    """Smallest power of two ``≥ max(n, 16)``, capped at ``max_len`` (``n ≤ max_len``): the
    runner's one length rule (`runner._padding.bucket`)."""
    return _padding.bucket(n, cap=max_len)


def row_bucket(n: int, num_devices: int, min_rows: int, length: int | None = None) -> int:
    """Padded row count: ``num_devices·2^k ≥ max(n, min_rows)``, the floor lowered for a long
    padded ``length`` (`runner._padding.row_bucket`)."""
    return _padding.row_bucket(n, num_devices, min_rows, length)


def _x64_enabled() -> bool:
    return jnp.zeros((), jnp.float64).dtype == jnp.float64


#: Process-wide count of traces of each jitted trainer function (a compile-count guard). The
#: jitted functions are shared by every trainer with the same heads/dtype/mesh, so a second
#: trainer of the same shape compiles nothing.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


def _make_optimizer(dtype: Any) -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adamw, hyperparam_dtype=dtype)(
        learning_rate=1e-4, b1=0.9, b2=0.95, eps=1e-12, weight_decay=0.0
    )


def make_arch(cfg: LocalTrainerConfig) -> Gpt2Arch | DecoderArch:
    """The model family object of a config (`runner.local.models._arch`): the jit cache key."""
    if cfg.decoder is None:
        return Gpt2Arch(cfg.n_heads)
    scale = None if cfg.lora is None else cfg.lora.scale
    return DecoderArch(cfg.decoder, cfg.chunk, scale, cfg.unroll_layers)


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _forward_jit(arch: Gpt2Arch | DecoderArch, rows: NamedSharding):
    def forward(params, frozen, tokens, lengths):
        TRACE_COUNTS["forward"] += 1
        return arch.token_logprobs(params, frozen, tokens, lengths)

    return jax.jit(forward, out_shardings=rows)


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _model_vjp_jit(arch: Gpt2Arch | DecoderArch):
    """Model forward returning ``(logprobs, pullback)``; the pullback (a `jax.vjp` function) is a
    pytree of residuals, so the backward runs in a separate jitted call (`_backward_jit`) and the
    model compiles once per bucket for every kernel. The gradient is taken with respect to the
    trainable ``params`` only (``frozen``: the LoRA base)."""

    def forward(params, frozen, tokens, lengths):
        TRACE_COUNTS["forward_backward"] += 1
        return jax.vjp(lambda p: arch.token_logprobs(p, frozen, tokens, lengths), params)

    return jax.jit(forward)


def _nonzero_grad_tokens(g_lp: jax.Array, batch: losses.Batch) -> jax.Array:
    """int[B]: each row's target tokens with ``dL/dlogp ≠ 0`` (for ``optim_step``'s
    normalization), from the kernel's exact gradient."""
    nonzero = (g_lp != 0) & (batch.action_mask > 0)
    return jnp.sum(nonzero.astype(jnp.int32), axis=1)


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _kernel_jit(kernel_name: str, frozen: tuple, rep: NamedSharding):
    """``(loss, metrics, dL/dlogprobs, non-zero-gradient tokens per row)`` of one kernel."""
    term = kernels.term(kernel_name, frozen)
    trace_key = f"kernel:{kernel_name}"

    def kernel(lp, batch):
        TRACE_COUNTS[trace_key] += 1
        (loss, metrics), g_lp = jax.value_and_grad(term.fn, has_aux=True)(lp, batch)
        nz_B = _nonzero_grad_tokens(g_lp, batch)
        return loss, metrics, g_lp.astype(lp.dtype), nz_B

    return jax.jit(kernel, out_shardings=(rep, rep, None, None))


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _linear_forward_backward_jit(
    arch: Gpt2Arch | DecoderArch, kernel_name: str, frozen: tuple, rep: NamedSharding
):
    """One call for a kernel linear in the logprobs (`runner.local.kernels.linear_gradient`):
    ``(logprobs, loss, metrics, non-zero-gradient tokens per row, acc + dL/dparams)``.

    ``g = dL/dlogprobs`` comes from the batch alone, so the model runs ``value_and_grad`` of
    ``Σ g·logprobs`` through its fused head (`DecoderArch.linear_loss`: the head's logits are
    formed once, never recomputed), and the kernel's loss and metrics are evaluated on the
    returned logprobs. The same values and gradient as `_model_vjp_jit` → `_kernel_jit` →
    `_backward_jit`, up to floating-point summation order.
    """
    term = kernels.term(kernel_name, frozen)
    gradient = kernels.linear_gradient(kernel_name, frozen)
    if gradient is None or not arch.fused_linear_loss:
        raise ValueError(f"{kernel_name} on {type(arch).__name__}: no fused linear-loss path")
    trace_key = f"linear_forward_backward:{kernel_name}"

    def forward_backward(params, frozen_params, tokens, lengths, batch, acc):
        TRACE_COUNTS[trace_key] += 1
        g_lp = gradient(batch)

        def linear(p):
            return arch.linear_loss(p, frozen_params, tokens, lengths, g_lp)

        (_, lp), grads = jax.value_and_grad(linear, has_aux=True)(params)
        loss, metrics = term.fn(lp, batch)
        nz_B = _nonzero_grad_tokens(g_lp, batch)
        return lp, loss, metrics, nz_B, jax.tree.map(jnp.add, acc, grads)

    return jax.jit(forward_backward, out_shardings=(None, rep, rep, None, rep))


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _backward_jit(rep: NamedSharding):
    """``acc + pullback(dL/dlogprobs)``: the parameter gradient, summed into the accumulator."""

    def backward(pullback, g_lp, acc):
        TRACE_COUNTS["backward"] += 1
        (grads,) = pullback(g_lp)
        return jax.tree.map(jnp.add, acc, grads)

    return jax.jit(backward, out_shardings=rep)


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _optim_step_jit(dtype_name: str, rep: NamedSharding):
    tx = _make_optimizer(jnp.dtype(dtype_name))

    def step(params, opt_state, grads, denom, clip, lr, b1, b2, eps, wd):
        TRACE_COUNTS["optim_step"] += 1
        grads = jax.tree.map(lambda g: g / denom, grads)
        norm = optax.tree.norm(grads)
        scale = jnp.where((clip > 0) & (norm > clip), clip / jnp.where(norm > 0, norm, 1), 1)
        grads = jax.tree.map(lambda g: g * scale, grads)
        hp = dict(opt_state.hyperparams)
        hp.update(learning_rate=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
        new_state = opt_state._replace(hyperparams=hp)
        updates, new_state = tx.update(grads, new_state, params)
        # A non-finite gradient or update (a learning rate that overflows, eps = 0 over a zero
        # second moment) is not applied: the old parameters and state are kept, and the host
        # raises (`NonFiniteUpdateError`).
        ok = jnp.isfinite(norm) & jnp.isfinite(optax.tree.norm(updates))
        new_params = optax.apply_updates(params, updates)

        def keep(new, old):
            return jnp.where(ok, new, old)

        return (
            jax.tree.map(keep, new_params, params),
            jax.tree.map(keep, new_state, opt_state),
            norm,
            ok,
        )

    return jax.jit(step, out_shardings=rep)


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _sample_jit(
    cache_len: int, arch: Gpt2Arch | DecoderArch, rows: NamedSharding, sample_vocab: int | None
):
    def sample(params, frozen, *args):
        TRACE_COUNTS["sample"] += 1
        return sampling.generate(
            params,
            *args,
            cache_len=cache_len,
            arch=arch,
            frozen=frozen,
            sample_vocab=sample_vocab,
        )

    return jax.jit(sample, out_shardings=rows)


@functools.lru_cache(maxsize=kernels.JIT_CACHE_SIZE)
def _init_jit(dtype_name: str, rep: NamedSharding):
    tx = _make_optimizer(jnp.dtype(dtype_name))
    return jax.jit(tx.init, out_shardings=rep), jax.jit(
        lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=rep
    )


class LocalTrainer:
    """Embedded decoder-only transformer trainer implementing the `runner.Trainer` protocol.

    The model is the GPT-2-style default, or a Llama / Qwen2 / Qwen3 decoder
    (``config.decoder``; `from_pretrained` reads one from a Hugging Face checkpoint), trained in
    full or through LoRA adapters (``config.lora``: the decoder's weights are frozen, the
    optimizer state covers the adapters only).

    Args:
      config: a `LocalTrainerConfig` (default: the character-level default config).
      weights: a decoder's initial weights (the layout of `runner.local.models.init_params`,
        numpy or jax arrays) instead of a random initialization; decoders only.
      **overrides: fields replacing those of ``config``.

    Attributes:
      config: the `LocalTrainerConfig`.
      arch: the model family object (`runner.local.models.Gpt2Arch` / ``DecoderArch``).
      params: the current trainable parameter pytree (replicated over the mesh): every weight,
        or with LoRA the adapters ``{proj: {"lora_A", "lora_B"}}``.
      step: optimizer steps taken (restored by ``load_state(with_optimizer=True)``).
      counters: ``{"forward", "backward", "optim_step", "sample"}`` pass counts
        (``forward_backward`` counts one forward and one backward).
      trace_counts: process-wide trace counts of the jitted functions (`TRACE_COUNTS`).
      mesh: the data-parallel mesh over ``jax.devices()``.
    """

    #: Smallest padded row count of a forward/backward batch.
    MIN_ROWS = _padding.MIN_ROWS
    #: Builtin kernels this trainer runs (the step planner reads this).
    builtin_losses = kernels.SUPPORTED
    #: Most rows (prompts × num_samples) and tokens (prompts + completions) of one `sample`
    #: call, so one call cannot take the host's memory (the KV cache grows with both); a
    #: caller that needs more sets these on the instance or splits the call.
    max_sample_rows = 4096
    max_sample_tokens = 1 << 21

    def __init__(
        self,
        config: LocalTrainerConfig | None = None,
        *,
        weights: Params | None = None,
        **overrides: Any,
    ) -> None:
        cfg = config if config is not None else LocalTrainerConfig()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        if cfg.dtype == "float64" and not _x64_enabled():
            raise ValueError(
                "LocalTrainerConfig.dtype='float64' needs jax_enable_x64 "
                "(jax.config.update('jax_enable_x64', True) before creating the trainer)"
            )
        self.config = cfg
        self.arch = make_arch(cfg)
        self._dtype = cfg.jnp_dtype
        #: dtype of logprobs, kernel inputs and optimizer hyperparameters (float32 for bf16).
        self._lp_dtype = np.dtype("float32" if cfg.dtype == "bfloat16" else cfg.dtype)
        self.mesh = Mesh(np.asarray(jax.devices()), ("data",))
        self._rep = NamedSharding(self.mesh, P())
        self._rows = NamedSharding(self.mesh, P("data"))
        trainable, frozen, self._source = hf_io.initial_params(cfg, weights, self._lp_dtype)
        self._frozen = jax.device_put(frozen, self._rep)
        self._params = jax.device_put(trainable, self._rep)
        self._base_digest: str | None = None
        init_fn, self._zeros_fn = _init_jit(self._lp_dtype.name, self._rep)
        self._opt_state = init_fn(self._params)
        self.step = 0
        self.counters = {"forward": 0, "backward": 0, "optim_step": 0, "sample": 0}
        self.trace_counts = TRACE_COUNTS
        self._grads: Params | None = None
        self._num_loss_tokens = 0
        self._num_sequences = 0

    # -- model access -----------------------------------------------------------------------

    @property
    def params(self) -> Params:
        """The current parameters (a dict pytree; see `runner.local.model.init_params`)."""
        return self._params

    @property
    def base_params(self) -> Params:
        """The frozen parameters: a LoRA trainer's base weights (``{}`` without LoRA)."""
        return self._frozen

    @property
    def num_devices(self) -> int:
        return int(self.mesh.devices.size)

    def token_logprobs(self, params: Params, tokens_BT: Any, lengths_B: Any) -> jax.Array:
        """Pure, differentiable target logprobs ``[B, T-1]`` (0 on padding); see
        `runner.local.model.token_logprobs` and `runner.local.models.token_logprobs`.

        Args:
          params: a trainable-parameter pytree (e.g. ``trainer.params``; the LoRA adapters of a
            LoRA trainer, whose frozen base is used as it is).
          tokens_BT: int full sequences, right-padded to ``T`` columns.
          lengths_B: int number of real tokens per row.

        Returns:
          float[B, T-1] target logprobs.
        """
        return self.arch.token_logprobs(params, self._frozen, tokens_BT, lengths_B)

    def set_params(self, params: Params) -> None:
        """Replaces the parameters (same structure, shapes and dtype); drops pending gradients.

        Args:
          params: a pytree like ``trainer.params`` (jax or numpy arrays).
        """
        mine = jax.tree_util.tree_structure(self._params)
        if jax.tree_util.tree_structure(params) != mine:
            raise ValueError("set_params: parameter tree structure differs from trainer.params")
        for name, (x, y) in model.flatten(
            jax.tree.map(lambda a, b: (a, b), params, self._params)
        ).items():
            # ``x.dtype``, not ``np.result_type(x)``: numpy's dtype inference from a jax array is
            # deprecated in jax (a DeprecationWarning, an error in the future).
            dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)
            if tuple(np.shape(x)) != tuple(y.shape) or dtype != y.dtype:
                raise ValueError(
                    f"set_params: '{name}' has shape {np.shape(x)} / dtype {dtype}, "
                    f"expected {y.shape} / {y.dtype}"
                )
        self._params = jax.device_put(params, self._rep)
        self.reset_grads()

    def accumulated_grads(self) -> Params | None:
        """The gradient accumulated since the last ``optim_step`` (``None`` if nothing was)."""
        return self._grads

    def reset_grads(self) -> None:
        """Drops the accumulated gradient and its non-zero-gradient token/sequence counts."""
        self._grads = None
        self._num_loss_tokens = 0
        self._num_sequences = 0

    @property
    def grad_counts(self) -> dict[str, int]:
        """Non-zero-gradient tokens and sequences accumulated since the last step."""
        return {"num_loss_tokens": self._num_loss_tokens, "num_sequences": self._num_sequences}

    # -- padding ----------------------------------------------------------------------------

    def _pad(self, seqs: Sequence[Seq]):
        """``(tokens[rows, width+1], lengths[rows], rows, width)`` in the runner's bucket rule.

        The runner's `CheckedSeqs` keep the padded tokens, so the forward and the backward of
        one client pass pad them once.
        """
        lengths = np.fromiter((s.tokens.shape[0] for s in seqs), np.int32, len(seqs))
        width = length_bucket(int(lengths.max()) - 1, self.config.max_seq_len)
        rows = row_bucket(len(seqs), self.num_devices, self.MIN_ROWS, width)
        cached = seqs.padded.get("tokens") if isinstance(seqs, CheckedSeqs) else None
        if cached is not None and cached[0].shape == (rows, width + 1):
            return cached[0], cached[1], rows, width
        tokens = pad_ragged([s.tokens for s in seqs], width + 1, rows, np.int32)
        padded_lengths = np.zeros((rows,), np.int32)
        padded_lengths[: len(seqs)] = lengths
        if isinstance(seqs, CheckedSeqs):
            seqs.padded["tokens"] = (tokens, padded_lengths)
        return tokens, padded_lengths, rows, width

    def _validate(self, seqs: Sequence[Seq], required: Sequence[str] = ()) -> bool:
        """Validates a direct call's sequences; returns whether the runner had checked them.

        The runner's `CheckedSeqs` were validated where they entered: only this trainer's own
        limits (vocabulary, ``max_seq_len``) are checked, on the padded tokens.
        """
        if isinstance(seqs, CheckedSeqs) and len(seqs):
            tokens, lengths, _, _ = self._pad(seqs)
            if (
                int(tokens.min()) >= 0
                and int(tokens.max()) < self.config.vocab_size
                and int(lengths.max()) - 1 <= self.config.max_seq_len
            ):
                return True
        if isinstance(seqs, Seq) or not isinstance(seqs, Sequence):
            raise ValueError(f"expected a sequence of runner.Seq, got {type(seqs).__name__}")
        validate_seqs(
            seqs,
            required=required,
            vocab_size=self.config.vocab_size,
            max_len=self.config.max_seq_len,
        )
        return False

    def _put_rows(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x, self._rows)

    # -- forward ----------------------------------------------------------------------------

    def forward(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per-target logprobs of each sequence (float[N-1]: the model dtype, float32 for a bfloat16
        model) at the current weights.

        Inputs attached to the sequences are validated but otherwise ignored. The arrays are
        read-only views of one padded buffer (`runner._padding.RaggedArrays`).
        """
        self._validate(seqs)
        tokens, lengths, _, _ = self._pad(seqs)
        fn = _forward_jit(self.arch, self._rows)
        lp = fn(self._params, self._frozen, self._put_rows(tokens), self._put_rows(lengths))
        lp = np.asarray(jax.device_get(lp), self._lp_dtype)
        self.counters["forward"] += 1
        return RaggedArrays(lp, [s.num_targets for s in seqs])

    # -- forward_backward -------------------------------------------------------------------

    def forward_backward(
        self, seqs: Sequence[Seq], loss_name: str, config: Mapping[str, Any] | None = None
    ) -> ForwardBackwardResult:
        """Runs a built-in kernel (see `runner.local.kernels`) and accumulates its gradient.

        The kernel is the matching `losses` term with ``reduction="token_sum"`` over a batch
        whose ``action_mask`` is 1 on every real target, so ``loss:sum`` is the raw token sum.
        The non-zero-gradient counts (tokens with ``dL/dlogp ≠ 0``, computed exactly from the
        term's gradient, and sequences with at least one) accumulate for ``optim_step``
        normalization.

        Args:
          seqs: the sequences, with the kernel's inputs (see `runner.local.kernels`).
          loss_name: one of ``runner.BUILTIN_LOSSES``.
          config: the kernel's ``loss_fn_config``.

        Returns:
          `ForwardBackwardResult` with logprobs (model dtype) per sequence and metrics ``loss:sum``,
          the term's metrics as ``name:reduction`` keys, ``num_nonzero_grad_tokens:sum``,
          ``num_nonzero_grad_sequences:sum`` and ``num_sequences:sum``.

        Raises:
          ValueError: unknown loss or config key, bad config value, missing/extra/misshapen/
            non-finite inputs, empty batch, tokens outside the vocabulary or too long.
        """
        kernel, frozen = kernels.resolve(loss_name, config)
        if not self._validate(seqs, required=kernel.inputs):
            kernels.check_inputs(kernel, seqs)
        tokens, lengths, rows, width = self._pad(seqs)
        fields = kernels.build_batch(kernel, seqs, rows, width, self._lp_dtype)
        batch = losses.Batch(**{k: self._put_rows(v) for k, v in fields.items()})
        tokens, lengths = self._put_rows(tokens), self._put_rows(lengths)
        acc = self._grads if self._grads is not None else self._zeros_fn(self._params)
        if self.arch.fused_linear_loss and kernels.linear_gradient(kernel.name, frozen) is not None:
            fn = _linear_forward_backward_jit(self.arch, kernel.name, frozen, self._rep)
            lp, loss, metrics, nz_B, self._grads = fn(
                self._params, self._frozen, tokens, lengths, batch, acc
            )
        else:
            lp, pullback = _model_vjp_jit(self.arch)(self._params, self._frozen, tokens, lengths)
            loss, metrics, g_lp, nz_B = _kernel_jit(kernel.name, frozen, self._rep)(lp, batch)
            self._grads = _backward_jit(self._rep)(pullback, g_lp, acc)
        nz_B = np.asarray(jax.device_get(nz_B))[: len(seqs)]
        n_tok, n_seq = int(nz_B.sum()), int((nz_B > 0).sum())
        self._num_loss_tokens += n_tok
        self._num_sequences += n_seq
        self.counters["forward"] += 1
        self.counters["backward"] += 1
        out = kernels.server_metrics(jax.device_get(metrics))
        out["loss:sum"] = float(loss)
        out["num_nonzero_grad_tokens:sum"] = float(n_tok)
        out["num_nonzero_grad_sequences:sum"] = float(n_seq)
        out["num_sequences:sum"] = float(len(seqs))
        lp = np.asarray(jax.device_get(lp), self._lp_dtype)
        return ForwardBackwardResult(
            logprobs=RaggedArrays(lp, [s.num_targets for s in seqs]), metrics=out
        )

    def forward_backward_logprob_loss(
        self, seqs: Sequence[Seq], loss: Any, build: Any
    ) -> ForwardBackwardResult:
        """Runs a loss of the per-token logprobs that the caller supplies, in one pass.

        1 forward + 1 backward, exactly like a built-in kernel: the model's jitted forward
        returns ``(logprobs, pullback)``, ``loss`` (a jitted ``(lp[rows, width], data) ->
        (loss, metrics, dL/dlp)``, one compile per bucket) runs on the padded logprobs, and the
        pullback of its gradient is summed into the accumulator. The server's custom losses
        (`runner.serve._graph`) run this way.

        Args:
          seqs: the sequences (their inputs are the loss's data).
          loss: the jitted loss function.
          build: ``(rows, width) -> data``, the loss's host data for this batch's bucket.

        Returns:
          `ForwardBackwardResult`: logprobs, ``loss:sum``, the loss's own metrics,
          ``num_nonzero_grad_tokens:sum``, ``num_nonzero_grad_sequences:sum``,
          ``num_sequences:sum``.
        """
        self._validate(seqs)
        tokens, lengths, rows, width = self._pad(seqs)
        data = jax.tree.map(self._put_rows, build(rows, width))
        tokens, lengths = self._put_rows(tokens), self._put_rows(lengths)
        acc = self._grads if self._grads is not None else self._zeros_fn(self._params)
        lp, pullback = _model_vjp_jit(self.arch)(self._params, self._frozen, tokens, lengths)
        value, metrics, g_lp = loss(lp, data)
        self._grads = _backward_jit(self._rep)(pullback, g_lp.astype(lp.dtype), acc)
        real = np.arange(width)[None, :] < (np.asarray(jax.device_get(lengths)) - 1)[:, None]
        nz_B = ((np.asarray(jax.device_get(g_lp)) != 0) & real).sum(axis=1)[: len(seqs)]
        n_tok, n_seq = int(nz_B.sum()), int((nz_B > 0).sum())
        self._num_loss_tokens += n_tok
        self._num_sequences += n_seq
        self.counters["forward"] += 1
        self.counters["backward"] += 1
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["loss:sum"] = float(value)
        out["num_nonzero_grad_tokens:sum"] = float(n_tok)
        out["num_nonzero_grad_sequences:sum"] = float(n_seq)
        out["num_sequences:sum"] = float(len(seqs))
        lp = np.asarray(jax.device_get(lp), self._lp_dtype)
        return ForwardBackwardResult(
            logprobs=RaggedArrays(lp, [s.num_targets for s in seqs]), metrics=out
        )

    # -- optim_step -------------------------------------------------------------------------

    def optim_step(self, adam: AdamParams, normalization: str | None = None) -> dict[str, float]:
        """Applies the accumulated gradient with AdamW, then resets the accumulator.

        Order (the Fireworks ``optim_step`` docstring): (1) normalize — ``None``/``"none"``:
        as is; ``"num_loss_tokens"``: divide by the non-zero-gradient tokens accumulated since
        the last step; ``"num_sequences"``: by the sequences with a non-zero gradient (a zero
        count divides by 1); (2) if ``grad_clip_norm > 0`` and the global norm ``‖g‖`` exceeds
        it, scale by ``grad_clip_norm/‖g‖`` (optax ``clip_by_global_norm``); (3) AdamW exactly
        as ``torch.optim.AdamW``: ``m ← β1·m + (1-β1)·g``, ``v ← β2·v + (1-β2)·g²``,
        ``θ ← θ - lr·(m̂/(√v̂ + eps) + wd·θ)`` with ``m̂ = m/(1-β1^t)``, ``v̂ = v/(1-β2^t)``
        (decoupled decay on every parameter). Per-step changes of ``AdamParams`` keep the moments.

        Args:
          adam: the `AdamParams`.
          normalization: ``None`` or one of ``runner.NORMALIZATIONS``.

        Returns:
          Metrics: ``grad_norm`` (after normalization, before clipping), ``num_loss_tokens``,
          ``num_sequences``, ``normalization_denominator``, ``learning_rate``, ``step``.

        Raises:
          ValueError: nothing accumulated, or an unknown normalization.
          NonFiniteUpdateError: the gradient or the update is not finite (NaN/inf); the
            parameters and optimizer state are left as they were.
        """
        if not isinstance(adam, AdamParams):
            raise ValueError(f"optim_step: adam must be a runner.AdamParams, got {adam!r}")
        mode = "none" if normalization is None else normalization
        if mode not in NORMALIZATIONS:
            raise ValueError(
                f"optim_step: unknown normalization {normalization!r}; expected None or one of "
                f"{NORMALIZATIONS}"
            )
        if self._grads is None:
            raise ValueError(
                "optim_step: no gradient accumulated since the last step (call forward_backward "
                "first)"
            )
        counts = {"num_loss_tokens": self._num_loss_tokens, "num_sequences": self._num_sequences}
        denom = 1 if mode == "none" else max(counts[mode], 1)
        s = functools.partial(np.asarray, dtype=self._lp_dtype)
        step_fn = _optim_step_jit(self._lp_dtype.name, self._rep)
        params, opt_state, norm, ok = step_fn(
            self._params,
            self._opt_state,
            self._grads,
            s(denom),
            s(adam.grad_clip_norm),
            s(adam.learning_rate),
            s(adam.beta1),
            s(adam.beta2),
            s(adam.eps),
            s(adam.weight_decay),
        )
        self.reset_grads()
        if not bool(ok):
            raise NonFiniteUpdateError(
                f"optim_step: the gradient (norm {float(norm)}) or the AdamW update is not "
                f"finite; it was not applied (learning_rate={adam.learning_rate:g}, "
                f"eps={adam.eps:g}: a learning rate too large, or eps = 0, are the usual causes)"
            )
        self._params, self._opt_state = params, opt_state
        self.step += 1
        self.counters["optim_step"] += 1
        return {
            "grad_norm": float(norm),
            "num_loss_tokens": float(counts["num_loss_tokens"]),
            "num_sequences": float(counts["num_sequences"]),
            "normalization_denominator": float(denom),
            "learning_rate": float(adam.learning_rate),
            "step": float(self.step),
        }

    # -- sampling ---------------------------------------------------------------------------

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        row_offsets: Sequence[int] | None = None,
    ) -> list[list[Sample]]:
        """``num_samples`` completions per prompt, batched, with a KV cache.

        See `runner.local.sampling`: deterministic given ``seed``; temperature 0 is greedy;
        generation stops after a stop token (included in the completion, ``stop_reason="stop"``)
        or after ``max_tokens`` tokens (``"length"``). ``Sample.logprobs`` are float32
        ``log_softmax(logits/temperature)`` of each sampled token (at temperature 1: the
        ``forward()`` logprobs of prompt+completion; at temperature 0: the untempered model
        logprobs of the greedy tokens). ``len(prompt) + max_tokens - 1`` must not exceed
        ``max_seq_len``, so every prompt+completion can be passed to ``forward``.

        Args:
          prompts: token-id prompts, each non-empty.
          num_samples: completions per prompt (≥ 1).
          max_tokens: most tokens per completion (≥ 1).
          temperature: sampling temperature ≥ 0.
          seed: PRNG seed (`runner._seeds`: completion ``j`` of prompt ``p`` draws from the
            random stream of row ``p·num_samples + j``).
          stop_token_ids: token ids that end a completion.
          row_offsets: the random-stream row of each prompt's first completion (default:
            ``p·num_samples``). A caller that receives the prompts of one call separately
            (the local server, one request per prompt or per completion) passes their rows in
            that call (decoded from the wire seeds) to reproduce its completions.

        Returns:
          ``result[p][j]``: the ``j``-th `runner.Sample` of prompt ``p``.
        """
        cfg = self.config
        arrays = self._check_prompts(prompts)
        num_samples = _check_int("num_samples", num_samples, 1)
        max_tokens = _check_int("max_tokens", max_tokens, 1)
        seed = _check_int("seed", seed, 0)
        if seed >= 2**32:
            raise ValueError(f"sample: seed must be < 2**32, got {seed}")
        if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.number):
            raise ValueError(f"sample: temperature must be a number, got {temperature!r}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"sample: temperature must be finite and >= 0, got {temperature!r}")
        stops = [int(_check_int("stop_token_ids entry", t, 0)) for t in stop_token_ids]
        if row_offsets is None:
            offsets = [p * num_samples for p in range(len(arrays))]
        else:
            offsets = [_check_int("row_offsets entry", i, 0) for i in row_offsets]
            if len(offsets) != len(arrays) or max(offsets) + num_samples > 2**31:
                raise ValueError(
                    f"sample: row_offsets must give one row (+ num_samples <= 2**31) per "
                    f"prompt, got {len(offsets)} for {len(arrays)} prompts"
                )
        bad = [t for t in stops if t >= cfg.vocab_size]
        if bad:
            raise ValueError(f"sample: stop token {bad[0]} is outside the vocabulary")
        rows = len(arrays) * num_samples
        tokens = sum(len(a) for a in arrays) * num_samples + rows * max_tokens
        if rows > self.max_sample_rows or tokens > self.max_sample_tokens:
            raise ValueError(
                f"sample: {len(arrays)} prompts x num_samples={num_samples} is {rows} rows and "
                f"{tokens} tokens (prompts + completions of max_tokens={max_tokens}), over this "
                f"trainer's limits of {self.max_sample_rows} rows and {self.max_sample_tokens} "
                "tokens per call (LocalTrainer.max_sample_rows / max_sample_tokens; split the call)"
            )
        longest = max(a.shape[0] for a in arrays)
        if longest + max_tokens - 1 > cfg.max_seq_len:
            raise ValueError(
                f"sample: longest prompt ({longest}) + max_tokens ({max_tokens}) - 1 exceeds "
                f"max_seq_len={cfg.max_seq_len}"
            )
        prompt_w = length_bucket(longest, cfg.max_seq_len)
        cache_len = length_bucket(longest + max_tokens - 1, cfg.max_seq_len)
        n_rows = len(arrays) * num_samples
        rows = row_bucket(n_rows, self.num_devices, 1)
        toks = np.zeros((rows, prompt_w), np.int32)
        lens = np.ones((rows,), np.int32)
        p_idx = np.zeros((rows,), np.int32)
        s_idx = np.zeros((rows,), np.int32)
        active = np.zeros((rows,), bool)
        for p, a in enumerate(arrays):
            for j in range(num_samples):
                r = p * num_samples + j
                toks[r, : a.shape[0]] = a
                lens[r], p_idx[r], active[r] = a.shape[0], offsets[p] + j, True
        n_stop = 4
        while n_stop < len(stops):
            n_stop *= 2
        stop_arr = np.full((n_stop,), -1, np.int32)
        stop_arr[: len(stops)] = stops
        fn = _sample_jit(cache_len, self.arch, self._rows, cfg.sample_vocab_size)
        put = self._put_rows
        out_tok, out_lp, n_gen, stopped = fn(
            self._params,
            self._frozen,
            put(toks),
            put(lens),
            put(p_idx),
            put(s_idx),
            put(active),
            jax.device_put(stop_arr, self._rep),
            np.asarray(max_tokens, np.int32),
            np.asarray(temperature, self._lp_dtype),
            jax.random.PRNGKey(seed),
        )
        out_tok, out_lp, n_gen, stopped = jax.device_get((out_tok, out_lp, n_gen, stopped))
        self.counters["sample"] += 1
        result = []
        for p in range(len(arrays)):
            row = []
            for j in range(num_samples):
                r = p * num_samples + j
                n = int(n_gen[r])
                row.append(
                    Sample(
                        tokens=np.asarray(out_tok[r, :n], np.int64),
                        logprobs=np.asarray(out_lp[r, :n], np.float32),
                        stop_reason="stop" if stopped[r] else "length",
                    )
                )
            result.append(row)
        return result

    def _check_prompts(self, prompts: Any) -> list[np.ndarray]:
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            raise ValueError("sample: prompts must be a sequence of token sequences")
        try:
            prompts = list(prompts)
        except TypeError:
            raise ValueError(f"sample: prompts must be a sequence, got {type(prompts)}") from None
        if not prompts:
            raise ValueError("sample: empty batch: at least one prompt is required")
        arrays = []
        for i, p in enumerate(prompts):
            a = np.asarray(p)
            if a.ndim != 1 or a.shape[0] < 1:
                raise ValueError(
                    f"prompt {i}: must be a non-empty rank-1 token list, got {a.shape}"
                )
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"prompt {i}: tokens must be integers, got dtype {a.dtype}")
            if a.min() < 0 or a.max() >= self.config.vocab_size:
                t = int(np.argmax((a < 0) | (a >= self.config.vocab_size)))
                raise ValueError(
                    f"prompt {i}: token {int(a[t])} at position {t} is outside the vocabulary "
                    f"[0, {self.config.vocab_size})"
                )
            if a.shape[0] > self.config.max_seq_len:
                raise ValueError(
                    f"prompt {i}: length {a.shape[0]} exceeds max_seq_len={self.config.max_seq_len}"
                )
            arrays.append(a.astype(np.int32))
        return arrays

    # -- checkpoints ------------------------------------------------------------------------

    def _root(self) -> Path:
        if self.config.checkpoint_dir is None:
            raise ValueError(
                "LocalTrainerConfig.checkpoint_dir is None: set it to save checkpoints"
            )
        return Path(self.config.checkpoint_dir)

    def _arch(self) -> dict[str, Any]:
        if self.config.decoder is None:
            return {k: getattr(self.config, k) for k in _ARCH_FIELDS}
        if self.config.lora is not None and self._base_digest is None:
            self._base_digest = hf_io.base_digest(self._frozen)
        return hf_io.arch_meta(self.config, self._base_digest)

    def _check_arch(self, saved: Mapping[str, Any], where: str) -> None:
        mine = self._arch()
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            raise ValueError(
                f"{where}: checkpoint model config differs from this trainer's "
                f"(field: (checkpoint, trainer)): {diff}"
            )

    def save_state(self, name: str) -> str:
        """Atomically saves resumable state (params, Adam state, step) with orbax-checkpoint.

        The pending accumulated gradient is not saved. See `runner.local.checkpoint` for the
        layout and atomicity.

        Args:
          name: checkpoint name (``[A-Za-z0-9][A-Za-z0-9._-]*``); saving a name again replaces it
            atomically.

        Returns:
          The reference (the checkpoint's directory path) for `load_state`.
        """
        root = self._root()
        leaves, treedef = jax.tree_util.tree_flatten(self._opt_state)
        tree = {
            "params": self._params,
            "opt_state": {f"{i:04d}": leaf for i, leaf in enumerate(leaves)},
        }
        meta = {
            "step": self.step,
            "model": self._arch(),
            "opt_state_treedef": str(treedef),
            "num_opt_leaves": len(leaves),
        }
        return checkpoint.save_state(root, name, tree, meta)

    def load_state(self, ref: str, with_optimizer: bool = True) -> None:
        """Restores a `save_state` checkpoint (by name under ``checkpoint_dir``, or by path).

        With ``with_optimizer`` the parameters, the Adam state (moments, step count, last
        hyperparameters) and ``step`` are restored exactly. Without it only the parameters are
        restored; the live optimizer state and ``step`` are left as they are (Fireworks
        ``load_state`` vs ``load_state_with_optimizer``). Either way the accumulated gradient is
        dropped (it was computed at other weights).

        Raises:
          FileNotFoundError: no complete checkpoint at ``ref``.
          ValueError: the checkpoint's model config or optimizer structure differs.
        """
        root = Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None
        version = checkpoint.resolve_state(root, ref)
        meta = checkpoint.read_meta(version)
        self._check_arch(meta.get("model", {}), f"load_state({ref!r})")
        leaves, treedef = jax.tree_util.tree_flatten(self._opt_state)
        if meta.get("num_opt_leaves") != len(leaves) or meta.get("opt_state_treedef") != str(
            treedef
        ):
            raise ValueError(f"load_state({ref!r}): optimizer state structure differs")

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        target = {
            "params": jax.tree.map(abstract, self._params),
            "opt_state": {f"{i:04d}": abstract(leaf) for i, leaf in enumerate(leaves)},
        }
        restored = checkpoint.read_tree(version / "tree", target)
        if with_optimizer:
            opt = [restored["opt_state"][f"{i:04d}"] for i in range(len(leaves))]
            opt_state = jax.tree_util.tree_unflatten(treedef, opt)
            if meta.get("step") != int(opt_state.count):  # the step inside the verified tree
                raise checkpoint.IntegrityError(
                    f"load_state({ref!r}): {version / 'meta.json'} records step "
                    f"{meta.get('step')!r} but its optimizer state has taken "
                    f"{int(opt_state.count)} steps: the checkpoint was edited"
                )
            self._opt_state = opt_state
            self.step = int(meta["step"])
        self._params = restored["params"]
        self.reset_grads()

    def list_checkpoints(self) -> list[str]:
        """Names of the complete resumable checkpoints under ``checkpoint_dir``, oldest first."""
        root = Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None
        return checkpoint.list_states(root)

    def sampler_tensors(self) -> dict[str, np.ndarray]:
        """Inference weights as flat per-layer names (``layers.{i}.wqkv``, ``embed``, ...; a
        decoder's are its Hugging Face tensor names, with LoRA adapters merged)."""
        if self.config.decoder is not None:
            full = hf_io.full_weights(self.config, self._params, self._frozen)
            return decoders.to_hf_tensors(self.config.decoder, full)
        out: dict[str, np.ndarray] = {}
        for key, value in jax.device_get(self._params).items():
            if key == "blocks":
                for sub, arr in value.items():
                    for i in range(arr.shape[0]):
                        out[f"layers.{i}.{sub}"] = np.asarray(arr[i])
            else:
                out[key] = np.asarray(value)
        return out

    def save_weights_for_sampler(self, name: str) -> str:
        """Atomically writes promotable inference weights (safetensors, no optimizer state).

        The GPT-2-style default writes ``sampler/<name>.safetensors``; a decoder writes the
        Hugging Face formats under ``sampler/<name>/`` — a transformers checkpoint directory, or
        with LoRA a PEFT adapter directory (`runner.local.models._trainer_io`).

        Returns:
          The ``.safetensors`` path (for `load_weights`).
        """
        meta = {"model": self._arch(), "step": self.step}
        if self.config.decoder is not None:
            return hf_io.save_sampler(
                self._root(), name, self.config, self._params, meta, source=self._source
            )
        return checkpoint.save_weights(self._root(), name, self.sampler_tensors(), meta)

    def load_weights(self, path: str) -> None:
        """Loads `save_weights_for_sampler` weights (a path, or a name under ``checkpoint_dir``).

        Only the parameters change (the optimizer state is kept); the accumulated gradient is
        dropped. A decoder also loads a transformers checkpoint directory of its architecture
        (full fine-tuning) or a PEFT adapter directory of its LoRA shape.

        Raises:
          FileNotFoundError: no such file.
          ValueError: names, shapes or model config differ.
        """
        root = Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None
        if self.config.decoder is not None:
            where = hf_io.resolve_sampler(root, path)
            params = hf_io.load_sampler(where, self.config, self._arch(), self._lp_dtype)
            self._params = jax.device_put(params, self._rep)
            self.reset_grads()
            return
        tensors, meta = checkpoint.load_weights(checkpoint.resolve_weights(root, path))
        self._check_arch(meta.get("model", {}), f"load_weights({path!r})")
        expected = {k: v.shape for k, v in self.sampler_tensors().items()}
        got = {k: v.shape for k, v in tensors.items()}
        if expected != got:
            missing = sorted(set(expected) - set(got))
            extra = sorted(set(got) - set(expected))
            raise ValueError(
                f"load_weights({path!r}): tensors differ (missing {missing}, unexpected {extra}, "
                "or shapes differ)"
            )
        params = {}
        for key, value in self._params.items():
            if key == "blocks":
                params[key] = {
                    sub: np.stack([tensors[f"layers.{i}.{sub}"] for i in range(arr.shape[0])])
                    for sub, arr in value.items()
                }
            else:
                params[key] = tensors[key]
        params = jax.tree.map(lambda x: np.asarray(x, self._dtype), params)
        self._params = jax.device_put(params, self._rep)
        self.reset_grads()

    # -- Hugging Face checkpoints -----------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        max_seq_len: int | None = None,
        checkpoint_dir: str | None = None,
        seed: int = 0,
        lora: decoders.LoraConfig | None = None,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        lora_targets: Sequence[str] | str = "all-linear",
        adapter: str | Path | None = None,
        logprob_chunk: int | None = None,
    ) -> LocalTrainer:
        """A trainer of the Llama / Qwen2 / Qwen3 checkpoint in a local directory (offline).

        Reads ``config.json`` and ``model.safetensors`` (or a sharded index); see
        `runner.local.models.load_pretrained` for what is checked. Never downloads anything.

        Args:
          path: the checkpoint directory.
          dtype: weights and activations: ``float32`` (default, whatever the stored dtype),
            ``bfloat16`` or ``float64`` (needs x64).
          max_seq_len: longest model input (default ``min(max_position_embeddings, 4096)``).
          checkpoint_dir: where `save_state` / `save_weights_for_sampler` write.
          seed: LoRA initialization seed (and nothing else: the weights are the checkpoint's).
          lora: a `runner.local.models.LoraConfig`; or give ``lora_rank`` (with optional
            ``lora_alpha`` — default the rank — and ``lora_targets``, default ``"all-linear"``).
          adapter: a PEFT adapter directory to start the LoRA adapters from (its rank, alpha
            and targets are used when ``lora``/``lora_rank`` are not given).
          logprob_chunk: tokens per logprob chunk (0 = materialized; ``None`` = default).

        Raises:
          FileNotFoundError, ValueError: naming the file, tensor or config key.
        """
        if lora is not None and lora_rank is not None:
            raise ValueError("from_pretrained: give lora or lora_rank, not both")
        if lora_rank is not None:
            lora = decoders.LoraConfig(
                rank=lora_rank, alpha=lora_alpha, targets=lora_targets, seed=seed
            )
        elif lora_alpha is not None:
            raise ValueError("from_pretrained: lora_alpha needs lora_rank")
        if dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(
                f"from_pretrained: dtype must be float32, bfloat16 or float64, got {dtype!r}"
            )
        if adapter is not None and lora is None:
            lora = decoders.read_adapter_config(Path(adapter) / decoders.ADAPTER_CONFIG)
        fields: dict[str, Any] = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
        cfg = LocalTrainerConfig.from_pretrained(
            path,
            lora=lora,
            dtype=dtype,
            seed=seed,
            checkpoint_dir=checkpoint_dir,
            logprob_chunk=logprob_chunk,
            **fields,
        )
        trainer = cls(cfg)
        if adapter is not None:
            trainer.load_weights(str(adapter))
        return trainer

    def save_pretrained(self, directory: str | Path, *, max_shard_bytes: int | None = None) -> str:
        """Writes the decoder as a transformers checkpoint directory (LoRA adapters merged:
        ``W + s·B A``), loadable by ``AutoModelForCausalLM.from_pretrained``; returns its path.

        Args:
          directory: replaced atomically if it exists.
          max_shard_bytes: shard the weights above this size (``None``: one file).
        """
        if self.config.decoder is None:
            raise ValueError(
                "save_pretrained: the GPT-2-style default model has no Hugging Face format; use "
                "save_weights_for_sampler"
            )
        full = hf_io.full_weights(self.config, self._params, self._frozen)
        out = decoders.save_pretrained(
            directory,
            self.config.decoder,
            full,
            max_shard_bytes=max_shard_bytes,
            extra_config=self._source.get("config"),
        )
        return str(out)

    def save_adapter(self, directory: str | Path) -> str:
        """Writes the LoRA adapters as a PEFT adapter directory (``adapter_config.json`` +
        ``adapter_model.safetensors``, loadable by ``peft.PeftModel.from_pretrained``)."""
        if self.config.lora is None:
            raise ValueError("save_adapter: this trainer has no LoRA adapters")
        out = decoders.save_peft(
            directory,
            self.config.decoder,
            self.config.lora,
            jax.device_get(self._params),
            base_model=str(self._source.get("path", "")),
        )
        return str(out)


def _check_int(name: str, value: Any, low: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"sample: {name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"sample: {name} must be >= {low}, got {value!r}")
    return int(value)
