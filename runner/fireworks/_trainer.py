"""`FireworksTrainer`: a `runner.Trainer` on the Fireworks training SDK's ``FiretitanTrainingClient``.

Passes (docs/training-api.md#pass-counts): ``forward`` = 1F; ``forward_backward`` = 1F + 1B. A
builtin-kernel step is one ``forward_backward``; a fused client step (`runner.ClientLoss`) is one
``forward`` plus one linear ``cross_entropy`` ``forward_backward`` (1F + 1B when the caller passes
a forward it already ran at the current weights). ``optim_step`` sends the SDK's explicit
``GradAccNormalization.NONE`` for ``"none"``: the runner owns normalization.

Sampling hot-loads the current weights into the trainer's deployment (``save_weights_for_sampler``
then ``create_sampling_client``) once per weights version and samples each prompt with a
deterministic seed per completion (`runner.fireworks._seeds.sample_seed`).

Checkpoints follow docs/sft.md#checkpoints-and-resume: `save_resumable` resolves the new DCP row
against a control-plane listing taken before the save (under a lock), `load_resumable` resumes on
the same trainer by name or across jobs through a ``cross_job://`` reference (failing closed on an
unresolved identity), and `finalize` promotes the final weights and only then deletes the trainer.
The API key is used to connect and never stored, logged or written.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from fireworks.training.sdk import types
from fireworks.training.sdk.client import GradAccNormalization

from runner._atomic import atomic_write_json
from runner._hosted import COUNTERS as HOSTED_COUNTERS
from runner._hosted import as_seq_list as _as_list
from runner._hosted import check_sample_args, float_metrics
from runner._hosted import to_sample as _to_sample
from runner._net import probe
from runner._padding import CheckedSeqs
from runner._types import NORMALIZATIONS, AdamParams, ForwardBackwardResult, Sample, Seq
from runner.checkpoints import CheckpointError
from runner.fireworks._controlplane import (
    dns_label,
    is_promotable_row,
    is_resumable_row,
    list_rows,
    poll_new_rows,
    short_name,
)
from runner.fireworks._convert import (
    BUILTIN_LOSSES,
    KERNEL_INPUTS,
    OPT_IN_LOSSES,
    ModelInputCache,
    builtin_config,
    output_logprobs,
    to_datums,
)
from runner.fireworks._seeds import (  # noqa: F401 - prompt_seed is re-exported
    prompt_seed,
    sample_seed,
)
from runner.fireworks._validate import api_key_from_env, check_text_only, validate_static

log = logging.getLogger("runner.fireworks")

_NORMALIZATION = {
    None: GradAccNormalization.NONE,
    "none": GradAccNormalization.NONE,
    "num_loss_tokens": GradAccNormalization.NUM_LOSS_TOKENS,
    "num_sequences": GradAccNormalization.NUM_SEQUENCES,
}


class FireworksRequestError(ValueError):
    """A Fireworks request failed or timed out (one line: what, where, why; never the key)."""


def _first_line(text: str) -> str:
    """One line of an error text; the SDK's ``ERROR: <what> / Cause: <cause> / ...`` blocks
    become ``<what>: <cause>``."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].startswith("ERROR: "):
        cause = [ln[len("Cause: ") :] for ln in lines[1:] if ln.startswith("Cause: ")]
        return lines[0][len("ERROR: ") :] + (f": {cause[0]}" if cause else "")
    return lines[0]


class FireworksTrainer:
    """The Fireworks hosted trainer behind the `runner.Trainer` protocol.

    Args:
      client: a ``fireworks.training.sdk.FiretitanTrainingClient`` (or an object with its
        methods).
      base_model: the trainer's base model (recorded in manifests, checked on resume; vision-
        language models are refused, see `runner.fireworks.is_vision_model`).
      trainer_job_id: the RLOR trainer job id (default: ``service.trainer_job_id`` when a service
        is given). Needed to resolve checkpoint identities and for cross-job resume.
      control_plane: the control-plane client (``TrainerJobManager``: ``list_checkpoints``,
        ``promote_checkpoint``, ``delete``, ``try_get``). Without it identities stay unresolved.
      service: the ``FiretitanServiceClient`` that created ``client`` (closed by `close`).
      max_seq_len: the trainer's model-input length limit (checked before sending).
      request_timeout_s: wait limit for each SDK future.
      identity_timeout_s / poll_interval_s / settle_s: control-plane polling for a new
        checkpoint row after a save (docs/sft.md#checkpoints-and-resume: 90 s / 3 s / 3 s).
      output_model_id: promote the final weights to this model id in `finalize` (None = keep the
        trainer and promote nothing).
      delete_trainer_after_promotion: delete the trainer job after a successful promotion.
      delete_timeout_s / delete_poll_s: how long to verify the deletion (60 s / 5 s).
      modality: ``"auto"``, ``"text"`` or ``"vision"`` (see `runner.fireworks.check_text_only`).
      name_prefix: prefix of the sampler snapshot names.
      base_url: the control plane's URL, named in error messages.
      builtin_losses: the kernels the step planner may use (default: all of
        `runner.fireworks.BUILTIN_LOSSES`). A subset restricts them; a capability-gated kernel of
        `runner.fireworks.OPT_IN_LOSSES` (``reinforce``, undocumented formula) is used only when
        named here, and only on a client that advertises its capability
        (``supports_reinforce``).

    Attributes:
      builtin_losses: kernel names for `runner.plan_step`.
      counters: SDK calls issued: ``forward``, ``forward_backward``, ``optim_step``, ``sample``
        (per completion), ``sampler_sync`` (hot-loads), ``save_state``, ``save_sampler``,
        ``load_state``.
    """

    def __init__(
        self,
        client: Any,
        *,
        base_model: str,
        trainer_job_id: str | None = None,
        control_plane: Any = None,
        service: Any = None,
        max_seq_len: int | None = None,
        request_timeout_s: float = 3600.0,
        identity_timeout_s: float = 90.0,
        poll_interval_s: float = 3.0,
        settle_s: float = 3.0,
        output_model_id: str | None = None,
        delete_trainer_after_promotion: bool = True,
        delete_timeout_s: float = 60.0,
        delete_poll_s: float = 5.0,
        modality: str = "auto",
        name_prefix: str = "foldloss",
        builtin_losses: Sequence[str] | None = None,
        base_url: str | None = None,
    ) -> None:
        if not isinstance(base_model, str) or not base_model.strip():
            raise ValueError("FireworksTrainer: base_model is required")
        check_text_only(base_model, modality)
        if output_model_id:
            from runner.fireworks._validate import check_output_model_id

            check_output_model_id(output_model_id)
        if builtin_losses is None:
            builtin_losses = BUILTIN_LOSSES
        unknown = sorted(set(builtin_losses) - set(BUILTIN_LOSSES) - set(OPT_IN_LOSSES))
        if unknown:
            raise ValueError(f"FireworksTrainer: unsupported builtin losses {unknown}")
        for name in sorted(set(builtin_losses) & set(OPT_IN_LOSSES)):
            if getattr(client, OPT_IN_LOSSES[name], None) is not True:
                raise ValueError(
                    f"FireworksTrainer: unsupported builtin losses [{name!r}]: the trainer does "
                    f"not advertise {OPT_IN_LOSSES[name]}"
                )
        self.builtin_losses = tuple(builtin_losses)
        self.base_url = base_url or None
        self.client = client
        self.service = service
        self.control_plane = control_plane
        self.base_model = base_model
        if trainer_job_id is None and service is not None:
            try:  # the SDK's property raises while nothing is provisioned
                trainer_job_id = service.trainer_job_id
            except Exception:  # noqa: BLE001 - unknown job: identities stay unresolved
                trainer_job_id = None
        self.trainer_job_id = trainer_job_id or None
        self.max_seq_len = max_seq_len
        self.request_timeout_s = float(request_timeout_s)
        self.identity_timeout_s = float(identity_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.settle_s = float(settle_s)
        self.output_model_id = output_model_id or None
        self.delete_trainer_after_promotion = bool(delete_trainer_after_promotion)
        self.delete_timeout_s = float(delete_timeout_s)
        self.delete_poll_s = float(delete_poll_s)
        self.name_prefix = dns_label(name_prefix, 40)
        self.counters = dict.fromkeys(HOSTED_COUNTERS, 0)
        self._model_inputs = ModelInputCache()
        self._provider_lock = threading.RLock()
        self._sampler_lock = threading.Lock()
        self._sampler: Any = None
        self._sampler_version = -1
        self._weights_version = 0
        self._closed = False
        self._sleep: Callable[[float], None] = time.sleep
        self._clock: Callable[[], float] = time.monotonic

    def __repr__(self) -> str:
        return (
            f"FireworksTrainer(base_model={self.base_model!r}, "
            f"trainer_job_id={self.trainer_job_id!r})"
        )

    # -- training ---------------------------------------------------------------------------

    def _result(self, future: Any, what: str) -> Any:
        """The future's result within ``request_timeout_s``; any failure of the request (its
        future failed, the service refused it or is unreachable, no answer in time) becomes one
        `FireworksRequestError` line naming the request and the cause."""
        try:
            return future.result(timeout=self.request_timeout_s)
        except TimeoutError:
            raise self._timeout(what) from None
        except Exception as exc:  # noqa: BLE001 - classified by `_error`
            raise self._error(what, exc) from None

    def _blocking(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` — an SDK call that waits on the service without a timeout of
        its own (``save_weights_for_sampler_ext``, the hot load) — bounded by
        ``request_timeout_s``; failures as in `_result`.

        The call runs on a daemon thread: one stuck on a dead service is abandoned (and cannot
        keep the process alive) after the error is raised.
        """
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=call, name=f"fireworks-{what}", daemon=True).start()
        if not done.wait(self.request_timeout_s):
            raise self._timeout(what)
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, NotImplementedError | CheckpointError):
                raise exc
            raise self._error(what, exc) from None
        return box["value"]

    def _where(self) -> str:
        return f" ({self.base_url})" if self.base_url else ""

    def _timeout(self, what: str) -> FireworksRequestError:
        return FireworksRequestError(
            f"Fireworks{self._where()}: {what}: no result within [fireworks].request_timeout_s = "
            f"{self.request_timeout_s:g} s (the service may be down or overloaded)"
        )

    def _error(self, what: str, exc: BaseException) -> FireworksRequestError:
        from fireworks.training.sdk import APIConnectionError, APIStatusError, RequestFailedError

        if isinstance(exc, FireworksRequestError):
            return exc
        if isinstance(exc, RequestFailedError):
            why = f" failed ({exc.category} error): {_first_line(exc.message)}"
        elif isinstance(exc, APIStatusError):
            why = f": HTTP {exc.status_code}: {_first_line(str(exc))}"
        elif isinstance(exc, APIConnectionError):
            why = f": connection failed: {_first_line(str(exc))}"
        else:  # e.g. RetryableException "Promise expired/broken" (HTTP 410), a hot-load failure
            why = f": {type(exc).__name__}: {_first_line(str(exc))}"
        return FireworksRequestError(f"Fireworks{self._where()}: {what}{why}")

    def forward(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per-target float32 logprobs at the current weights (one ``cross_entropy`` forward).

        Datums carry ``target_tokens`` and all-zero ``weights`` (as the SDK's own custom-loss
        forward sends them); other inputs attached to the sequences are ignored.
        """
        checked = isinstance(seqs, CheckedSeqs)  # the runner's path: validated where it entered
        seqs = [s.with_inputs() if s.inputs else s for s in _as_list(seqs)]
        zero = [s.with_inputs(weights=np.zeros(s.num_targets, np.float32)) for s in seqs]
        zero = CheckedSeqs(zero) if checked else zero
        datums = to_datums(
            zero, ("weights",), max_seq_len=self.max_seq_len, cache=self._model_inputs
        )
        out = self._result(self.client.forward(datums, "cross_entropy"), "forward")
        self.counters["forward"] += 1
        return output_logprobs(out, seqs, required=True)

    def forward_backward(
        self, seqs: Sequence[Seq], loss_name: str, config: Mapping[str, Any] | None = None
    ) -> ForwardBackwardResult:
        """Runs a builtin kernel on the trainer; the gradient accumulates until `optim_step`.

        Inputs per kernel: ``cross_entropy`` ← ``weights``; every policy kernel ← ``logprobs``
        (the anchor) and ``advantages`` (per token, reduction weights folded in). ``config``
        keys and values: the kernel table (`runner._kernels`; `runner.fireworks.builtin_config`).

        Returns:
          `ForwardBackwardResult`: per-sequence trainer logprobs (``[]`` when the server sends
          only the aggregate loss) and the server metrics unchanged (``loss:sum`` is the kernel's
          raw token sum — for a linear surrogate, not the user's loss — and stays under that key).
        """
        if loss_name not in self.builtin_losses:
            raise ValueError(f"unknown loss {loss_name!r}; expected one of {self.builtin_losses}")
        cfg = builtin_config(loss_name, config)
        datums = to_datums(
            _as_list(seqs),
            KERNEL_INPUTS[loss_name],
            loss_name=loss_name,
            max_seq_len=self.max_seq_len,
            cache=self._model_inputs,
        )
        out = self._result(
            self.client.forward_backward(datums, loss_name, cfg or None), "forward_backward"
        )
        self.counters["forward_backward"] += 1
        return ForwardBackwardResult(
            logprobs=output_logprobs(out, seqs, required=False),
            metrics=float_metrics(out.metrics),
        )

    def optim_step(self, adam: AdamParams, normalization: str | None = None) -> dict[str, float]:
        """One server Adam(W) step on the accumulated gradient.

        ``None`` and ``"none"`` send ``GradAccNormalization.NONE`` (on the wire
        ``"grad_accumulation_normalization": "none"``; the SDK's ``None`` would omit the field and
        leave the choice to the server); the other `runner.NORMALIZATIONS` map to their enum.

        Returns:
          The server's optimizer metrics as floats.
        """
        if not isinstance(adam, AdamParams):
            raise ValueError(f"optim_step: adam must be a runner.AdamParams, got {adam!r}")
        if normalization not in _NORMALIZATION:
            raise ValueError(
                f"optim_step: unknown normalization {normalization!r}; expected None or one of "
                f"{NORMALIZATIONS}"
            )
        params = types.AdamParams(
            learning_rate=float(adam.learning_rate),
            beta1=float(adam.beta1),
            beta2=float(adam.beta2),
            eps=float(adam.eps),
            weight_decay=float(adam.weight_decay),
            grad_clip_norm=float(adam.grad_clip_norm),
        )
        response = self._result(
            self.client.optim_step(
                params, grad_accumulation_normalization=_NORMALIZATION[normalization]
            ),
            "optim_step",
        )
        self.counters["optim_step"] += 1
        self._weights_version += 1
        return float_metrics(getattr(response, "metrics", None))

    # -- sampling ---------------------------------------------------------------------------

    def _current_sampler(self) -> Any:
        with self._sampler_lock:
            if self._sampler is not None and self._sampler_version == self._weights_version:
                return self._sampler
            name = f"{self.name_prefix}-sampler-{self._weights_version}"
            saved = self._blocking(
                "save_weights_for_sampler", self.client.save_weights_for_sampler, name
            )
            path = self._result(saved, "save_weights_for_sampler").path
            if not path:
                raise RuntimeError(f"save_weights_for_sampler({name!r}) returned an empty path")
            sampler = self._blocking(
                "hot load (create_sampling_client)", self.client.create_sampling_client, path
            )
            self.counters["save_sampler"] += 1
            self.counters["sampler_sync"] += 1
            old, self._sampler = self._sampler, sampler
            self._sampler_version = self._weights_version
        if old is not None:
            _close_quietly(old)
        return sampler

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
        """``num_samples`` completions per prompt from the deployment, at the current weights.

        The weights are hot-loaded once per version (after each ``optim_step``/load). Each
        completion is its own request: sample ``j`` of prompt ``i`` with the int32
        ``seed = sample_seed(seed, i, j, num_samples)`` (`runner._seeds`; the SDK would send
        ``num_samples`` requests with one seed, which a seeded deployment answers identically);
        all requests are submitted (the last one first) before any result is awaited.
        ``stop_token_ids`` are applied client-side: each completion is cut after its first stop
        token (kept, with its logprob; ``stop_reason="stop"``). The SDK's deployment sampler
        only takes string stops (integer ids need a tokenizer it does not have by default), and
        a server-side stop may drop the stop token; the cut is exact because a completion's
        prefix does not depend on what is sampled after it. Cost: up to ``max_tokens``
        generated tokens per completion.

        Returns:
          ``result[p][j]``: a `runner.Sample` (int64 tokens, float32 sampling logprobs).
        """
        arrays, num_samples, max_tokens, seed, stops = check_sample_args(
            prompts, num_samples, max_tokens, seed, temperature, stop_token_ids, self.max_seq_len
        )
        sampler = self._current_sampler()
        models = [types.ModelInput.from_ints(a.tolist()) for a in arrays]
        rows = [(i, j) for i in range(len(arrays)) for j in range(num_samples)]
        futures: dict[tuple[int, int], Any] = {}
        # The last completion first: a server that batches one call's requests (the local
        # server) then sees the call's rows complete only when its last request arrives.
        for i, j in [rows[-1], *rows[:-1]]:
            # One request per completion, each with its own seed: the SDK sends a
            # ``sample(prompt, n, params)`` as n requests with the same seed, which a seeded
            # deployment answers with n identical completions.
            params = types.SamplingParams(
                max_tokens=max_tokens,
                temperature=float(temperature),
                seed=sample_seed(seed, i, j, num_samples),
            )
            futures[i, j] = sampler.sample(models[i], 1, params)
        self.counters["sample"] += len(arrays) * num_samples
        out = []
        for i in range(len(arrays)):
            samples = []
            for j in range(num_samples):
                seqs = list(self._result(futures[i, j], f"sample (prompt {i})").sequences)
                if len(seqs) != 1:
                    raise RuntimeError(f"prompt {i}: got {len(seqs)} samples, expected 1")
                samples.append(_to_sample(seqs[0], i, stops))
            out.append(samples)
        return out

    # -- Trainer-protocol checkpoints (the run-level contract is save_resumable & co.) ------

    def _dcp_name(self, name: str) -> str:
        return f"{dns_label(name, 54)}-{uuid.uuid4().hex[:8]}"

    def save_state(self, name: str) -> str:
        """Saves a DCP (weights + optimizer) under ``name``; returns the server's path."""
        response = self._result(self.client.save_state(name), "save_state")
        self.counters["save_state"] += 1
        path = getattr(response, "path", None)
        if not path:
            raise CheckpointError(f"save_state({name!r}) returned an empty path")
        return str(path)

    def load_state(self, ref: str, with_optimizer: bool = True) -> None:
        """Loads a DCP reference (a name on this trainer, or ``cross_job://<job>/<name>``)."""
        if with_optimizer:
            future = self.client.load_state_with_optimizer(ref)
        else:
            future = self.client.load_state(ref)
        self._result(future, "load_state")
        self.counters["load_state"] += 1
        self._weights_version += 1

    def save_weights_for_sampler(self, name: str) -> str:
        """Saves a ``base`` sampler snapshot (promotable inference weights); returns its path."""
        result = self._blocking(
            "save_weights_for_sampler",
            self.client.save_weights_for_sampler_ext,
            dns_label(name),
            checkpoint_type="base",
        )
        self.counters["save_sampler"] += 1
        if not result.path:
            raise CheckpointError(f"save_weights_for_sampler({name!r}) returned an empty path")
        return str(result.path)

    # -- run-level checkpoint hooks (runner.checkpoints) ------------------------------------

    def _list(self) -> list[dict] | None:
        if self.control_plane is None or self.trainer_job_id is None:
            return None
        return list_rows(lambda: self.control_plane.list_checkpoints(self.trainer_job_id))

    def _poll(self, baseline: set[str], predicate: Callable[[dict], bool]) -> list[dict]:
        return poll_new_rows(
            lambda: self.control_plane.list_checkpoints(self.trainer_job_id),
            baseline=baseline,
            predicate=predicate,
            timeout_s=self.identity_timeout_s,
            interval_s=self.poll_interval_s,
            settle_s=self.settle_s,
            sleep=self._sleep,
            clock=self._clock,
        )

    def save_resumable(self, name: str) -> dict[str, Any]:
        """Saves a DCP and resolves its control-plane identity (docs/sft.md#checkpoints-and-resume).

        Under a lock (two saves cannot race): take the baseline of resumable rows, ``save_state``
        a unique name (``<name>-<8 hex>``), then poll for resumable rows not in the baseline.
        Exactly one new row resolves the identity — its short name, resource and type are
        recorded even when the server stored the checkpoint under another name. Zero or several
        new rows, or no baseline (listing failed or no control plane), leave it unresolved: a
        ``RuntimeWarning`` is issued and ``checkpoint_resource``/``checkpoint_type`` are None
        (a cross-job resume from it then fails closed).

        Returns:
          The manifest's ``resumable`` record: ``checkpoint_kind``, ``checkpoint_name``,
          ``requested_checkpoint_name``, ``checkpoint_resource``, ``checkpoint_type``,
          ``identity_resolved``, ``provider_path``, ``source_trainer_job_id``, ``base_model``,
          ``includes_optimizer_state``.
        """
        with self._provider_lock:
            requested = self._dcp_name(name)
            rows = self._list()
            baseline = (
                None if rows is None else {r.get("name") for r in rows if is_resumable_row(r)}
            )
            path = self.save_state(requested)
            new = [] if baseline is None else self._poll(baseline, is_resumable_row)
            row = new[0] if len(new) == 1 else None
            if row is None:
                why = "no control-plane baseline" if baseline is None else f"candidates={len(new)}"
                warnings.warn(
                    RuntimeWarning(
                        f"Fireworks checkpoint {requested!r}: control-plane identity unresolved "
                        f"({why}); a cross-job resume from it will fail closed"
                    ),
                    stacklevel=2,
                )
            return {
                "checkpoint_kind": "fireworks_dcp",
                "checkpoint_name": short_name(row["name"]) if row else requested,
                "requested_checkpoint_name": requested,
                "checkpoint_resource": row["name"] if row else None,
                "checkpoint_type": row.get("checkpointType") if row else None,
                "identity_resolved": row is not None,
                "provider_path": path,
                "source_trainer_job_id": self.trainer_job_id,
                "base_model": self.base_model,
                "includes_optimizer_state": True,
            }

    def _resolve_sampler_row(self, path: str, snapshot: str, *, required: bool) -> dict | None:
        names = {short_name(path), short_name(snapshot)}

        def match(row: dict) -> bool:
            return is_promotable_row(row) and short_name(row.get("name", "")) in names

        has_control = self.control_plane is not None and self.trainer_job_id is not None
        rows = self._poll(set(), match) if has_control else []
        if len(rows) > 1:
            raise CheckpointError(
                f"sampler snapshot {snapshot!r}: {len(rows)} promotable control-plane rows match; "
                "refusing to guess"
            )
        if not rows:
            if required:
                raise CheckpointError(
                    f"sampler snapshot {snapshot!r}: no promotable control-plane row appeared "
                    f"within {self.identity_timeout_s:g} s; nothing was promoted"
                )
            warnings.warn(
                RuntimeWarning(
                    f"sampler snapshot {snapshot!r}: no promotable control-plane row yet; "
                    "recorded without a resource"
                ),
                stacklevel=3,
            )
            return None
        return rows[0]

    def save_promotable(self, name: str) -> dict[str, Any]:
        """Saves a ``base`` sampler snapshot and resolves its promotable control-plane row.

        Returns:
          ``{snapshot_name, snapshot_path, sampler_checkpoint_type: "base",
          checkpoint_resource, checkpoint_type}`` (resource/type None if no row appeared).
        """
        with self._provider_lock:
            result = self._blocking(
                "save_weights_for_sampler",
                self.client.save_weights_for_sampler_ext,
                dns_label(name),
                checkpoint_type="base",
            )
            self.counters["save_sampler"] += 1
            if not result.path:
                raise CheckpointError(f"save_weights_for_sampler({name!r}) returned an empty path")
            row = self._resolve_sampler_row(result.path, result.snapshot_name, required=False)
            return {
                "snapshot_name": result.snapshot_name,
                "snapshot_path": str(result.path),
                "sampler_checkpoint_type": "base",
                "checkpoint_resource": row["name"] if row else None,
                "checkpoint_type": row.get("checkpointType") if row else None,
            }

    def load_resumable(self, identity: Mapping[str, Any], *, with_optimizer: bool = True) -> None:
        """Restores a `save_resumable` record (docs/sft.md#checkpoints-and-resume).

        Same trainer job: load by (resolved) name. Another job: only with a resolved
        ``checkpoint_resource``, through the SDK's ``resolve_checkpoint_path(name,
        source_job_id=...)`` (a ``cross_job://<job>/<name>`` reference). Then
        ``load_state_with_optimizer`` (or ``load_state`` for weights only).

        Raises:
          CheckpointError: another backend's record, a different base model, an unresolved
            cross-job identity, or no loadable reference.
        """
        kind = identity.get("checkpoint_kind")
        if kind not in (None, "fireworks_dcp"):
            raise CheckpointError(f"checkpoint record of kind {kind!r} is not a Fireworks DCP")
        saved_model = identity.get("base_model")
        if saved_model and saved_model != self.base_model:
            raise CheckpointError(
                f"checkpoint was trained from base model {saved_model!r}, not {self.base_model!r}"
            )
        name = identity.get("checkpoint_name")
        source = identity.get("source_trainer_job_id")
        try:
            if source and name:
                if source == self.trainer_job_id:
                    ref = self.client.resolve_checkpoint_path(name)
                else:
                    if not identity.get("checkpoint_resource"):
                        raise CheckpointError(
                            f"checkpoint {name!r} of trainer job {source!r} has no resolved "
                            "control-plane identity for cross-job resume (its requested name could "
                            "match an unrelated checkpoint): refusing to resume from it"
                        )
                    ref = self.client.resolve_checkpoint_path(name, source_job_id=source)
            elif identity.get("provider_path"):
                ref = str(identity["provider_path"])
            else:
                raise CheckpointError(
                    "checkpoint record has no loadable reference (no name with a trainer job, "
                    "no provider path)"
                )
        except ValueError as exc:
            raise CheckpointError(f"checkpoint reference is invalid: {exc}") from exc
        with self._provider_lock:
            self.load_state(ref, with_optimizer=with_optimizer)

    # -- final promotion and cleanup --------------------------------------------------------

    def finalize(self, run_dir: Path | str, last_manifest: Mapping[str, Any] | None) -> dict | None:
        """Promotes the final weights, then (only then) deletes the trainer (§7.6-7.7).

        Without ``output_model_id`` nothing is promoted and the trainer is kept. Otherwise:
        reuse the final checkpoint's promotable snapshot when its control-plane row is known,
        else save a ``base`` snapshot now and require exactly one promotable row; promote it;
        write ``<run_dir>/fireworks_final_model.json``; then, if
        ``delete_trainer_after_promotion``, delete the trainer job, verify it is gone, and write
        ``fireworks_trainer_cleanup.json``. A failed promotion raises and keeps the trainer.

        Returns:
          The final-model record, or None when nothing was promoted.
        """
        run_dir = Path(run_dir)
        manifest = dict(last_manifest or {})
        if not self.output_model_id:
            log.info("no [fireworks].output_model_id: nothing promoted; trainer job kept")
            self.close()
            return None
        if self.control_plane is None or self.trainer_job_id is None:
            raise CheckpointError("final promotion needs the control plane and the trainer job id")
        with self._provider_lock:
            promotable = manifest.get("promotable") or {}
            resource = promotable.get("checkpoint_resource")
            reused = bool(resource) and "/checkpoints/" in str(resource)
            if reused:
                sampler_path = promotable.get("snapshot_path")
                ctype = promotable.get("checkpoint_type")
            else:
                result = self._blocking(
                    "save_weights_for_sampler",
                    self.client.save_weights_for_sampler_ext,
                    f"{self.name_prefix}-final",
                    checkpoint_type="base",
                )
                self.counters["save_sampler"] += 1
                if not result.path:
                    raise CheckpointError("final sampler snapshot returned an empty path")
                row = self._resolve_sampler_row(result.path, result.snapshot_name, required=True)
                sampler_path, resource, ctype = result.path, row["name"], row.get("checkpointType")
            model = self.control_plane.promote_checkpoint(
                name=resource, output_model_id=self.output_model_id, base_model=self.base_model
            )
            record = {
                "format_version": 1,
                "step": manifest.get("step"),
                "trainer_job_id": self.trainer_job_id,
                "dcp_checkpoint": manifest.get("resumable"),
                "sampler_path": sampler_path,
                "checkpoint_resource": resource,
                "checkpoint_type": ctype,
                "reused_promotable_checkpoint": reused,
                "output_model_id": self.output_model_id,
                "model": model,
            }
            atomic_write_json(run_dir / "fireworks_final_model.json", record)
            if self.delete_trainer_after_promotion:
                record["trainer_state_after_delete"] = self._delete_trainer(run_dir)
        self.close()
        return record

    def _delete_trainer(self, run_dir: Path) -> str:
        job = self.trainer_job_id
        self.control_plane.delete(job)
        deadline = self._clock() + self.delete_timeout_s
        state = "UNKNOWN"
        while True:
            try:
                row = self.control_plane.try_get(job)
            except Exception as exc:  # noqa: BLE001 - retried until the deadline
                log.warning("trainer job lookup failed: %s: %s", type(exc).__name__, exc)
            else:
                state = "ABSENT" if row is None else str(row.get("state", "UNKNOWN"))
                if state in ("ABSENT", "JOB_STATE_DELETED"):
                    break
            if self._clock() >= deadline:
                raise CheckpointError(
                    f"trainer job {job!r} is still {state} {self.delete_timeout_s:g} s after its "
                    "deletion was requested (the model was promoted)"
                )
            self._sleep(self.delete_poll_s)
        atomic_write_json(
            run_dir / "fireworks_trainer_cleanup.json", {"trainer_job_id": job, "state": state}
        )
        return state

    def close(self) -> None:
        """Closes the sampling client and the service (idempotent; never deletes the trainer)."""
        if self._closed:
            return
        self._closed = True
        with self._sampler_lock:
            sampler, self._sampler = self._sampler, None
        if sampler is not None:
            _close_quietly(sampler)
        if self.service is not None:
            _close_quietly(self.service)

    def __enter__(self) -> FireworksTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close_quietly(obj: Any) -> None:
    try:
        obj.close()
    except Exception as exc:  # noqa: BLE001 - cleanup must not mask the real outcome
        log.warning("closing %s failed: %s: %s", type(obj).__name__, type(exc).__name__, exc)


# -- construction from the main job's config ----------------------------------------------


def fresh_deployment_id(base_model: str) -> str:
    """A new hot-load deployment's id: ``<model>-<unix seconds>-<8 hex digits>``.

    The SDK's own default (`[fireworks].deployment_id` empty) is ``<model>-<unix seconds>``:
    two trainers provisioned within one second get the same id, the second *gets* the first's
    deployment instead of creating one -- still hot-loading the first trainer's job -- and
    samples another run's weights (seen with two tests' trainers on the local server). An id
    the SDK is given explicitly is created when it does not exist (reattached when it does), so
    a random suffix keeps runs apart; the deployment is still the SDK's to clean up.
    """
    model = dns_label(str(base_model).rstrip("/").rsplit("/", 1)[-1], 40)
    return f"{model}-{int(time.time())}-{uuid.uuid4().hex[:8]}"


def _connect(fcfg: Any, api_key: str) -> tuple[Any, Any, Any, str | None]:
    """``(service, training client, control plane, trainer job id)`` from ``[fireworks]``.

    The service is SDK-managed (``FiretitanServiceClient.from_firetitan_config``): it reattaches
    ``trainer_job_id`` (or provisions a trainer from ``training_shape_id``) and a hot-load
    deployment, with ``cleanup_trainer_on_close=False`` (checkpoints outlive the process;
    deletion happens only after promotion, in `FireworksTrainer.finalize`).
    """
    from fireworks.training.sdk import FiretitanServiceClient, TrainerJobManager

    service = FiretitanServiceClient.from_firetitan_config(
        api_key=api_key,
        base_url=fcfg.base_url,
        base_model=fcfg.base_model,
        training_shape_id=fcfg.training_shape_id,
        trainer_job_id=fcfg.trainer_job_id or None,
        deployment_id=fcfg.deployment_id or fresh_deployment_id(fcfg.base_model),
        max_context_length=fcfg.max_seq_len,
        cleanup_trainer_on_close=False,
    )
    try:
        client = service.create_training_client()
        job_id = service.trainer_job_id
        control = TrainerJobManager(api_key=api_key, base_url=fcfg.base_url)
    except BaseException:
        _close_quietly(service)
        raise
    return service, client, control, job_id


def make_trainer(cfg: Any, run_dir: Path | str | None = None) -> FireworksTrainer:
    """The main job's Fireworks trainer from a validated `runner.config.Config`.

    Validates ``[fireworks]`` (`runner.fireworks.validate_static`), reads the API key from the
    environment variable named by ``api_key_env`` (the error names the variable, never a value)
    and connects (`_connect`).
    """
    validate_static(cfg)
    f = cfg.fireworks
    api_key = api_key_from_env(f.api_key_env)
    probe(
        f.base_url,
        timeout_s=f.connect_timeout_s,
        what="Fireworks control plane",
        setting="[fireworks].connect_timeout_s",
    )
    try:
        service, client, control, job_id = _connect(f, api_key)
    except Exception as exc:  # noqa: BLE001 - any provisioning failure: one line, no traceback
        raise FireworksRequestError(
            f"Fireworks ({f.base_url}): cannot provision a trainer for {f.base_model!r}: "
            f"{type(exc).__name__}: {_first_line(str(exc))}"
        ) from None
    return FireworksTrainer(
        client,
        service=service,
        control_plane=control,
        trainer_job_id=job_id,
        base_model=f.base_model,
        max_seq_len=f.max_seq_len,
        request_timeout_s=f.request_timeout_s,
        identity_timeout_s=f.identity_timeout_s,
        output_model_id=f.output_model_id or None,
        delete_trainer_after_promotion=f.delete_trainer_after_promotion,
        modality=f.modality,
        base_url=f.base_url,
    )
