"""A trainer's capabilities as small Protocols, checked once when the trainer is built.

`Trainer` is what every step needs (the slice of the Fireworks training client the runner drives);
the rest are optional capabilities a backend may have:

- `Trainer` (field ``trainer``): ``forward``, ``forward_backward``, ``optim_step`` and the
  attribute ``builtin_losses`` — every backend;
- `Checkpointing` (``checkpointing``): ``save_state``, ``load_state``,
  ``save_weights_for_sampler`` — local, Fireworks;
- `Sampling` (``sampling``): ``sample`` — local, Fireworks;
- `RichCheckpoints` (``rich_checkpoints``): ``save_resumable``, ``load_resumable``,
  ``save_promotable`` — Fireworks (resolved control-plane identities);
- `LoadsWeights` (``loads_weights``): ``load_weights`` — local (the KL reference);
- `Finalizing` (``finalizing``): ``finalize(run_dir, manifest)`` — Fireworks (final promotion);
- `Closing` (``closing``): ``close`` — Fireworks (sampling client, service).

`capabilities` probes a trainer once (``isinstance`` against each Protocol) into a frozen
`Capabilities`; callers dispatch on its fields, and `require` fails early with a message naming
the missing capability and why the configuration needs it — never a ``hasattr`` at the point of
use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from runner._types import AdamParams, ForwardBackwardResult, Sample, Seq


@runtime_checkable
class Trainer(Protocol):
    """The slice of the Fireworks training client every step needs.

    Gradients accumulate across ``forward_backward`` calls until ``optim_step``, as on Fireworks.

    Attributes:
      builtin_losses: the builtin kernel names (`runner.BUILTIN_LOSSES`) this trainer runs; the
        step planner (`runner.plan_step`) routes a loss to a kernel only if it is listed here.
    """

    builtin_losses: tuple[str, ...]

    def forward(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per-target logprobs of each sequence (float32[N-1]) at the current weights."""
        ...

    def forward_backward(
        self, seqs: Sequence[Seq], loss_name: str, config: Mapping[str, Any] | None = None
    ) -> ForwardBackwardResult:
        """Runs a built-in kernel (`BUILTIN_LOSSES`) and accumulates its gradient."""
        ...

    def optim_step(self, adam: AdamParams, normalization: str | None = None) -> dict[str, float]:
        """Applies the accumulated gradient (normalized per `NORMALIZATIONS`), then resets it."""
        ...


@runtime_checkable
class Checkpointing(Protocol):
    """Resumable state and promotable weights by reference (the Fireworks client's methods)."""

    def save_state(self, name: str) -> str:
        """Saves resumable state (weights + optimizer); returns its reference."""
        ...

    def load_state(self, ref: str, with_optimizer: bool = True) -> None:
        """Loads weights (and the optimizer state when ``with_optimizer``) from a reference."""
        ...

    def save_weights_for_sampler(self, name: str) -> str:
        """Saves promotable inference weights; returns their reference."""
        ...


@runtime_checkable
class Sampling(Protocol):
    """Sampling completions from the current weights."""

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
    ) -> list[list[Sample]]:
        """``num_samples`` completions per prompt with their sampling logprobs."""
        ...


@runtime_checkable
class RichCheckpoints(Protocol):
    """Checkpoints with resolved identities (`runner.checkpoints` records them in manifests).

    A backend with these is saved and resumed through them instead of `Checkpointing`'s bare
    references (Fireworks resolves the control-plane row of each save).
    """

    def save_resumable(self, name: str) -> Mapping[str, Any]:
        """Saves resumable state; returns its identity (``checkpoint_name`` and more)."""
        ...

    def load_resumable(self, identity: Mapping[str, Any], *, with_optimizer: bool = True) -> None:
        """Resumes from an identity `save_resumable` returned (fail closed when unresolved)."""
        ...

    def save_promotable(self, name: str) -> Mapping[str, Any]:
        """Saves promotable inference weights; returns their identity."""
        ...


@runtime_checkable
class LoadsWeights(Protocol):
    """Loading sampler weights (no optimizer state), e.g. into the frozen KL reference."""

    def load_weights(self, path: str) -> None: ...


@runtime_checkable
class Finalizing(Protocol):
    """An end-of-run hook (a hosted backend's final promotion and cleanup)."""

    def finalize(self, run_dir: Path | str, last_manifest: Mapping[str, Any] | None) -> Any: ...


@runtime_checkable
class Closing(Protocol):
    """Resources to release when the runner that built the trainer is done with it."""

    def close(self) -> None: ...


@runtime_checkable
class ServerSideLosses(Protocol):
    """Runs a term that decomposes per datum (`losses.Term.per_datum`) as the server's own loss,
    in one pass (1 forward + 1 backward): Tinker 0.38 custom losses (`runner.tinker`).

    ``server_side_losses`` says whether the service advertises them (the SDK's client config);
    ``server_loss_unsupported(term, seqs)`` is ``None`` when the term can run this way, else the
    reason; ``forward_backward_term`` runs it, the gradient accumulating until ``optim_step``.
    The step planner (`runner._step.plan_step`) checks the capability once per step.
    """

    server_side_losses: bool

    def server_loss_unsupported(self, term: Any, seqs: Sequence[Seq]) -> str | None: ...

    def forward_backward_term(
        self, term: Any, seqs: Sequence[Seq], constants: Mapping[str, float]
    ) -> ForwardBackwardResult: ...


#: Capability (`Capabilities` field) name → its Protocol, in field order.
PROTOCOLS: dict[str, type] = {
    "trainer": Trainer,
    "checkpointing": Checkpointing,
    "sampling": Sampling,
    "rich_checkpoints": RichCheckpoints,
    "loads_weights": LoadsWeights,
    "finalizing": Finalizing,
    "closing": Closing,
}

_MEMBERS = {
    "trainer": ("forward", "forward_backward", "optim_step", "builtin_losses"),
    "checkpointing": ("save_state", "load_state", "save_weights_for_sampler"),
    "sampling": ("sample",),
    "rich_checkpoints": ("save_resumable", "load_resumable", "save_promotable"),
    "loads_weights": ("load_weights",),
    "finalizing": ("finalize",),
    "closing": ("close",),
}


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one trainer can do, probed once by `capabilities` (one flag per Protocol)."""

    trainer: bool = False
    checkpointing: bool = False
    sampling: bool = False
    rich_checkpoints: bool = False
    loads_weights: bool = False
    finalizing: bool = False
    closing: bool = False
    #: The probed trainer's type name (for error messages).
    type_name: str = "trainer"

    @property
    def can_checkpoint(self) -> bool:
        """Run-level checkpoints are possible (`Checkpointing` or `RichCheckpoints`)."""
        return self.checkpointing or self.rich_checkpoints

    def names(self) -> frozenset[str]:
        """The capability names this trainer has (`Capabilities` field names)."""
        return frozenset(name for name in PROTOCOLS if getattr(self, name))


def capabilities(trainer: Any) -> Capabilities:
    """Probes ``trainer`` once against every capability Protocol.

    A `Capabilities` passes through unchanged, so callers may take either.
    """
    if isinstance(trainer, Capabilities):
        return trainer
    flags = {name: isinstance(trainer, proto) for name, proto in PROTOCOLS.items()}
    return Capabilities(**flags, type_name=type(trainer).__name__)


def describe(name: str) -> str:
    """``"Sampling (sample)"``: a capability's Protocol and members, for messages."""
    return f"{PROTOCOLS[name].__name__} ({', '.join(_MEMBERS[name])})"


def require(trainer_or_caps: Any, *names: str | tuple[str, ...], why: str) -> Capabilities:
    """Checks that a trainer has every named capability; returns its `Capabilities`.

    Args:
      trainer_or_caps: a trainer or its `Capabilities`.
      names: `Capabilities` field names (``"sampling"``, ...); a tuple of names is satisfied by
        any one of them (``("checkpointing", "rich_checkpoints")``).
      why: what in the configuration needs them and why (ends the error message).

    Raises:
      ValueError: naming the trainer type, the first missing capability (its Protocol and
        members) and ``why``.
    """
    caps = capabilities(trainer_or_caps)
    for name in names:
        options = (name,) if isinstance(name, str) else tuple(name)
        for option in options:
            if option not in PROTOCOLS:
                raise ValueError(
                    f"unknown capability {option!r}; expected one of {sorted(PROTOCOLS)}"
                )
        if not any(getattr(caps, option) for option in options):
            wanted = " or ".join(describe(option) for option in options)
            raise ValueError(f"the trainer ({caps.type_name}) lacks the {wanted} capability: {why}")
    return caps
