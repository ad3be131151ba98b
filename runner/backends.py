"""The trainer backends: one registry, `BACKENDS`, of `Backend` objects.

A backend says how its trainer is built from a run's config, which static config rules it adds
(checked at config load, before any work and without importing an SDK) and what it supports.
`runner.config` validates ``[run].backend`` against it, `runner.train.make_trainer` builds the
trainer through it, and the CLI offers its names: adding a backend is one entry here.

* ``local``: the embedded JAX trainer (`runner.local.LocalTrainer`), built in this process from
  ``[model]`` and the tokenizer's vocabulary.
* ``fireworks``, ``tinker``: hosted trainers through their SDKs (`runner.fireworks`,
  `runner.tinker`); the model lives on the service.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any


def _load(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One trainer backend.

    Attributes:
      name: the ``[run].backend`` value.
      trainer: ``"module:function"``, the ``make_trainer(cfg, run_dir)`` that builds its trainer
        (imported only when a trainer is built).
      rules: ``"module:function"``, the backend's static config rules (``f(cfg)`` raising
        ``ValueError`` naming the key), or ``None``.
      in_process: the trainer is built here from ``[model]`` (the local trainer): the ``[model]``
        section and the checkpoint's vocabulary are checked at config load, and a frozen copy
        of the policy can serve as the KL reference.
    """

    name: str
    trainer: str
    rules: str | None = None
    in_process: bool = False

    def make_trainer(self, cfg: Any, run_dir: Path) -> Any:
        """The trainer of a run whose outputs go to ``run_dir``."""
        return _load(self.trainer)(cfg, run_dir)

    def validate(self, cfg: Any) -> None:
        """The backend's static config rules (nothing for a backend without any)."""
        if self.rules is not None:
            _load(self.rules)(cfg)


def local_trainer_config_of(cfg: Any, checkpoint_dir: str | None) -> Any:
    """The `runner.local.LocalTrainerConfig` that ``--backend local`` builds from a run's
    config: its ``[model]``, its tokenizer's vocabulary, ``[run].seed`` as the initialization
    seed (the local server's models of a main-job config start from the same one)."""
    from runner.job import build_tokenizer
    from runner.local import local_trainer_config

    return local_trainer_config(
        cfg.model,
        vocab_size=build_tokenizer(cfg).vocab_size,
        seed=cfg.run.seed,
        checkpoint_dir=checkpoint_dir,
    )


def make_local_trainer(cfg: Any, run_dir: Path) -> Any:
    """``--backend local``: a `runner.local.LocalTrainer` checkpointing under
    ``run_dir/trainer``."""
    from runner.local import LocalTrainer

    return LocalTrainer(local_trainer_config_of(cfg, str(Path(run_dir) / "trainer")))


#: Every backend, by name; the first is the default.
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("local", "runner.backends:make_local_trainer", in_process=True),
        Backend(
            "fireworks",
            "runner.fireworks._trainer:make_trainer",
            rules="runner.fireworks._validate:validate_static",
        ),
        Backend(
            "tinker",
            "runner.tinker._trainer:make_trainer",
            rules="runner.tinker._validate:validate_static",
        ),
    )
}
#: The ``[run].backend`` values (the CLI's ``--backend`` choices).
NAMES = tuple(BACKENDS)


def backend(name: str) -> Backend:
    """The backend called ``name``.

    Raises:
      ValueError: naming ``[run].backend`` and the choices.
    """
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"config [run].backend must be one of {NAMES}, got {name!r}") from None
