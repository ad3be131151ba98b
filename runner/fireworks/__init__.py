"""`runner.fireworks`: the hosted Fireworks trainer as a `runner.Trainer` backend (docs/fireworks.md).

Built on the real ``fireworks-ai`` training SDK (``fireworks.training.sdk``, extra
``foldloss[fireworks]``) and free of torch: `FireworksTrainer` wraps a ``FiretitanTrainingClient``
(runner ``Seq``s become SDK ``Datum``s of float32/int64 numpy arrays), runs the builtin kernels and
the fused client-loss path, owns normalization (``optim_step`` with the SDK's explicit
``GradAccNormalization.NONE``), samples through a hot-loaded deployment, and implements the
checkpoint contract (identity resolution against the control plane, cross-job resume, promotion
before trainer deletion). `torch_loss_fn` is the optional bridge to the SDK's own
``forward_backward_custom``.

The package loads lazily: importing it does not import the SDK (or torch); each name below loads
its module on first use, so the local backend never imports the SDK.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "FireworksTrainer": "runner.fireworks._trainer",
    "FireworksRequestError": "runner.fireworks._trainer",
    "make_trainer": "runner.fireworks._trainer",
    "prompt_seed": "runner.fireworks._seeds",
    "sample_seed": "runner.fireworks._seeds",
    "BUILTIN_LOSSES": "runner.fireworks._convert",
    "LOSS_CONFIG_KEYS": "runner.fireworks._convert",
    "OPT_IN_LOSSES": "runner.fireworks._convert",
    "to_datum": "runner.fireworks._convert",
    "to_datums": "runner.fireworks._convert",
    "builtin_config": "runner.fireworks._convert",
    "torch_loss_fn": "runner.fireworks._torch",
    "is_vision_model": "runner.fireworks._validate",
    "check_text_only": "runner.fireworks._validate",
    "validate_static": "runner.fireworks._validate",
    "api_key_from_env": "runner.fireworks._validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted((*globals(), *__all__))
