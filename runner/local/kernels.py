"""The local trainer's side of the built-in kernels: config policy, padded batch, metrics.

The kernels themselves — inputs, ``loss_fn_config`` keys, defaults, provenance and the `losses`
term of each — are the one kernel table, `runner._kernels`; the local trainer runs every kernel in
it (`SUPPORTED`) as its term with ``reduction="token_sum"``. The trainer builds a padded
`losses.Batch` with ``action_mask = 1`` on every real target position of every sequence (0 on
padding), ``advantages`` and ``sampling_logprobs = q`` (or ``weights``), so the term is exactly
the kernel's raw sum over all target tokens of all sequences (docs/training-api.md#builtin-kernels).

Local specifics on top of the table's validation (`runner._kernels.resolve_config`, shared with
every backend): ``target_logprob_support`` must be ``full_vocabulary`` (the local trainer computes
full-vocabulary logprobs only), and ``reinforce`` rejects ``score_centering=True`` (the server's
score centering is undocumented).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import losses
from runner._kernels import (
    KERNEL_NAMES,
    KERNELS,
    KernelSpec,
    check_kernel_inputs,
    resolve_config,
    supported,
)
from runner._metrics import reduction
from runner._padding import CheckedSeqs, pad_ragged
from runner._types import Seq

__all__ = [
    "KERNELS",
    "SUPPORTED",
    "build_batch",
    "check_inputs",
    "linear_gradient",
    "resolve",
    "server_metrics",
    "term",
]

#: The kernels the local trainer runs: the whole table (`LocalTrainer.builtin_losses`).
SUPPORTED = supported(*KERNEL_NAMES)


def resolve(loss_name: str, config: Mapping[str, Any] | None) -> tuple[KernelSpec, tuple]:
    """Validates a kernel name and its config; returns the kernel and the full frozen config.

    Raises:
      ValueError: unknown kernel, unknown key or bad value (`runner._kernels.resolve_config`,
        the same rules as every backend), or a valid value the local trainer cannot compute.
    """
    full = resolve_config(loss_name, config)
    support = full["target_logprob_support"]
    if support != "full_vocabulary":
        raise ValueError(
            f"{loss_name}: target_logprob_support={support!r} is not supported: the local "
            "trainer computes full-vocabulary logprobs only"
        )
    if full.get("score_centering"):
        raise ValueError(
            f"{loss_name}: score_centering=True is not supported by the local trainer (the "
            "server's score centering is undocumented)"
        )
    return KERNELS[loss_name], tuple(sorted(full.items()))


def term(kernel_name: str, frozen: tuple) -> losses.Term:
    """The kernel's `losses` term for a config frozen by `resolve`."""
    return KERNELS[kernel_name].term(dict(frozen))


#: Entries kept by each memoized jit factory of the local trainer (and by `linear_gradient`): one
#: per (model, kernel configuration, sharding, ...) key. A long-lived server meets new keys for as
#: long as it runs; beyond this many, the least recently used factory result is dropped, and its
#: compiled executables with it.
JIT_CACHE_SIZE = 64


@functools.lru_cache(maxsize=JIT_CACHE_SIZE)
def linear_gradient(kernel_name: str, frozen: tuple) -> Callable[[losses.Batch], Any] | None:
    """``batch -> dL/dlogprobs[B, T]`` for a kernel whose term is linear in the logprobs, else
    ``None``.

    Linear means a gradient fixed by the data alone (`losses.Term.data_weights`: ``L = Σ
    w·(-logp)``, the ``cross_entropy`` kernel). The function returns the term's own gradient,
    taken at ``logp = 0`` (the same array as at any logprobs), so the trainer knows it before the
    model's forward and runs its fused head (`runner.local.models.DecoderArch.linear_loss`).
    """
    t = term(kernel_name, frozen)
    if t.data_weights is None:
        return None

    def gradient(batch: losses.Batch):
        zeros = jnp.zeros(batch.action_mask.shape, batch.action_mask.dtype)
        return jax.grad(lambda lp: t.fn(lp, batch)[0])(zeros)

    return gradient


def check_inputs(kernel: KernelSpec, seqs: Sequence[Seq]) -> None:
    """Kernel-specific input checks (after `runner.validate_seqs`); raises ``ValueError``.

    See `runner._kernels.check_kernel_inputs` (shared with the Fireworks backend).
    """
    check_kernel_inputs(seqs, kernel.inputs, kernel.name)


def build_batch(kernel: KernelSpec, seqs: Sequence[Seq], rows: int, width: int, dtype) -> dict:
    """Host-side padded arrays for `losses.Batch` (``[rows, width]``, model dtype).

    ``action_mask`` is 1 on every real target of every sequence; ``weights`` (cross_entropy) or
    ``advantages`` and ``sampling_logprobs`` (RL kernels) are the Seq inputs, 0 on padding. The
    runner's `CheckedSeqs` carry these inputs already padded in the same bucket (the client
    loss's weights, the folded advantages): they are used as they are, not padded again.
    """
    n = np.fromiter((s.num_targets for s in seqs), np.int64, len(seqs))
    mask = np.zeros((rows, width), dtype)
    mask[: len(seqs)] = np.arange(width)[None, :] < n[:, None]
    given = seqs.padded if isinstance(seqs, CheckedSeqs) else {}
    arrays = {}
    for name in kernel.inputs:
        buf = given.get(name)
        if isinstance(buf, np.ndarray) and buf.shape == (rows, width) and buf.dtype == dtype:
            arrays[name] = buf
        else:
            arrays[name] = pad_ragged([s.inputs[name] for s in seqs], width, rows, dtype)
    fields = {"action_mask": mask}
    if kernel.inputs == ("weights",):
        fields["weights"] = arrays["weights"]
    else:
        fields["advantages"] = arrays["advantages"]
        fields["sampling_logprobs"] = arrays["logprobs"]
    return fields


def server_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Term metrics as Fireworks-style ``name:reduction`` keys (``loss`` → ``loss:sum``; the
    reduction is `runner._metrics.reduction`'s)."""
    out = {}
    for key, value in metrics.items():
        out[f"{key}:{reduction(key)}"] = float(value)
    return out
