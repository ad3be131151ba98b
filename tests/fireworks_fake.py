"""An in-process fake of the Fireworks training service, sampler and control plane.

Superseded by the local server (`runner.serve`, its Fireworks flavour): the Fireworks backend's
tests run the real SDK against it (tests/test_fireworks*.py, tests/test_serve_fireworks.py).
What still uses this fake: tests/test_kernels.py (the opt-in ``reinforce`` kernel through
``FireworksTrainer``) and tests/test_protocols.py (the trainer's capabilities).

`FakeFireworks` is one "account": trainer jobs (each backed by a `runner.local.LocalTrainer`),
their DCP and sampler checkpoints, control-plane rows shaped like
``TrainerJobManager.list_checkpoints`` rows, promoted models and deletions. `FakeTrainingClient`
has the method signatures of ``FiretitanTrainingClient`` (tests compare them with
``inspect.signature``) and returns the SDK's own result types: ``ForwardBackwardOutput`` and
``OptimStepResponse`` in the SDK's ``_ImmediateAPIFuture``, ``SaveWeightsResponse``,
``SaveSamplerResult``, ``SampleResponse`` of ``SampledSequence``. Every request also goes
through the SDK's client-side validation (``Datum`` coercion, ``_target_logprob_support``,
``_validate_loss_capabilities``, ``_validate_checkpoint_ref``, ``validate_output_model_id``) and is
serialized exactly as the SDK's transport does (``model_dump(to_pydantic_request(...))``), then
re-validated against the SDK's pydantic wire schema; the bodies are kept in
`FakeFireworks.requests`.

Knobs for failure injection: ``rename`` (the server stores a DCP under another name),
``extra_rows_on_save`` (ambiguous rows), ``row_lag`` (rows appear only after N listings),
``hide_rows``, ``list_fails``, ``promote_error``, ``delete_noop``, ``ce_backward_logprobs``,
``save_state_delay``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from fireworks.training.sdk import types
from fireworks.training.sdk._core._compat import model_dump
from fireworks.training.sdk._core.lib._pydantic_conv import to_pydantic_request
from fireworks.training.sdk._core.lib.public_interfaces.training_client import TrainingClient
from fireworks.training.sdk.client import (
    FiretitanTrainingClient,
    SaveSamplerResult,
    _add_cross_entropy_response_tokens,
    _grad_accumulation_normalization_value,
    _ImmediateAPIFuture,
    _target_logprob_support,
    _validate_checkpoint_ref,
    qualify_snapshot_name,
)
from fireworks.training.sdk.fireworks_client import validate_output_model_id

import runner
from runner.local import LocalTrainer, LocalTrainerConfig

ACCOUNT = "acct"
_RL_INPUTS = ("logprobs", "advantages")


def _resource(job: str, name: str) -> str:
    return f"accounts/{ACCOUNT}/rlorTrainerJobs/{job}/checkpoints/{name}"


def wire_body(request: Any, extra_body: dict | None = None) -> dict:
    """The JSON body the SDK's transport sends for ``request`` (its own serializer), validated
    back against the SDK's pydantic wire schema."""
    pyd = to_pydantic_request(request) if not hasattr(request, "model_dump") else request
    body = model_dump(pyd, exclude_unset=False, exclude_none=True, mode="json")
    type(pyd).model_validate(body)
    return {**body, **(extra_body or {})}


def datums_to_seqs(data: list[types.Datum], fields: tuple[str, ...]) -> list[runner.Seq]:
    """The server side of the wire: datums back to full-token `runner.Seq`s."""
    seqs = []
    for i, d in enumerate(data):
        model_input = np.asarray(d.model_input.to_ints(), np.int64)
        targets = d.loss_fn_inputs["target_tokens"].to_numpy()
        if targets.shape != model_input.shape or not np.array_equal(targets[:-1], model_input[1:]):
            raise ValueError(f"datum {i}: target_tokens are not model_input shifted by one")
        extra = sorted(set(d.loss_fn_inputs) - {"target_tokens", *fields})
        if extra:
            raise ValueError(f"datum {i}: unexpected loss_fn_inputs {extra}")
        tokens = np.concatenate([model_input, targets[-1:]])
        inputs = {}
        for f in fields:
            td = d.loss_fn_inputs[f]
            if td.dtype != "float32":
                raise ValueError(f"datum {i}: {f} has dtype {td.dtype}")
            inputs[f] = td.to_numpy().astype(np.float64)
        seqs.append(runner.Seq(tokens, inputs))
    return seqs


@dataclasses.dataclass
class FakeJob:
    id: str
    local: LocalTrainer
    dcp: dict[str, str] = dataclasses.field(default_factory=dict)
    samplers: dict[str, Any] = dataclasses.field(default_factory=dict)
    rows: list[dict] = dataclasses.field(default_factory=list)
    state: str = "JOB_STATE_RUNNING"


class FakeFireworks:
    """One fake account: jobs, checkpoints, the control plane (`control`) and promoted models."""

    def __init__(self, root: Path | str, local_config: LocalTrainerConfig) -> None:
        self.root = Path(root)
        self.local_config = local_config
        self.jobs: dict[str, FakeJob] = {}
        self.control = FakeControlPlane(self)
        self.requests: list[tuple[str, dict]] = []
        self.events: list[tuple[str, str]] = []
        self.models: dict[str, dict] = {}
        self.list_calls = 0
        self.counters = {"forward": 0, "forward_backward": 0, "optim_step": 0, "sample": 0}
        # failure injection
        self.rename: Callable[[str, FakeJob], str] | None = None
        self.extra_rows_on_save = 0
        self.row_lag = 0
        self.hide_rows = False
        self.list_fails: bool | int = False
        self.promote_error: Exception | None = None
        self.delete_noop = False
        self.ce_backward_logprobs = True
        self.save_state_delay = 0.0
        self._sampler_trainer: LocalTrainer | None = None
        self._lock = threading.RLock()
        self._clock = 0

    # -- jobs -------------------------------------------------------------------------------

    def connect(self, job_id: str | None = None) -> FakeTrainingClient:
        """A training client on job ``job_id`` (reattached if it exists; new otherwise)."""
        with self._lock:
            if job_id is None:
                job_id = f"job-{len(self.jobs) + 1:04d}"
            job = self.jobs.get(job_id)
            if job is None:
                cfg = dataclasses.replace(
                    self.local_config, checkpoint_dir=str(self.root / "jobs" / job_id)
                )
                job = FakeJob(job_id, LocalTrainer(cfg))
                self.jobs[job_id] = job
            if job.state != "JOB_STATE_RUNNING":
                raise RuntimeError(f"trainer job {job_id} is {job.state}")
            return FakeTrainingClient(self, job)

    def add_row(self, job: FakeJob, name: str, ctype: str, promotable: bool) -> dict:
        with self._lock:
            self._clock += 1
            stamp = f"2026-01-01T00:00:{self._clock:02d}Z"
            row = {
                "name": _resource(job.id, name),
                "createTime": stamp,
                "updateTime": stamp,
                "checkpointType": ctype,
                "promotable": promotable,
                "_visible_after": self.list_calls + self.row_lag,
            }
            job.rows.append(row)
            return row

    def sampler_trainer(self) -> LocalTrainer:
        if self._sampler_trainer is None:
            self._sampler_trainer = LocalTrainer(
                dataclasses.replace(self.local_config, checkpoint_dir=None)
            )
        return self._sampler_trainer


class FakeControlPlane:
    """``TrainerJobManager``'s control-plane methods over a `FakeFireworks`."""

    def __init__(self, world: FakeFireworks) -> None:
        self.world = world

    def list_checkpoints(self, job_id: str, *, page_size: int = 200) -> list[dict]:
        w = self.world
        with w._lock:
            w.list_calls += 1
            if w.list_fails:
                if not isinstance(w.list_fails, bool):
                    w.list_fails -= 1
                raise RuntimeError(f"Failed to list checkpoints for trainer job '{job_id}'")
            job = w.jobs.get(job_id)
            if job is None:
                raise RuntimeError(f"Trainer job '{job_id}' was not found in this account")
            if w.hide_rows:
                return []
            return [
                {k: v for k, v in r.items() if not k.startswith("_")}
                for r in job.rows
                if r["_visible_after"] < w.list_calls
            ]

    def promote_checkpoint(
        self,
        job_id: str | None = None,
        checkpoint_id: str | None = None,
        output_model_id: str | None = None,
        base_model: str | None = None,
        *,
        name: str | None = None,
        hot_load_deployment_id: str | None = None,
    ) -> dict:
        w = self.world
        errors = validate_output_model_id(output_model_id)
        if errors or not base_model:
            raise ValueError("\n\n".join(errors) or "output_model_id and base_model are required")
        if w.promote_error is not None:
            raise w.promote_error
        rows = [r for j in w.jobs.values() for r in j.rows if r["name"] == name]
        if len(rows) != 1 or rows[0]["promotable"] is not True:
            raise RuntimeError(f"checkpoint {name!r} is not promotable")
        model = {
            "name": f"accounts/{ACCOUNT}/models/{output_model_id}",
            "state": "READY",
            "kind": "HF_BASE_MODEL",
            "baseModel": base_model,
            "checkpoint": name,
        }
        w.models[output_model_id] = model
        w.events.append(("promote", name))
        return dict(model)

    def delete(self, job_id: str) -> None:
        w = self.world
        w.events.append(("delete", job_id))
        if not w.delete_noop and job_id in w.jobs:
            w.jobs[job_id].state = "JOB_STATE_DELETED"

    def try_get(self, job_id: str) -> dict[str, Any] | None:
        job = self.world.jobs.get(job_id)
        if job is None:
            return None
        return {"name": f"accounts/{ACCOUNT}/rlorTrainerJobs/{job_id}", "state": job.state}


class _LazySampleFuture:
    """A sample future that resolves, on first ``result()``, every pending request of its
    sampling client in one `LocalTrainer.sample` call (prompt ``i`` of a call at row ``i``)."""

    def __init__(self, owner: FakeSamplingClient) -> None:
        self._owner = owner
        self._value: Any = None
        self._done = False

    def set(self, value: Any) -> None:
        self._value, self._done = value, True

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._owner.flush()
        return self._value


class FakeSamplingClient:
    """``FiretitanSamplingClient.sample`` over a hot-loaded weights snapshot."""

    def __init__(self, world: FakeFireworks, params: Any) -> None:
        self.world = world
        self.params = params
        self.closed = False
        self._pending: list[tuple[list[int], int, types.SamplingParams, _LazySampleFuture]] = []

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        *,
        images: list[str] | None = None,
    ) -> _LazySampleFuture:
        if self.closed:
            raise RuntimeError("sampling client is closed")
        if topk_prompt_logprobs or include_prompt_logprobs or images:
            raise NotImplementedError("fake sampler: prompt logprobs and images unsupported")
        fut = _LazySampleFuture(self)
        self._pending.append((prompt.to_ints(), num_samples, sampling_params, fut))
        self.world.counters["sample"] += 1
        return fut

    def flush(self) -> None:
        from runner.fireworks._seeds import decode_sample_seed

        pending, self._pending = self._pending, []
        groups: dict[tuple, list] = {}
        for tokens, n, sp, fut in pending:
            base, index, sample = decode_sample_seed(int(sp.seed))
            key = (base, sp.max_tokens, float(sp.temperature), tuple(sp.stop or ()))
            groups.setdefault(key, []).append((index, sample, n, tokens, fut))
        trainer = self.world.sampler_trainer()
        trainer.set_params(self.params)
        for (base, max_tokens, temperature, stop), items in groups.items():
            prompts: list[list[int]] = [[0]] * (max(i for i, *_ in items) + 1)
            for i, _, _, tokens, _ in items:
                prompts[i] = tokens
            out = trainer.sample(
                prompts,
                num_samples=max(j + n for _, j, n, _, _ in items),
                max_tokens=max_tokens,
                temperature=temperature,
                seed=base,
                stop_token_ids=stop,
            )
            for i, j, n, _, fut in items:
                fut.set(
                    types.SampleResponse(
                        sequences=[
                            types.SampledSequence(
                                stop_reason=s.stop_reason,
                                tokens_np=s.tokens.astype(np.int32),
                                logprobs_np=s.logprobs.astype(np.float32),
                            )
                            for s in out[i][j : j + n]
                        ]
                    )
                )

    def close(self, drain_timeout_s: float = 3600.0) -> None:
        self.closed = True


class FakeTrainingClient:
    """``FiretitanTrainingClient``'s methods over one `FakeJob` (numbers from `LocalTrainer`)."""

    supports_target_logprob_support = False
    supports_reinforce = False
    supports_score_centering = False
    supports_policy_importance_sampling = False
    supports_policy_diagnostics = False

    def __init__(self, world: FakeFireworks, job: FakeJob) -> None:
        self.world = world
        self.job = job
        self.session_id = f"{len(world.jobs):04x}{id(self) % 0xFFFF:04x}"
        self._seq = 0
        self._sampler_saved = False

    @property
    def local(self) -> LocalTrainer:
        return self.job.local

    def _alive(self) -> None:
        if self.job.state != "JOB_STATE_RUNNING":
            raise RuntimeError(f"trainer job {self.job.id} is {self.job.state}")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _validate(self, loss_fn: str, loss_fn_config: dict | None) -> str:
        FiretitanTrainingClient._validate_loss_capabilities(self, loss_fn, loss_fn_config)
        return _target_logprob_support(loss_fn_config)

    # -- training ---------------------------------------------------------------------------

    def forward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: dict[str, float | str | bool] | None = None,
    ) -> _ImmediateAPIFuture:
        self._alive()
        if self._validate(loss_fn, loss_fn_config) != "full_vocabulary":
            raise ValueError("target_logprob_support requires forward_backward, not forward")
        request = types.ForwardRequest(
            forward_input=types.ForwardBackwardInput(
                data=list(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config
            ),
            model_id=self.job.id,
            seq_id=self._next_seq(),
        )
        self.world.requests.append(("forward", wire_body(request)))
        if loss_fn != "cross_entropy":
            raise NotImplementedError("fake forward: cross_entropy only")
        fields = ("weights",) if all("weights" in d.loss_fn_inputs for d in data) else ()
        seqs = datums_to_seqs(list(data), fields)
        lps = self.local.forward(seqs)
        loss = sum(
            float(-(lp.astype(np.float64) * s.inputs.get("weights", 0.0)).sum())
            for lp, s in zip(lps, seqs, strict=True)
        )
        self.world.counters["forward"] += 1
        return _ImmediateAPIFuture(
            types.ForwardBackwardOutput(
                loss_fn_output_type="ArrayRecord",
                loss_fn_outputs=[
                    {"logprobs": types.TensorData.from_numpy(lp.astype(np.float32))} for lp in lps
                ],
                metrics={"loss:sum": loss},
            )
        )

    def forward_backward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: dict[str, float | str | bool] | None = None,
    ) -> _ImmediateAPIFuture:
        self._alive()
        support = self._validate(loss_fn, loss_fn_config)
        if support == "sampling_support" and not self.supports_target_logprob_support:
            raise ValueError(  # the check inlined in FiretitanTrainingClient.forward_backward
                "Trainer does not advertise target_logprob_support='sampling_support'; "
                "upgrade the trainer or select target_logprob_support='full_vocabulary'"
            )
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=list(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config
            ),
            model_id=self.job.id,
            seq_id=self._next_seq(),
        )
        self.world.requests.append(("forward_backward", wire_body(request)))
        fields = ("weights",) if loss_fn == "cross_entropy" else _RL_INPUTS
        seqs = datums_to_seqs(list(data), fields)
        local_cfg = {
            k: v for k, v in (loss_fn_config or {}).items() if k != "target_logprob_support"
        }
        result = self.local.forward_backward(seqs, loss_fn, local_cfg)
        self.world.counters["forward_backward"] += 1
        with_lp = loss_fn != "cross_entropy" or self.world.ce_backward_logprobs
        output = types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=[
                {"logprobs": types.TensorData.from_numpy(lp.astype(np.float32))}
                for lp in result.logprobs
            ]
            if with_lp
            else [],
            metrics=dict(result.metrics),
        )
        if loss_fn == "cross_entropy":
            output = _add_cross_entropy_response_tokens(output, data=list(data))
        return _ImmediateAPIFuture(output)

    async def forward_backward_async(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: dict[str, float] | None = None,
    ) -> _ImmediateAPIFuture:
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self,
        data: list[types.Datum],
        loss_fn: Callable,
        *,
        loss_type_input: str = "logprobs",
        output: str = "logprobs",
        pooling: str = "mean",
        precomputed_forward: types.ForwardBackwardOutput | None = None,
    ) -> Any:
        """The SDK's own custom-loss algorithm (needs torch), run against this fake."""
        if output != "logprobs":
            raise NotImplementedError("fake: logprobs output only")
        if precomputed_forward is None:
            forward_data = TrainingClient._get_custom_loss_forward_data(self, data, "cross_entropy")
            precomputed_forward = self.forward(forward_data, "cross_entropy").result()
        return asyncio.run(
            FiretitanTrainingClient._forward_backward_custom_from_forward_async(
                self,
                list(data),
                loss_fn,
                precomputed_forward=precomputed_forward,
                loss_type_input=loss_type_input,
            )
        )

    def optim_step(
        self,
        adam_params: types.AdamParams,
        grad_accumulation_normalization: Any = None,
        emit_grad_norm_metrics: Any = None,
    ) -> _ImmediateAPIFuture:
        self._alive()
        if not isinstance(adam_params, types.AdamParams):
            raise TypeError(f"adam_params must be types.AdamParams, got {type(adam_params)}")
        value = _grad_accumulation_normalization_value(grad_accumulation_normalization)
        extra = {} if value is None else {"grad_accumulation_normalization": value}
        request = types.OptimStepRequest(
            adam_params=adam_params, model_id=self.job.id, seq_id=self._next_seq()
        )
        self.world.requests.append(("optim_step", wire_body(request, extra)))
        metrics = self.local.optim_step(
            runner.AdamParams(
                learning_rate=adam_params.learning_rate,
                beta1=adam_params.beta1,
                beta2=adam_params.beta2,
                eps=adam_params.eps,
                weight_decay=adam_params.weight_decay,
                grad_clip_norm=adam_params.grad_clip_norm,
            ),
            value or "none",
        )
        self.world.counters["optim_step"] += 1
        return _ImmediateAPIFuture(types.OptimStepResponse(metrics=metrics))

    # -- checkpoints ------------------------------------------------------------------------

    def save_state(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        *,
        timeout: float | None = None,
    ) -> _ImmediateAPIFuture:
        self._alive()
        if ttl_seconds is not None or overwrite:
            raise NotImplementedError("ttl_seconds/overwrite are not supported")
        w = self.world
        if w.save_state_delay:
            time.sleep(w.save_state_delay)
        stored = w.rename(name, self.job) if w.rename else name
        path = self.local.save_state(stored)
        self.job.dcp[stored] = path
        w.add_row(self.job, stored, "CHECKPOINT_TYPE_TRAINING", False)
        for k in range(w.extra_rows_on_save):
            w.add_row(self.job, f"{stored}-shadow{k}", "CHECKPOINT_TYPE_TRAINING", False)
        return _ImmediateAPIFuture(
            types.SaveWeightsResponse(path=f"tinker://{self.job.id}/weights/{stored}")
        )

    def _find_dcp(self, path: str) -> str:
        ref = _validate_checkpoint_ref(path)
        if ref.startswith("cross_job://"):
            job_id, name = ref[len("cross_job://") :].split("/", 1)
            job = self.world.jobs.get(job_id)
        else:
            job, name = self.job, ref
        if job is None or name not in job.dcp:
            raise RuntimeError(f"checkpoint {ref!r} not found")
        self.world.events.append(("load", ref))
        return job.dcp[name]

    def load_state(self, path: str, weights_access_token: str | None = None) -> _ImmediateAPIFuture:
        self._alive()
        if weights_access_token is not None:
            raise NotImplementedError("weights_access_token is not supported")
        self.local.load_state(self._find_dcp(path), with_optimizer=False)
        return _ImmediateAPIFuture(types.LoadWeightsResponse(path=path))

    def load_state_with_optimizer(
        self, path: str, weights_access_token: str | None = None
    ) -> _ImmediateAPIFuture:
        self._alive()
        if weights_access_token is not None:
            raise NotImplementedError("weights_access_token is not supported")
        self.local.load_state(self._find_dcp(path), with_optimizer=True)
        return _ImmediateAPIFuture(types.LoadWeightsResponse(path=path))

    def save_weights_for_sampler(
        self,
        name: str,
        ttl_seconds: int | None = None,
        *,
        checkpoint_type: str | None = None,
        export_precision: Any = None,
        metadata: Any = None,
    ) -> _ImmediateAPIFuture:
        result = self.save_weights_for_sampler_ext(
            name, checkpoint_type=checkpoint_type, ttl_seconds=ttl_seconds
        )
        return _ImmediateAPIFuture(types.SaveWeightsForSamplerResponse(path=result.path))

    def save_weights_for_sampler_ext(
        self,
        name: str,
        checkpoint_type: str | None = None,
        ttl_seconds: int | None = None,
        export_precision: Any = None,
        metadata: Any = None,
    ) -> SaveSamplerResult:
        self._alive()
        if ttl_seconds is not None:
            raise NotImplementedError("ttl_seconds is not supported")
        ctype = checkpoint_type or ("delta" if self._sampler_saved else "base")
        if ctype not in ("base", "delta"):
            raise ValueError(f"unsupported checkpoint_type {ctype!r}")
        actual = qualify_snapshot_name(self.session_id, name)
        path = f"sampler_weights/{actual}"
        self.job.samplers[path] = jax.tree.map(np.asarray, self.local.params)
        self._sampler_saved = True
        if ctype == "base":
            self.world.add_row(self.job, actual, "CHECKPOINT_TYPE_INFERENCE_BASE", True)
        else:
            self.world.add_row(self.job, actual, "CHECKPOINT_TYPE_INFERENCE_DELTA", False)
        return SaveSamplerResult(path=path, snapshot_name=actual)

    def create_sampling_client(
        self, model_path: str, retry_config: Any = None
    ) -> FakeSamplingClient:
        self._alive()
        if model_path not in self.job.samplers:
            raise RuntimeError(f"Hotload failed for sampler snapshot {model_path!r}")
        return FakeSamplingClient(self.world, self.job.samplers[model_path])

    def list_checkpoints(self) -> list[str]:
        return sorted(self.job.dcp)

    def resolve_checkpoint_path(
        self, checkpoint_name: str, source_job_id: str | None = None
    ) -> str:
        return FiretitanTrainingClient.resolve_checkpoint_path(self, checkpoint_name, source_job_id)


def local_config_from(cfg: Any) -> LocalTrainerConfig:
    """The `LocalTrainerConfig` ``runner.train.make_trainer`` builds for the local backend."""
    from runner.env import tokenizer

    m = cfg.model
    return LocalTrainerConfig(
        vocab_size=tokenizer.VOCAB_SIZE,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        d_ff=m.d_ff,
        max_seq_len=m.max_seq_len,
        seed=cfg.run.seed,
    )
