"""Cached jitted evaluation of terms, so hypothesis examples of one shape compile once."""

from __future__ import annotations

import functools

import jax
import numpy as np

import losses
from tests.strategies import ENV_CONFIGS, GRPO_CONFIGS, SFT_CONFIGS

_CTORS = {
    "grpo": losses.grpo,
    "echo_env": losses.echo_env,
    "sft": losses.sft_cross_entropy,
    "wce": losses.weighted_cross_entropy,
    "fold": lambda **cfg: losses.fold(losses.grpo(**cfg), losses.echo_env(coef=0.3)),
}

#: (kind, config) cases that every generic property runs over.
ALL_TERMS = (
    [("grpo", c) for c in GRPO_CONFIGS]
    + [("echo_env", c) for c in ENV_CONFIGS]
    + [("sft", c) for c in SFT_CONFIGS]
    + [("wce", {}), ("fold", dict(kl_coef=0.1, reduction="seq_mean_token_mean"))]
)


def freeze(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


@functools.cache
def term(kind: str, frozen_cfg: tuple = ()):
    return _CTORS[kind](**dict(frozen_cfg))


@functools.cache
def _vg(kind: str, frozen_cfg: tuple):
    t = term(kind, frozen_cfg)
    return jax.jit(jax.value_and_grad(lambda lp, b: t(lp, b), has_aux=True))


def value_and_grad(kind: str, cfg: dict, lp, batch):
    """((value, metrics), grad) of the cached jitted term, as numpy."""
    (value, metrics), grad = _vg(kind, freeze(cfg))(lp, batch)
    return (float(value), {k: float(v) for k, v in metrics.items()}), np.asarray(grad)


def value_and_grad_fn(fn):
    return jax.jit(jax.value_and_grad(lambda lp, b: fn(lp, b), has_aux=True))


def multi_turn_seqs(trainer, rng, *, n, vocab, lengths, obs_max, with_ref=False):
    """Synthetic rows ``[prompt][action][obs][wrapper][action]...`` as `runner.Seq`s.

    Sampling logprobs are the trainer's current logprobs plus noise (so ratios are near 1 with
    some clipping); the forward used to get them is not counted in ``trainer.counters``.
    """
    from runner import Seq

    raw = []
    for _ in range(n):
        length = int(rng.integers(*lengths))
        tokens = rng.integers(0, vocab, length).astype(np.int64)
        kind = np.zeros(length - 1, int)
        t = int(rng.integers(3, 6))
        while t < length - 1:
            a = int(rng.integers(2, 6))
            kind[t : t + a] = 1
            t += a
            o = int(rng.integers(1, obs_max))
            kind[t : t + o] = 2
            t += o + 1  # one wrapper token in neither mask
        raw.append((tokens, kind))
    counters = dict(getattr(trainer, "counters", {}))
    fwd = trainer.forward([Seq(t) for t, _ in raw])
    if counters:
        trainer.counters.update(counters)
    seqs = []
    for (tokens, kind), lp in zip(raw, fwd, strict=True):
        action = (kind == 1).astype(np.float64)
        lp = np.asarray(lp, np.float64)
        inputs = dict(
            action_mask=action,
            obs_mask=(kind == 2).astype(np.float64),
            advantages=float(rng.normal()) * action,
            sampling_logprobs=np.minimum(lp + rng.normal(0.0, 0.3, lp.shape), 0.0) * action,
        )
        if with_ref:
            inputs["ref_logprobs"] = np.minimum(lp - 0.1, 0.0) * action
        seqs.append(Seq(tokens, inputs))
    return seqs
