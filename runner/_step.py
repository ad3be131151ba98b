"""Step planning and execution: builtin kernel when exact, else one fused client pass.

A *plan* says how one optimizer step's gradient is produced:

* ``builtin`` — a policy-only term that a server kernel expresses exactly
  (``losses.builtin_twin``): its reduction weights are folded into per-token advantages and the
  kernel runs in one pass (1F + 1B).
* ``client`` — anything else (an ECHO term, KL, a custom term): one fused client pass of the whole
  term (`ClientLoss`: 1 forward + 1 forward/backward = 2F + 1B; 1F + 1B with a precomputed
  forward).
* ``server`` — a term that decomposes per datum (`losses.Term.per_datum`: GRPO + ECHO, SFT, the
  policy family) on a trainer whose service runs custom losses itself
  (`runner._protocols.ServerSideLosses`: Tinker 0.38 custom-loss graphs, the local server): one
  server pass, 1F + 1B, no round trip. A policy-only term with an exact builtin kernel still runs
  on the kernel. When the server path is possible in principle but not taken, the metrics carry
  ``plan/reason/<code>`` = 1 (`SERVER_REASONS`).
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

import jax
import jax.numpy as jnp
import numpy as np

import losses
from runner._client_loss import ClientLoss, PassCounter
from runner._metrics import reduction
from runner._padding import CheckedSeqs, normalizers
from runner._protocols import ServerSideLosses, Trainer
from runner._types import AdamParams, Seq, validate_seqs

MODES = ("auto", "client", "builtin", "two_pass")
#: Why a step on a trainer with server-side losses did not run as one server pass
#: (``plan/reason/<code>`` metrics).
SERVER_REASONS = {
    "not_advertised": "the service does not advertise server-side custom losses",
    "not_per_datum": "the term is coupled across datums (no Term.per_datum)",
    "no_server_form": "the term's per-datum program has no server-side form",
    "forced": "a step mode other than auto",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a step runs. ``kernel``/``kernel_config`` name the builtin for the policy part."""

    path: str
    policy: Any = None
    kernel: str | None = None
    kernel_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    aux: tuple[tuple[str, Any], ...] = ()
    reason: str = ""
    all_targets_actions: bool = False
    #: A `SERVER_REASONS` key when a server pass was possible in principle but not taken.
    server_reason: str = ""


def _parts(term: Any) -> list[tuple[str, Any]]:
    """The non-zero parts of a (possibly folded) term, flattened one level."""
    parts = term.parts if isinstance(term, losses.Term) and term.parts else None
    if parts is not None:
        return [(n, t) for n, t in parts if not (isinstance(t, losses.Term) and t.is_zero)]
    return [(term.name if isinstance(term, losses.Term) else "term", term)]


def _data_weighted(term: Any) -> bool:
    """The term's gradient is a fixed per-token weight (`losses.Term.data_weights`)."""
    return isinstance(term, losses.Term) and term.data_weights is not None


def _twin(term: Any, supported: Sequence[str]) -> losses.Twin | None:
    twin = term.twin if isinstance(term, losses.Term) else None
    if twin is None or twin.kernel not in supported:
        return None
    return twin


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
    policy_parts = [(n, t) for n, t in parts if not _data_weighted(t)]
    aux_parts = [(n, t) for n, t in parts if _data_weighted(t)]
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
            kernel=twin.kernel,
            kernel_config=dict(twin.config),
            aux=tuple(aux_parts),
            reason="forced two-pass path",
            all_targets_actions=twin.all_targets_actions,
        )
    if twin is not None and not aux_parts:
        return Plan(
            path="builtin",
            policy=policy_parts[0][1],
            kernel=twin.kernel,
            kernel_config=dict(twin.config),
            reason=f"policy-only term expressed exactly by builtin '{twin.kernel}'",
            all_targets_actions=twin.all_targets_actions,
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


def _server_plan(plan: Plan, term: Any, trainer: Any, seqs: Sequence[Seq], mode: str) -> Plan:
    """``plan`` (a client plan) as a server pass where the trainer and the term allow it."""
    if mode != "auto":
        code = "forced"
    elif not trainer.server_side_losses:
        code = "not_advertised"
    elif getattr(term, "per_datum", None) is None:
        code = "not_per_datum"
    else:
        why = trainer.server_loss_unsupported(term, seqs)
        if why is None:
            return Plan(path="server", reason="the term decomposes per datum: one server pass")
        code = "no_server_form"
        plan = dataclasses.replace(plan, reason=f"{plan.reason}; {why}")
    return dataclasses.replace(plan, server_reason=code)


def datum_constants(term: Any, batch: losses.Batch) -> dict[str, float]:
    """The batch constants every datum carries to a server-side loss (`losses.per_datum_batch`):
    the normalizers and, for a batch-normalised correction, ``is_weight_mean``."""
    full = losses.per_datum_batch(term, batch)
    out = {}
    for name in losses.NORMALIZER_FIELDS + ("kl_baseline", "is_weight_mean"):
        value = getattr(full, name)
        if value is not None:
            out[name] = float(np.asarray(jax.device_get(value)))
    return out


def _builtin_inputs(plan: Plan, batch: losses.Batch) -> tuple[jax.Array, ...]:
    """The policy kernel's datum inputs and the auxiliary CE weights, as padded arrays.

    ``advantages`` = A × the policy term's reduction weights (0 off the action mask), the
    anchor ``old_logprobs`` as the datum ``logprobs`` (0 off the action mask), then one weight
    array per auxiliary term (`losses.Term.data_weights`).
    """
    cfg = plan.policy.config
    w = losses.term_weights(
        batch, "action", cfg.get("reduction", "token_sum"), cfg.get("max_tokens")
    )
    action = batch.action_mask > 0
    adv = jnp.asarray(batch.advantages)
    if adv.ndim == 1:
        adv = adv[:, None]
    folded = jnp.where(action, adv * w, 0.0)
    anchor = jnp.where(action, batch.old_logprobs, 0.0)
    aux = [term.data_weights(batch) for _, term in plan.aux]
    return folded, anchor, *aux


def _combine(parts: list[dict[str, float]], sizes: list[int]) -> dict[str, float]:
    """Merges per-micro-batch metrics by `runner._metrics.reduction`: losses and counts sum,
    maxima max, other metrics row-weighted mean."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    total = float(sum(sizes))
    for key in parts[0]:
        values = [p[key] for p in parts]
        how = reduction(key)
        if how == "sum":
            out[key] = float(sum(values))
        elif how == "max":
            out[key] = float(max(values))
        else:
            out[key] = float(sum(v * s for v, s in zip(values, sizes, strict=True)) / total)
    return out


class StepRunner:
    """Runs one optimizer step of a `losses` term on a `Trainer`, planned per `plan_step`.

    The step's data are validated once, where they enter (`accumulate`): the sequences'
    structure by `runner.validate_seqs`, their values by the rules of `losses.check_batch`
    inside the step's jitted call (`losses.any_violation`). The trainer calls of the step get
    `runner._padding.CheckedSeqs`, which trainers do not validate again.

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
        self._prepare: dict[int, Any] = {}

    def plan(self, trainer: Trainer, seqs: Sequence[Seq] = ()) -> Plan:
        plan = plan_step(self.term, supported=trainer.builtin_losses, mode=self.mode)
        if not isinstance(trainer, ServerSideLosses) or plan.path != "client":
            return plan
        return _server_plan(plan, self.term, trainer, seqs, self.mode)

    def accumulate(
        self,
        trainer: Trainer,
        seqs: Sequence[Seq],
        *,
        num_microbatches: int = 1,
        slices: Sequence[slice] | None = None,
        forward: Sequence[np.ndarray] | None = None,
    ) -> dict[str, float]:
        """Issues the step's passes (gradients accumulate on the trainer); no ``optim_step``.

        Args:
          trainer: any `Trainer`.
          seqs: the optimizer batch, each with the term's per-token inputs.
          num_microbatches: cut the batch into this many contiguous chunks (one pass set each);
            normalizers always span the whole batch, so the gradient does not change.
          slices: the micro-batches as contiguous row slices covering the batch in order (in
            place of ``num_microbatches``; e.g. the pipeline chunks of an RL step).
          forward: logprobs of ``seqs`` at the current weights (client path: skips its forward;
            the other paths do not use it).

        Returns:
          Metrics: the term's ``loss`` and metrics, ``path``-specific counters,
          ``passes/forwards``, ``passes/backwards``, ``plan/<path>`` = 1.

        Raises:
          ValueError: malformed sequences or values, before the trainer sees any of them (with
            micro-batches: before the first micro-batch whose values break a rule).
        """
        validate_seqs(seqs, required=("action_mask",))
        if num_microbatches > len(seqs):
            raise ValueError(f"num_microbatches={num_microbatches} exceeds {len(seqs)} sequences")
        if slices is not None:
            slices = list(slices)
            ends = [0] + [sl.stop for sl in slices]
            if (
                [sl.start for sl in slices] != ends[:-1]
                or ends[-1] != len(seqs)
                or any(sl.stop <= sl.start or sl.step not in (None, 1) for sl in slices)
            ):
                raise ValueError(
                    f"slices must be non-empty contiguous row ranges covering the {len(seqs)} "
                    f"sequences in order, got {slices}"
                )
        if forward is not None and len(forward) != len(seqs):
            raise ValueError(f"forward holds {len(forward)} rows for {len(seqs)} sequences")
        plan = self.plan(trainer, seqs)
        if plan.all_targets_actions and not all(np.all(s.inputs["action_mask"] > 0) for s in seqs):
            # e.g. the builtin dro applies its quadratic at every target: exact only if all are
            # actions.
            if self.mode != "auto":
                raise ValueError(
                    f"the builtin '{plan.kernel}' kernel is exact only when every target is an "
                    "action"
                )
            plan = Plan(path="client", reason=f"{plan.kernel} with non-action targets: client path")
        norms = normalizers(seqs)
        if slices is None:
            slices = (
                losses.row_slices(len(seqs), num_microbatches)
                if num_microbatches > 1
                else [slice(0, len(seqs))]
            )
        counter = PassCounter()
        parts, sizes = [], []
        for sl in slices:
            chunk = CheckedSeqs(seqs[sl])
            fwd = None if forward is None else list(forward[sl])
            if plan.path == "client":
                value, metrics = self.client(
                    trainer, chunk, forward=fwd, norms=norms, counter=counter, checked=True
                )
            elif plan.path == "server":
                value, metrics = self._server_pass(trainer, chunk, norms, counter)
            else:
                value, metrics = self._policy_passes(plan, trainer, chunk, norms, counter)
            metrics["loss"] = value
            parts.append(metrics)
            sizes.append(len(chunk))
        out = _combine(parts, sizes)
        out.update(counter.as_metrics())
        out[f"plan/{plan.path}"] = 1.0
        if plan.server_reason:
            out[f"plan/reason/{plan.server_reason}"] = 1.0
        return out

    def _server_pass(self, trainer, chunk, norms, counter):
        """One server pass of the term; its value and metrics from the logprobs the server
        used (a value-only jitted call, no extra pass), as on the builtin path."""
        batch = self.client.batch(chunk, norms)
        if jax.device_get(losses.any_violation(batch)):
            self.client.check(chunk, norms)  # raises, naming the entry
        constants = datum_constants(self.term, batch)
        result = trainer.forward_backward_term(self.term, chunk, constants)
        counter.forward_backward()
        value, metrics = self.client.value_and_metrics(result.logprobs, chunk, norms)
        metrics["server_loss"] = float(result.metrics.get("loss:sum", float("nan")))
        return value, metrics

    def _prepare_fn(self, plan: Plan):
        """The jitted kernel-input preparation of ``plan`` (with the batch's value check)."""
        key = id(plan.policy), tuple(id(t) for _, t in plan.aux)
        fn = self._prepare.get(key)
        if fn is None:

            def prepare(batch):
                return _builtin_inputs(plan, batch), losses.any_violation(batch)

            fn = self._prepare[key] = jax.jit(prepare)
        return fn

    def _policy_passes(self, plan, trainer, chunk, norms, counter):
        batch = self.client.batch(chunk, norms)
        arrays, bad = jax.device_get(self._prepare_fn(plan)(batch))
        if bad:
            self.client.check(chunk, norms)  # raises, naming the entry
        folded, anchor, *aux = (np.asarray(a) for a in arrays)
        lengths = [s.num_targets for s in chunk]
        policy_seqs = CheckedSeqs(
            [
                s.with_inputs(logprobs=anchor[i, :n], advantages=folded[i, :n])
                for i, (s, n) in enumerate(zip(chunk, lengths, strict=True))
            ],
            chunk.padded,
        )
        chunk.padded.update(logprobs=anchor, advantages=folded)
        result = trainer.forward_backward(policy_seqs, plan.kernel, plan.kernel_config)
        counter.forward_backward()
        server_loss = float(result.metrics.get("loss:sum", float("nan")))
        if result.logprobs:
            # The term's value and metrics from the logprobs the kernel saw (no extra pass, no
            # gradient: a value-only jitted call).
            value, metrics = self.client.value_and_metrics(result.logprobs, chunk, norms)
        else:  # a backend that returns no per-token logprobs: the kernel's loss is the term's
            value, metrics = server_loss, {}
        metrics["server_loss"] = server_loss
        for w in aux:
            ce = CheckedSeqs(
                [
                    s.with_inputs(weights=w[i, :n])
                    for i, (s, n) in enumerate(zip(chunk, lengths, strict=True))
                ],
                chunk.padded,
            )
            chunk.padded["weights"] = w
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
        slices: Sequence[slice] | None = None,
        forward: Sequence[np.ndarray] | None = None,
    ) -> dict[str, float]:
        """`accumulate` then ``optim_step(adam, normalization="none")``; merged metrics."""
        metrics = self.accumulate(
            trainer, seqs, num_microbatches=num_microbatches, slices=slices, forward=forward
        )
        opt = trainer.optim_step(adam, "none")
        metrics.update({f"optim/{k}": float(v) for k, v in opt.items()})
        return metrics
