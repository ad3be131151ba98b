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
