"""`TinkerTrainer`: a `runner.Trainer` on the tinker SDK's ``TrainingClient`` (docs/tinker.md).

Passes: ``forward`` = 1F (a ``forward_only`` ``cross_entropy`` call with all-zero weights, as the
SDK's own custom-loss forward); ``forward_backward`` = 1F + 1B. A builtin-kernel step is one
``forward_backward``; a fused client step (`runner.ClientLoss`) is one ``forward`` plus one
linear ``cross_entropy`` ``forward_backward`` with ``weights = -dL/dlogp`` — never the SDK's
torch ``forward_backward_custom``. The runner owns normalization: Tinker's ``optim_step`` has no
normalization option, so ``optim_step`` takes only ``"none"`` (the step planner folds every
reduction into the per-token weights and always sends ``"none"``).

Sampling goes through the SDK's ``SamplingClient`` of the current weights
(``save_weights_and_get_sampling_client``, once per weights version); prompt ``i`` of a call
samples with the int32 ``seed = prompt_seed(seed, i, num_samples)`` (`runner._seeds`) and the
integer stop tokens are passed through.

Checkpoints: `save_resumable` saves the state (``tinker://<run>/weights/<name>``) and resolves its
identity in the run's checkpoint listing (its creation time); `save_promotable` saves sampler
weights (``tinker://<run>/sampler_weights/<name>``); the manifest records the two separately.
`load_resumable` fails closed: another backend's record, another base model, an edited path, a
resolved checkpoint that is gone or was replaced (another creation time) are refused before
anything is loaded; the state is loaded into a new training client (create-via-load, with the
optimizer state). The API key is used to connect and never stored, logged or written.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from tinker import types

from runner._hosted import COUNTERS as HOSTED_COUNTERS
from runner._hosted import as_seq_list as _as_list
from runner._hosted import check_sample_args, float_metrics
from runner._hosted import to_sample as _to_sample
from runner._net import ServiceUnreachable, in_daemon_thread, probe, wait_result
from runner._padding import CheckedSeqs
from runner._semantics import (
    PROBE_ADAM,
    PROBED,
    SemanticsError,
    check_reported_loss,
    probe_seqs,
    probe_verdict,
    with_logprobs,
)
from runner._types import AdamParams, ForwardBackwardResult, Sample, Seq
from runner.checkpoints import CheckpointError
from runner.tinker._convert import (
    BUILTIN_LOSSES,
    KERNEL_INPUTS,
    ModelInputCache,
    loss_config,
    output_logprobs,
    to_datums,
)
from runner.tinker._custom_loss import SessionLosses
from runner.tinker._seeds import prompt_seed
from runner.tinker._validate import api_key_from_env, validate_static

log = logging.getLogger("runner.tinker")
#: The SDK logs a warning per ``try_again``; without a handler configured by the user, Python
#: would print each on stderr. The library convention: a NullHandler (the user's logging
#: configuration still receives them).
logging.getLogger("tinker").addHandler(logging.NullHandler())

CHECKPOINT_KIND = "tinker_state"


class TinkerRequestError(ValueError):
    """A Tinker request failed or timed out (one line: what, where, why; never the key)."""


class TinkerTrainer:
    """The Tinker API (hosted, self-hosted engine, or `python -m runner serve`) as a Trainer.

    Args:
      client: a ``tinker.TrainingClient``.
      service: the ``tinker.ServiceClient`` that created it (create-via-load on `load_state`;
        closed by `close`).
      base_model: the model's base model (recorded in manifests, checked on resume).
      rest: a ``tinker.RestClient`` for the checkpoint listing (identity resolution); None
        leaves identities unresolved.
      base_url: the service URL (for messages).
      max_seq_len: the model-input length limit (checked before sending).
      request_timeout_s: how long to wait for any one result.
      close_timeout_s: how long `close` waits for the session to finish.
      builtin_losses: the kernels the step planner may use (default `BUILTIN_LOSSES`).
      verify: check the server's loss semantics (`runner._semantics`): every ``cross_entropy``
        call whose ``loss:sum`` and logprobs come back; and, the first time a kernel's call
        comes back without ``loss:sum``, that kernel's probe on a scratch client of
        ``lora_rank`` (before any ``optim_step``).
      lora_rank: the scratch client's LoRA rank.

    Attributes:
      builtin_losses: kernel names for `runner.plan_step`.
      counters: SDK calls issued (``forward``, ``forward_backward``, ``optim_step``, ``sample``
        per prompt, ``sampler_sync``, ``save_state``, ``save_sampler``, ``load_state``).
    """

    def __init__(
        self,
        client: Any,
        *,
        service: Any = None,
        base_model: str,
        rest: Any = None,
        base_url: str = "",
        max_seq_len: int | None = None,
        request_timeout_s: float = 300.0,
        close_timeout_s: float = 5.0,
        builtin_losses: Sequence[str] | None = None,
        verify: bool = True,
        lora_rank: int = 8,
    ) -> None:
        if not isinstance(base_model, str) or not base_model.strip():
            raise ValueError("TinkerTrainer: base_model is required")
        losses_ = tuple(BUILTIN_LOSSES if builtin_losses is None else builtin_losses)
        unknown = sorted(set(losses_) - set(BUILTIN_LOSSES))
        if unknown:
            raise ValueError(
                f"TinkerTrainer: unsupported builtin losses {unknown}; Tinker documents "
                f"{BUILTIN_LOSSES}"
            )
        self.builtin_losses = losses_
        self.client = client
        self.service = service
        self.rest = rest
        self.base_model = base_model
        self.base_url = base_url
        self.max_seq_len = max_seq_len
        self.request_timeout_s = float(request_timeout_s)
        self.close_timeout_s = float(close_timeout_s)
        self.counters = dict.fromkeys(HOSTED_COUNTERS, 0)
        self._model_inputs = ModelInputCache()
        self._lock = threading.RLock()
        self._sampler: Any = None
        self._sampler_version = -1
        self._weights_version = 0
        self._failed = False
        self._closed = False
        self._losses = SessionLosses(service)
        self.verify = bool(verify)
        self.lora_rank = int(lora_rank)
        self._probed: set[str] = set()
        self._scratch: TinkerTrainer | None = None

    def __repr__(self) -> str:
        model_id = getattr(self.client, "model_id", None)
        return f"TinkerTrainer(base_model={self.base_model!r}, model_id={model_id!r})"

    @property
    def model_id(self) -> str | None:
        return getattr(self.client, "model_id", None)

    # -- futures ------------------------------------------------------------------------------

    def _result(self, future: Any, what: str) -> Any:
        """The future's result; any failure becomes one `TinkerRequestError` line."""
        try:
            return wait_result(
                future,
                timeout_s=self.request_timeout_s,
                what=what,
                url=self.base_url,
                setting="[tinker].request_timeout_s",
            )
        except concurrent.futures.TimeoutError:
            self._cancel(future)
            raise self._error(
                f"{what}: no result within [tinker].request_timeout_s = "
                f"{self.request_timeout_s:g} s (the service may be down or overloaded)"
            ) from None
        except ServiceUnreachable as exc:
            self._cancel(future)
            raise self._error(str(exc)) from None
        except tinker.RequestFailedError as exc:
            raise self._error(
                f"{what} failed ({exc.category} error): {_first_line(exc.message)}"
            ) from None
        except tinker.APIStatusError as exc:
            raise self._error(f"{what}: HTTP {exc.status_code}: {_first_line(str(exc))}") from None
        except tinker.APIConnectionError as exc:
            raise self._error(f"{what}: connection failed: {_first_line(str(exc))}") from None
        except Exception as exc:  # noqa: BLE001 - e.g. "Promise expired/broken" (HTTP 410)
            raise self._error(f"{what}: {type(exc).__name__}: {_first_line(str(exc))}") from None

    def _error(self, message: str) -> TinkerRequestError:
        self._failed = True
        where = f" ({self.base_url})" if self.base_url else ""
        return TinkerRequestError(f"Tinker{where}: {message}")

    @staticmethod
    def _cancel(future: Any) -> None:
        try:
            future.future().cancel()  # stop the SDK's background polling
        except Exception:  # noqa: BLE001 - best effort
            pass

    # -- training -----------------------------------------------------------------------------

    def forward(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per-target float32 logprobs at the current weights (a ``forward_only`` pass).

        Datums carry ``target_tokens`` and all-zero ``weights``; other inputs attached to the
        sequences are ignored.
        """
        checked = isinstance(seqs, CheckedSeqs)
        plain = [s.with_inputs() if s.inputs else s for s in _as_list(seqs)]
        zero = [s.with_inputs(weights=np.zeros(s.num_targets, np.float32)) for s in plain]
        datums = to_datums(
            CheckedSeqs(zero) if checked else zero,
            ("weights",),
            max_seq_len=self.max_seq_len,
            cache=self._model_inputs,
        )
        out = self._result(self.client.forward(datums, "cross_entropy"), "forward")
        self.counters["forward"] += 1
        return output_logprobs(out, plain, required=True)

    def forward_backward(
        self, seqs: Sequence[Seq], loss_name: str, config: Mapping[str, Any] | None = None
    ) -> ForwardBackwardResult:
        """Runs a builtin kernel; the gradient accumulates until `optim_step`.

        Inputs: ``cross_entropy`` ← ``weights``; the policy kernels ← ``logprobs`` (the anchor)
        and ``advantages`` (per token). ``config``: the kernel table's keys and rules
        (`runner._kernels.resolve_config`); only the keys given are sent.

        Returns:
          Per-sequence logprobs (``[]`` if the service sends none) and the service's metrics
          (``loss:sum`` is the kernel's raw token sum).
        """
        if loss_name not in self.builtin_losses:
            raise ValueError(f"unknown loss {loss_name!r}; expected one of {self.builtin_losses}")
        cfg = loss_config(loss_name, config)
        datums = to_datums(
            _as_list(seqs),
            KERNEL_INPUTS[loss_name],
            loss_name=loss_name,
            max_seq_len=self.max_seq_len,
            cache=self._model_inputs,
        )
        future = self.client.forward_backward(datums, loss_name, cfg or None)
        out = self._result(future, f"forward_backward({loss_name})")
        self.counters["forward_backward"] += 1
        result = ForwardBackwardResult(
            logprobs=output_logprobs(out, seqs, required=False),
            metrics=float_metrics(out.metrics),
        )
        if self.verify:
            self._verify(loss_name, _as_list(seqs), result)
        return result

    def _verify(self, loss_name: str, seqs: list[Seq], result: ForwardBackwardResult) -> None:
        """The per-call check of ``cross_entropy``, else (no ``loss:sum``) the kernel's probe."""
        try:
            if loss_name == "cross_entropy" and check_reported_loss(
                seqs, result.logprobs, result.metrics
            ):
                return
        except SemanticsError as exc:
            raise self._error(str(exc)) from None
        if "loss:sum" in result.metrics and loss_name != "cross_entropy":
            return  # a reported kernel loss: the kernel table's semantics (docs/tinker.md)
        if loss_name not in PROBED:
            raise self._error(
                f"forward_backward({loss_name}) returned no loss:sum and {loss_name}'s "
                f"normalisation cannot be probed (only {sorted(PROBED)}): refusing to train on "
                "an unverified gradient ([rl].mode = 'client' sends cross_entropy instead)"
            )
        self.probe(loss_name)

    def probe(self, loss_name: str) -> None:
        """Once per kernel: its probe (`runner._semantics`) on a scratch LoRA client of the same
        base model; the trained model is untouched (call it before its ``optim_step``).

        Raises:
          TinkerRequestError: one line naming the service, what was expected and what it did.
        """
        if loss_name in self._probed or self.service is None:
            return
        self._probed.add(loss_name)
        if self._scratch is None:
            future = _submit(
                self.service.create_lora_training_client,
                self.base_model,
                rank=self.lora_rank,
                seed=0,
                train_unembed=False,
            )
            self._scratch = TinkerTrainer(
                self._result(future, f"{loss_name} probe: a scratch training client"),
                base_model=self.base_model,
                base_url=self.base_url,
                request_timeout_s=self.request_timeout_s,
                verify=False,
            )
        scratch = self._scratch
        cancel, control = probe_seqs(loss_name)
        before = scratch.forward(cancel)
        scratch.forward_backward(with_logprobs(cancel, before, loss_name), loss_name)
        scratch.optim_step(PROBE_ADAM)
        mid = scratch.forward(cancel)
        scratch.forward_backward(with_logprobs(control, mid[:1], loss_name), loss_name)
        scratch.optim_step(PROBE_ADAM)
        after = scratch.forward(cancel[:1])
        try:
            probe_verdict(loss_name, before[0], mid[0], after[0])
        except SemanticsError as exc:
            raise self._error(str(exc)) from None

    # -- server-side custom losses (`runner._protocols.ServerSideLosses`) ----------------------

    @property
    def server_side_losses(self) -> bool:
        """The service runs custom losses itself (``custom_loss_server_side``; needs torch)."""
        return self._losses.advertised

    def server_loss_unsupported(self, term: Any, seqs: Sequence[Seq]) -> str | None:
        """``None`` if ``term`` compiles to a custom loss for these sequences' fields."""
        return self._losses.unsupported(term, seqs)

    def forward_backward_term(
        self, term: Any, seqs: Sequence[Seq], constants: Mapping[str, float]
    ) -> ForwardBackwardResult:
        """One server pass of a per-datum term (`runner.tinker._custom_loss`): the loss is
        created once per session (``create_custom_loss``), then ``forward_backward_custom(data,
        handle)`` runs it on the server: 1 forward + 1 backward, the gradient accumulating."""
        seqs = _as_list(seqs)
        ct = self._losses.compiled_for(term, seqs)
        handle = self._losses.handle(ct)
        datums = self._losses.datums(
            ct, seqs, constants, max_seq_len=self.max_seq_len, cache=self._model_inputs
        )
        out = self._result(
            self.client.forward_backward_custom(datums, handle), "forward_backward_custom"
        )
        self.counters["forward_backward"] += 1
        return ForwardBackwardResult(
            logprobs=output_logprobs(out, seqs, required=True),
            metrics=float_metrics(out.metrics),
        )

    def optim_step(self, adam: AdamParams, normalization: str | None = None) -> dict[str, float]:
        """One Adam(W) step on the accumulated gradient (``torch.optim.AdamW`` semantics).

        Tinker's ``optim_step`` has no normalization option: only ``None``/``"none"`` are
        accepted (the runner normalizes by folding reduction weights into the data).
        """
        if not isinstance(adam, AdamParams):
            raise ValueError(f"optim_step: adam must be a runner.AdamParams, got {adam!r}")
        if normalization not in (None, "none"):
            raise ValueError(
                f"optim_step: normalization {normalization!r} is not available on Tinker (its "
                "optim_step has no normalization option); the runner normalizes on the client "
                "and sends 'none'"
            )
        params = types.AdamParams(
            learning_rate=adam.learning_rate,
            beta1=adam.beta1,
            beta2=adam.beta2,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm,
        )
        out = self._result(self.client.optim_step(params), "optim_step")
        self.counters["optim_step"] += 1
        self._weights_version += 1
        return float_metrics(out.metrics)

    # -- sampling -----------------------------------------------------------------------------

    def _current_sampler(self) -> Any:
        with self._lock:
            if self._sampler is None or self._sampler_version != self._weights_version:
                future = _submit(self.client.save_weights_and_get_sampling_client)
                self._sampler = self._result(future, "save_weights_and_get_sampling_client")
                self._sampler_version = self._weights_version
                self.counters["sampler_sync"] += 1
            return self._sampler

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
        """``num_samples`` completions per prompt at the current weights.

        Every prompt is submitted (the last one first) before any result is awaited; prompt
        ``i`` samples with the int32 ``seed = prompt_seed(seed, i, num_samples)``
        (`runner._seeds`); ``stop_token_ids`` go to the service as integer stop tokens (an
        empty list: no stop token, not even an implicit EOS), and each completion is also cut
        after its first stop token (kept, ``stop_reason="stop"``) in case a service
        generates past it.

        Returns:
          ``result[p][j]``: a `runner.Sample` (int64 tokens, float32 sampling logprobs).
        """
        arrays, num_samples, max_tokens, seed, stops = check_sample_args(
            prompts, num_samples, max_tokens, seed, temperature, stop_token_ids, self.max_seq_len
        )
        sampler = self._current_sampler()
        futures: dict[int, Any] = {}
        # The last prompt first: a server that batches one call's requests (the local server)
        # then knows the call's size from its first request.
        for i in [len(arrays) - 1, *range(len(arrays) - 1)]:
            params = types.SamplingParams(
                max_tokens=max_tokens,
                temperature=float(temperature),
                seed=prompt_seed(seed, i, num_samples),
                stop=list(stops),
            )
            prompt = types.ModelInput.from_ints(arrays[i].tolist())
            futures[i] = sampler.sample(prompt, num_samples, params)
        self.counters["sample"] += len(futures)
        out = []
        for i in range(len(arrays)):
            fut = futures[i]
            response = self._result(fut, f"sample (prompt {i})")
            seqs = list(response.sequences)
            if len(seqs) != num_samples:
                raise self._error(
                    f"sample: prompt {i} got {len(seqs)} samples, expected {num_samples}"
                )
            out.append([_to_sample(s, i, stops) for s in seqs])
        return out

    # -- Trainer-protocol checkpoints -----------------------------------------------------------

    def save_state(self, name: str) -> str:
        """Saves weights + optimizer state under ``name`` (never overwriting); its tinker path."""
        response = self._result(self.client.save_state(name), f"save_state({name!r})")
        self.counters["save_state"] += 1
        if not getattr(response, "path", None):
            raise CheckpointError(f"save_state({name!r}) returned an empty path")
        return str(response.path)

    def load_state(self, ref: str, with_optimizer: bool = True) -> None:
        """Continues from a saved state in a new training client (create-via-load).

        With ``with_optimizer`` the optimizer state is restored too; without it the new model
        starts a fresh AdamW state (the SDK's ``create_training_client_from_state``).
        """
        if self.service is None:
            raise CheckpointError("load_state needs the ServiceClient (TinkerTrainer(service=...))")
        if with_optimizer:
            future = _submit(self.service.create_training_client_from_state_with_optimizer, ref)
        else:
            future = _submit(self.service.create_training_client_from_state, ref)
        client = self._result(future, f"load_state({ref!r})")
        with self._lock:
            self.client = client
            self._model_inputs = ModelInputCache()
            self._weights_version += 1
        self.counters["load_state"] += 1

    def save_weights_for_sampler(self, name: str) -> str:
        """Saves sampler (inference) weights under ``name``; their tinker path."""
        response = self._result(
            self.client.save_weights_for_sampler(name), f"save_weights_for_sampler({name!r})"
        )
        self.counters["save_sampler"] += 1
        if not getattr(response, "path", None):
            raise CheckpointError(f"save_weights_for_sampler({name!r}) returned an empty path")
        return str(response.path)

    # -- run-level checkpoints (runner.checkpoints) ---------------------------------------------

    def _listed(self, path: str) -> Any | None:
        """The checkpoint listing's row of ``path`` (None: not listed, or no listing)."""
        if self.rest is None:
            return None
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        response = self._result(
            self.rest.list_checkpoints(parsed.training_run_id), "list_checkpoints"
        )
        rows = [c for c in response.checkpoints if c.tinker_path == path]
        return rows[0] if len(rows) == 1 else None

    def _resolve(self, path: str, what: str) -> dict[str, Any]:
        try:
            row = self._listed(path)
        except TinkerRequestError as exc:
            row, why = None, str(exc)
        else:
            why = "not in the run's checkpoint listing" if row is None else ""
        if row is None:
            warnings.warn(
                RuntimeWarning(f"Tinker {what} {path}: identity unresolved ({why})"), stacklevel=3
            )
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        return {
            "training_run_id": parsed.training_run_id,
            "checkpoint_time": row.time.isoformat() if row is not None else None,
            "size_bytes": getattr(row, "size_bytes", None) if row is not None else None,
            "identity_resolved": row is not None,
        }

    def save_resumable(self, name: str) -> dict[str, Any]:
        """Saves the state and resolves its identity (the listing's creation time).

        Returns:
          The manifest's ``resumable`` record: ``checkpoint_kind`` (``"tinker_state"``),
          ``checkpoint_name``, ``tinker_path``, ``training_run_id``, ``checkpoint_time``,
          ``size_bytes``, ``identity_resolved``, ``base_model``, ``includes_optimizer_state``.
        """
        with self._lock:
            path = self.save_state(name)
            return {
                "checkpoint_kind": CHECKPOINT_KIND,
                "checkpoint_name": name,
                "tinker_path": path,
                **self._resolve(path, "state"),
                "base_model": self.base_model,
                "includes_optimizer_state": True,
            }

    def save_promotable(self, name: str) -> dict[str, Any]:
        """Saves sampler weights; returns ``{snapshot_name, snapshot_path, training_run_id,
        checkpoint_time, size_bytes, identity_resolved, base_model}``."""
        with self._lock:
            path = self.save_weights_for_sampler(name)
            return {
                "snapshot_name": name,
                "snapshot_path": path,
                **self._resolve(path, "sampler weights"),
                "base_model": self.base_model,
            }

    def load_resumable(self, identity: Mapping[str, Any], *, with_optimizer: bool = True) -> None:
        """Restores a `save_resumable` record, or refuses (fail closed) before loading anything.

        Raises:
          CheckpointError: another backend's record; another base model; a ``tinker_path``
            that is not the training checkpoint named ``checkpoint_name`` (an edited
            manifest); a resolved identity whose checkpoint is no longer listed or was
            replaced (another creation time); or the load failing.
        """
        kind = identity.get("checkpoint_kind")
        if kind != CHECKPOINT_KIND:
            raise CheckpointError(f"checkpoint record of kind {kind!r} is not a Tinker state")
        saved_model = identity.get("base_model")
        if saved_model != self.base_model:
            raise CheckpointError(
                f"checkpoint was trained from base model {saved_model!r}, not {self.base_model!r}"
            )
        path = identity.get("tinker_path")
        name = identity.get("checkpoint_name")
        try:
            parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(str(path))
        except ValueError:
            raise CheckpointError(
                f"checkpoint record's tinker_path {path!r} is not a tinker:// checkpoint path"
            ) from None
        if parsed.checkpoint_type != "training" or parsed.checkpoint_id != f"weights/{name}":
            raise CheckpointError(
                f"checkpoint record's tinker_path {path} is not the training state saved as "
                f"{name!r}: the manifest was edited"
            )
        if parsed.training_run_id != identity.get("training_run_id"):
            raise CheckpointError(
                f"checkpoint record's tinker_path {path} names training run "
                f"{parsed.training_run_id!r}, not {identity.get('training_run_id')!r}"
            )
        if identity.get("identity_resolved"):
            try:
                row = self._listed(str(path))
            except TinkerRequestError as exc:
                raise CheckpointError(f"cannot verify checkpoint {path}: {exc}") from None
            if row is None:
                raise CheckpointError(
                    f"checkpoint {path} is no longer in its run's checkpoint listing: refusing "
                    "to resume from it"
                )
            if row.time.isoformat() != identity.get("checkpoint_time"):
                raise CheckpointError(
                    f"checkpoint {path} was replaced (created {row.time.isoformat()}, the "
                    f"manifest recorded {identity.get('checkpoint_time')}): refusing to resume "
                    "from another checkpoint of the same name"
                )
        else:
            warnings.warn(
                RuntimeWarning(
                    f"Tinker checkpoint {path}: identity unresolved when saved; loading it by its "
                    "path (tinker paths are never reused: states are saved without overwrite)"
                ),
                stacklevel=2,
            )
        try:
            self.load_state(str(path), with_optimizer=with_optimizer)
        except TinkerRequestError as exc:
            raise CheckpointError(f"cannot load the resumable state {path}: {exc}") from None

    # -- cleanup ------------------------------------------------------------------------------

    def close(self) -> None:
        """Finishes the session (``errored`` after a failed request) without waiting long."""
        if self._closed:
            return
        self._closed = True
        if self.service is None:
            return
        status = "errored" if self._failed else "success"
        finish = getattr(self.service, "close", None)
        if finish is None:  # SDK 0.25: no session finish (the session ends with its heartbeat)
            return
        try:
            finish(status).result(timeout=self.close_timeout_s)
        except Exception as exc:  # noqa: BLE001 - cleanup must not mask the real outcome
            # (after a failure the service is often unreachable: the failure itself was reported)
            level = logging.DEBUG if self._failed else logging.WARNING
            log.log(level, "closing the Tinker session failed: %s", type(exc).__name__)

    def __enter__(self) -> TinkerTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Done:
    """A finished call as a future: its value, or its exception re-raised by ``result``."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def future(self) -> _Done:
        return self


def _submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as a future: SDK 0.38 returns one; SDK 0.25 (what SkyRL tx pins)
    blocks in ``create_lora_training_client``, ``create_training_client_from_state*`` and
    ``save_weights_and_get_sampling_client`` and returns the client (docs/tinker.md)."""
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised by result(), mapped by the caller
        return _Done(error=exc)
    return value if callable(getattr(value, "result", None)) else _Done(value)


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:500] if lines else ""


# -- construction from the main job's config ------------------------------------------------


def connect(tcfg: Any, api_key: str, *, seed: int) -> tuple[Any, Any, Any]:
    """``(service, training client, rest client)`` from a ``[tinker]`` section.

    A LoRA training client of ``base_model`` with ``lora_rank``, ``train_unembed`` and the run's
    seed (the local server uses it as the initialization seed, so a run on it reproduces
    ``--backend local``).
    """
    service = tinker.ServiceClient(base_url=tcfg.base_url, api_key=api_key)
    wait = functools.partial(
        wait_result,
        timeout_s=tcfg.request_timeout_s,
        what="create_lora_training_client",
        url=tcfg.base_url,
        setting="[tinker].request_timeout_s",
    )
    try:
        # The SDK creates its session inside this call, synchronously and with no timeout of
        # its own (a listener that never answers would hold it forever): bounded here. SDK 0.38
        # returns a future of the client; SDK 0.25 blocks and returns the client (`_submit`).
        future = wait(
            in_daemon_thread(
                _submit,
                service.create_lora_training_client,
                tcfg.base_model,
                rank=int(tcfg.lora_rank),
                seed=int(seed),
                train_unembed=bool(tcfg.train_unembed),
            )
        )
        client = wait(future)
        if hasattr(tinker, "RestClient"):
            rest = tinker.RestClient(base_url=tcfg.base_url, api_key=api_key)
        else:  # SDK 0.25: the service's own (deprecated in 0.38)
            rest = service.create_rest_client()
    except BaseException:
        try:  # bounded too: the session may be the call that never answered
            in_daemon_thread(lambda: service.close("errored").result(timeout=5)).result(6)
        except Exception:  # noqa: BLE001 - the original error matters
            pass
        raise
    return service, client, rest


def make_trainer(cfg: Any, run_dir: Path | str | None = None) -> TinkerTrainer:
    """The main job's Tinker trainer from a validated `runner.config.Config`.

    Validates ``[tinker]`` (`runner.tinker.validate_static`), reads the API key from the
    environment variable named by ``api_key_env`` (an error names the variable, never a value),
    probes ``base_url`` within ``connect_timeout_s`` (one error line when unreachable), and
    connects (`connect`).
    """
    validate_static(cfg)
    t = cfg.tinker
    api_key = api_key_from_env(t.api_key_env)
    probe(
        t.base_url,
        timeout_s=t.connect_timeout_s,
        what="Tinker service",
        setting="[tinker].connect_timeout_s",
    )
    try:
        service, client, rest = connect(t, api_key, seed=cfg.run.seed)
    except (tinker.TinkerError, concurrent.futures.TimeoutError, ServiceUnreachable) as exc:
        if isinstance(exc, concurrent.futures.TimeoutError):
            why = f"no answer within [tinker].request_timeout_s = {t.request_timeout_s:g} s"
        else:
            why = f"{type(exc).__name__}: {_first_line(str(exc))}"
        raise TinkerRequestError(
            f"Tinker ({t.base_url}): cannot create a training client of {t.base_model!r}: {why}"
        ) from None
    return TinkerTrainer(
        client,
        service=service,
        rest=rest,
        base_model=t.base_model,
        base_url=t.base_url,
        max_seq_len=cfg.model.max_seq_len,
        request_timeout_s=t.request_timeout_s,
        lora_rank=t.lora_rank,
    )
