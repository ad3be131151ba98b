"""Step planning and execution: builtin kernel when exact, else one fused client pass.

A *plan* says how one optimizer step's gradient is produced:

* ``builtin`` — a policy-only term that a server kernel expresses exactly
  (``losses.builtin_twin``): its reduction weights are folded into per-token advantages and the
  kernel runs in one pass (1F + 1B).
* ``client`` — anything else (an ECHO term, KL, a custom term): one fused client pass of the whole
  term (`ClientLoss`: 1 forward + 1 forward/backward = 2F + 1B; 1F + 1B with a precomputed
  forward).
* ``two_pass`` — on request only, the pre-fusion way: the builtin policy kernel plus one
  accumulated ``cross_entropy`` pass per data-weighted auxiliary term (``echo_env``,
  ``sft_cross_entropy``, ``weighted_cross_entropy``): 2F + 2B for one auxiliary term.

The runner owns normalization: every reduction is computed over the whole optimizer batch (all
micro-batches) and ``optim_step`` runs with ``normalization="none"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import losses
from runner._client_loss import ClientLoss, PassCounter
from runner._padding import normalizers
from runner._types import AdamParams, Seq, Trainer, validate_seqs

MODES = ("auto", "client", "builtin", "two_pass")
#: Terms whose gradient is a fixed per-token weight (data only): a CE pass reproduces them.
_DATA_WEIGHTED = ("echo_env", "sft_cross_entropy", "weighted_cross_entropy")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a step runs. ``kernel``/``kernel_config`` name the builtin for the policy part."""

    path: str
    policy: Any = None
    kernel: str | None = None
    kernel_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    aux: tuple[tuple[str, Any], ...] = ()
    reason: str = ""


def _parts(term: Any) -> list[tuple[str, Any]]:
    """The non-zero parts of a (possibly folded) term, flattened one level."""
    if getattr(term, "kind", None) == "fold":
        return [(n, t) for n, t in term.parts if not getattr(t, "is_zero", False)]
    return [(getattr(term, "name", "term"), term)]


def _twin(term: Any, supported: Sequence[str]) -> tuple[str, dict] | None:
    twin_fn = getattr(losses, "builtin_twin", None)
    if twin_fn is None:  # pragma: no cover - the losses package always has it
        return None
    twin = twin_fn(term)
    if twin is None or twin[0] not in supported:
        return None
    return twin[0], dict(twin[1])


def plan_step(term: Any, *, supported: Sequence[str], mode: str = "auto") -> Plan:
    """Chooses the path for ``term`` on a trainer whose builtin kernels are ``supported``.

    Args:
      term: a `losses` term or fold.
      supported: the trainer's builtin kernel names (``trainer.builtin_losses``).
      mode: ``"auto"`` (builtin when exact, else client), or force ``"client"``, ``"builtin"``
        (error if not exact) or ``"two_pass"`` (builtin policy + CE passes for data-weighted
        auxiliary terms; error if not possible).

    Returns:
      A `Plan`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown step mode {mode!r}; expected one of {MODES}")
    if mode == "client":
        return Plan(path="client", reason="forced client path")
    parts = _parts(term)
    policy_parts = [(n, t) for n, t in parts if getattr(t, "kind", None) not in _DATA_WEIGHTED]
    aux_parts = [(n, t) for n, t in parts if getattr(t, "kind", None) in _DATA_WEIGHTED]
    twin = _twin(policy_parts[0][1], supported) if len(policy_parts) == 1 else None
    if mode == "two_pass":
        if twin is None:
            raise ValueError(
                f"two_pass needs exactly one policy term with an exact builtin kernel among "
                f"{tuple(supported)}; got {[n for n, _ in policy_parts]}"
            )
        return Plan(
            path="two_pass",
            policy=policy_parts[0][1],
            kernel=twin[0],
            kernel_config=twin[1],
            aux=tuple(aux_parts),
            reason="forced two-pass path",
        )
    if twin is not None and not aux_parts:
        return Plan(
            path="builtin",
            policy=policy_parts[0][1],
            kernel=twin[0],
            kernel_config=twin[1],
            reason=f"policy-only term expressed exactly by builtin '{twin[0]}'",
        )
    if mode == "builtin":
        raise ValueError(
            "builtin path requested but the term is not a single policy term with an exact "
            f"builtin kernel among {tuple(supported)} (parts: {[n for n, _ in parts]})"
        )
    if aux_parts:
        reason = f"auxiliary terms {[n for n, _ in aux_parts]} fused into one client pass"
    elif len(policy_parts) != 1:
        reason = f"{len(policy_parts)} policy terms: one fused client pass"
    else:
        reason = "no exact builtin kernel for this term (KL, correction, custom, ...)"
    return Plan(path="client", reason=reason)


def _aux_weights(term: Any, batch: losses.Batch) -> np.ndarray:
    """Per-token CE weights of a data-weighted auxiliary term."""
    kind, cfg = term.kind, term.config
    if kind == "echo_env":
        w = losses.echo_env_weights(batch, coef=cfg["coef"], normalization=cfg["normalization"])
    elif kind == "sft_cross_entropy":
        w = losses.term_weights(batch, "action", cfg["reduction"], cfg["max_tokens"])
    else:
        w = batch.weights
    return np.asarray(w, dtype=np.float64)


def _builtin_seqs(plan: Plan, seqs: Sequence[Seq], batch: losses.Batch) -> list[Seq]:
    """Sequences for the policy kernel: advantages × reduction weights, the anchor as logprobs."""
    cfg = plan.policy.config
    w = np.asarray(
        losses.term_weights(
            batch, "action", cfg.get("reduction", "token_sum"), cfg.get("max_tokens")
        ),
        dtype=np.float64,
    )
    out = []
    for i, s in enumerate(seqs):
        n = s.num_targets
        mask = np.asarray(s.inputs["action_mask"], np.float64)
        adv = np.asarray(s.inputs["advantages"], np.float64)
        anchor = s.inputs.get("old_logprobs", s.inputs.get("sampling_logprobs"))
        if anchor is None:
            raise ValueError(f"sequence {i}: the builtin policy kernel needs 'sampling_logprobs'")
        anchor = np.where(mask > 0, np.asarray(anchor, np.float64), 0.0)
        out.append(s.with_inputs(logprobs=anchor, advantages=adv * w[i, :n] * (mask > 0)))
    return out


def _combine(parts: list[dict[str, float]], sizes: list[int]) -> dict[str, float]:
    """Merges per-micro-batch metrics: losses and counts sum, other metrics row-weighted mean."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    total = float(sum(sizes))
    for key in parts[0]:
        leaf = key.rsplit("/", 1)[-1]
        values = [p[key] for p in parts]
        if leaf.endswith("loss") or leaf.startswith(("num_", "rows_")):
            out[key] = float(sum(values))
        elif leaf.endswith("_max"):
            out[key] = float(max(values))
        else:
            out[key] = float(sum(v * s for v, s in zip(values, sizes, strict=True)) / total)
    return out


class StepRunner:
    """Runs one optimizer step of a `losses` term on a `Trainer`, planned per `plan_step`.

    Args:
      term: the loss term (e.g. ``losses.fold(losses.grpo(), losses.echo_env())``).
      mode: see `plan_step`.
      length_buckets: passed to `ClientLoss`.
      dtype: float dtype of the client-side batch.

    Attributes:
      client: the `ClientLoss` (its ``compile_count`` counts compilations).
    """

    def __init__(self, term: Any, *, mode: str = "auto", dtype: Any = np.float32, **client_kw):
        self.term = term
        self.mode = mode
        self.client = ClientLoss(term, dtype=dtype, **client_kw)
        self._evaluators: dict[int, ClientLoss] = {}

    def plan(self, trainer: Trainer) -> Plan:
        return plan_step(
            self.term, supported=getattr(trainer, "builtin_losses", ()), mode=self.mode
        )

    def accumulate(
        self,
        trainer: Trainer,
        seqs: Sequence[Seq],
        *,
        num_microbatches: int = 1,
        forward: Sequence[np.ndarray] | None = None,
    ) -> dict[str, float]:
        """Issues the step's passes (gradients accumulate on the trainer); no ``optim_step``.

        Args:
          trainer: any `Trainer`.
          seqs: the optimizer batch, each with the term's per-token inputs.
          num_microbatches: cut the batch into this many contiguous chunks (one pass set each);
            normalizers always span the whole batch, so the gradient does not change.
          forward: logprobs of ``seqs`` at the current weights (client path: skips its forward).

        Returns:
          Metrics: the term's ``loss`` and metrics, ``path``-specific counters,
          ``passes/forwards``, ``passes/backwards``, ``plan/<path>`` = 1.
        """
        validate_seqs(seqs, required=("action_mask",))
        plan = self.plan(trainer)
        if plan.kernel == "dro" and not all(np.all(s.inputs["action_mask"] > 0) for s in seqs):
            # The builtin dro applies its quadratic at every target; exact only if all are actions.
            if self.mode != "auto":
                raise ValueError(
                    "the builtin 'dro' kernel is exact only when every target is an action"
                )
            plan = Plan(path="client", reason="dro with non-action targets: client path")
        norms = normalizers(seqs)
        slices = (
            losses.row_slices(len(seqs), num_microbatches)
            if num_microbatches > 1
            else [slice(0, len(seqs))]
        )
        if num_microbatches > len(seqs):
            raise ValueError(f"num_microbatches={num_microbatches} exceeds {len(seqs)} sequences")
        counter = PassCounter()
        parts, sizes = [], []
        for sl in slices:
            chunk = list(seqs[sl])
            fwd = None if forward is None else list(forward[sl])
            if plan.path == "client":
                value, metrics = self.client(
                    trainer, chunk, forward=fwd, norms=norms, counter=counter
                )
            else:
                value, metrics = self._policy_passes(plan, trainer, chunk, norms, counter)
            metrics["loss"] = value
            parts.append(metrics)
            sizes.append(len(chunk))
        out = _combine(parts, sizes)
        out.update(counter.as_metrics())
        out[f"plan/{plan.path}"] = 1.0
        return out

    def _policy_passes(self, plan, trainer, chunk, norms, counter):
        batch = self.client.batch(chunk, norms)
        policy_seqs = _builtin_seqs(plan, chunk, batch)
        result = trainer.forward_backward(policy_seqs, plan.kernel, plan.kernel_config)
        counter.forward_backward()
        server_loss = float(result.metrics.get("loss:sum", float("nan")))
        if result.logprobs:
            # The term's value and metrics from the logprobs the kernel saw (no extra pass).
            value, metrics, _ = self.client.value_and_weights(result.logprobs, chunk, norms)
        else:  # a backend that returns no per-token logprobs: the kernel's loss is the term's
            value, metrics = server_loss, {}
        metrics["server_loss"] = server_loss
        for _name, aux in plan.aux:
            w = _aux_weights(aux, batch)
            ce = [s.with_inputs(weights=w[i, : s.num_targets]) for i, s in enumerate(chunk)]
            trainer.forward_backward(ce, "cross_entropy")
            counter.forward_backward()
        return value, metrics

    def step(
        self,
        trainer: Trainer,
        seqs: Sequence[Seq],
        adam: AdamParams,
        *,
        num_microbatches: int = 1,
        forward: Sequence[np.ndarray] | None = None,
    ) -> dict[str, float]:
        """`accumulate` then ``optim_step(adam, normalization="none")``; merged metrics."""
        metrics = self.accumulate(trainer, seqs, num_microbatches=num_microbatches, forward=forward)
        opt = trainer.optim_step(adam, "none")
        metrics.update({f"optim/{k}": float(v) for k, v in opt.items()})
        return metrics
