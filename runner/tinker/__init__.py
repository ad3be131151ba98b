"""`runner.tinker`: the Tinker API as a `runner.Trainer` backend (docs/tinker.md).

Built on the real ``tinker`` SDK (``tinker==0.38.0``, extra ``foldloss[tinker]``; no torch):
`TinkerTrainer` wraps a ``tinker.TrainingClient`` — hosted Tinker, a self-hosted engine serving
the Tinker API, or the local server (``python -m runner serve``) — converting runner ``Seq``s to
SDK ``Datum``s, running the builtin kernels Tinker documents and the fused client-loss path,
sampling through the SDK's ``SamplingClient``, and checkpointing with ``tinker://`` identities
that a resume verifies before loading (fail closed). `torch_loss_fn` is the optional bridge to
the SDK's own ``forward_backward_custom`` (needs torch).

The package loads lazily: importing it does not import the SDK; each name loads its module on
first use, so the local backend never imports the SDK.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "TinkerTrainer": "runner.tinker._trainer",
    "TinkerRequestError": "runner.tinker._trainer",
    "make_trainer": "runner.tinker._trainer",
    "connect": "runner.tinker._trainer",
    "BUILTIN_LOSSES": "runner.tinker._convert",
    "to_datums": "runner.tinker._convert",
    "loss_config": "runner.tinker._convert",
    "prompt_seed": "runner.tinker._seeds",
    "CALL_SEEDS": "runner.tinker._seeds",
    "validate_static": "runner.tinker._validate",
    "api_key_from_env": "runner.tinker._validate",
    "torch_loss_fn": "runner.fireworks._torch",
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
