"""The Fireworks flavour of the local server: the ``fireworks-ai[training-sdk]`` 1.2.30 SDK.

The SDK's training client (its vendored Tinker 0.23 runtime, User-Agent ``AsyncTinker/Python
0.23.0``) speaks JSON: ``forward`` and ``forward_backward`` bodies carry ``TensorData`` datums;
``optim_step`` adds the top-level ``grad_accumulation_normalization`` and
``save_weights_for_sampler`` the top-level ``checkpoint_type`` (plus ``export_precision`` and
``metadata``), which its own request models lack (docs/wire.md#endpoints-and-encodings (and #lenient-parsing)). Bodies
are validated with the SDK's own pydantic models (``fireworks.training.sdk.types``) after those
extras are removed (`runner.serve._core.parse_model`); results are JSON, and protobuf for
``forward``/``forward_backward`` when the client accepts it.

Trainer jobs (`runner.serve._fw_control`): a client whose base URL is a trainer's gateway prefix
``/training/v1/rlorTrainerJobs/<account>/<job>`` trains on that job; its sessions and models
belong to the job, and checkpoint names live in the job's namespace: ``save_state(name)``
answers the bare ``name`` (the SDK's logical reference), ``load_state(name)`` finds it among
every model of the job (a reattached trainer resumes by name), ``cross_job://<job>/<name>`` in
another job's, and every save adds a control-plane row (``CHECKPOINT_TYPE_TRAINING``, or the
sampler's ``CHECKPOINT_TYPE_INFERENCE_BASE`` (promotable) / ``..._INFERENCE_ARC_V2`` (delta)).
A client on the bare URL or the serverless prefix gets a namespace of its session.

Sampling (`runner.serve._fw_sampling`): streamed completions under ``/inference/v1``.

A ``forward`` with ``cross_entropy`` takes datums without ``weights`` (every target counts, as
in the SDK's ``response_tokens``); ``forward_backward`` requires every kernel input. The
``create_model`` result advertises ``supports_reinforce`` (the kernel table's ``reinforce``).

What this flavour does not implement (a user error says so): image chunks, targets that are not
the next tokens, reference (``base_only``) models, projection heads, ``load_adapter``, LoRA on
the unembedding or with another ``init_method`` than kaiming (LoRA of a rank > 0 trains adapters
on a decoder base; the toy model trains full weights, the rank recorded), ``merged_base``
exports, checkpoint TTLs, serverless ``<account>/run-<id>/<name>`` references, RDMA weight sync
and router replay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import web
from fireworks.training.sdk import types as ft
from fireworks.training.sdk.types._pydantic_types.forward_backward_request import (
    ForwardBackwardRequest as WireForwardBackwardRequest,
)
from fireworks.training.sdk.types._pydantic_types.forward_request import (
    ForwardRequest as WireForwardRequest,
)

from runner._kernels import KERNELS
from runner._types import NORMALIZATIONS, AdamParams, Seq
from runner.serve._core import (
    Payload,
    ServeError,
    Server,
    json_response,
    over_limit,
    parse_model,
    retrieve,
    user_error,
)
from runner.serve._engine import LoraRequest
from runner.serve._fw_control import (
    SAMPLER_TYPES,
    ControlPlane,
    Namespace,
    check_label,
    resolve_ref,
)
from runner.serve._fw_sampling import SamplingRoutes

#: The SDK's training runtime identifies itself so (its vendored Tinker client's version).
USER_AGENT_PREFIX = "AsyncTinker/Python 0.23"
GATEWAY_PREFIX = "/training/v1/rlorTrainerJobs/"


# -- datums -------------------------------------------------------------------------------------


def _tensor(td: Any, where: str) -> np.ndarray:
    """A wire ``TensorData`` (validated) as a numpy array of its dtype."""
    dtype = np.dtype(np.int64 if td.dtype == "int64" else np.float32)
    try:
        values = np.asarray(td.data, dtype)
    except (TypeError, ValueError, OverflowError):
        raise user_error(f"{where}: data is not a list of {dtype} numbers") from None
    shape = [int(s) for s in td.shape] if td.shape is not None else None
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        crow, col = td.sparse_crow_indices, td.sparse_col_indices
        if crow is None or col is None or shape is None or len(shape) != 2:
            raise user_error(
                f"{where}: a sparse CSR tensor needs sparse_crow_indices, sparse_col_indices and "
                "a 2-D shape"
            )
        crow, col = np.asarray(crow, np.int64), np.asarray(col, np.int64)
        if crow.shape[0] != shape[0] + 1 or col.shape != values.shape or np.any(np.diff(crow) < 0):
            raise user_error(f"{where}: inconsistent sparse CSR indices")
        if crow[0] != 0 or crow[-1] != values.shape[0]:
            raise user_error(f"{where}: inconsistent sparse CSR indices")
        if col.size and (col.min() < 0 or col.max() >= shape[1]):
            raise user_error(f"{where}: sparse CSR column index out of range")
        dense = np.zeros(shape, dtype)
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
        return dense
    if shape is not None:
        if any(s < 0 for s in shape) or math.prod(shape) != values.size:
            raise user_error(f"{where}: shape {shape} does not match {values.size} values")
        values = values.reshape(shape)
    return values


def datum_to_seq(datum: Any, index: int) -> Seq:
    """A wire ``Datum`` as a `runner.Seq` (next-token targets only; a user error otherwise)."""
    where = f"datum {index}"
    parts = []
    for chunk in datum.model_input.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise user_error(
                f"{where}: {getattr(chunk, 'type', type(chunk).__name__)} chunks are not "
                "supported (text tokens only)"
            )
        parts.append(np.asarray(list(chunk.tokens), np.int64))
    mi = datum.model_input
    if mi.routing_matrices or mi.routing_references or mi.top_sampling_references:
        raise user_error(f"{where}: router replay and sampling references are not supported")
    model_input = np.concatenate(parts) if parts else np.zeros((0,), np.int64)
    inputs = {
        name: _tensor(td, f"{where} loss_fn_inputs['{name}']")
        for name, td in datum.loss_fn_inputs.items()
    }
    targets = inputs.pop("target_tokens", None)
    if targets is None:
        raise user_error(f"{where}: loss_fn_inputs has no 'target_tokens'")
    if targets.ndim > 1 and targets.shape[-1] == 1:
        targets = targets.reshape(-1)
    if targets.ndim != 1 or targets.shape[0] != model_input.shape[0] or not targets.size:
        raise user_error(
            f"{where}: target_tokens must be 1-D with one target per model input token "
            f"({model_input.shape[0]}), got shape {list(targets.shape)}"
        )
    if targets.dtype != np.int64:
        raise user_error(f"{where}: target_tokens must have dtype int64")
    if not np.array_equal(model_input[1:], targets[:-1]):
        raise user_error(
            f"{where}: target_tokens must be the model input shifted by one (next-token "
            "targets); the local server trains next-token targets only"
        )
    for name, arr in inputs.items():
        if arr.dtype != np.float32:
            raise user_error(f"{where}: loss_fn_inputs['{name}'] must have dtype float32")
        if arr.ndim > 1 and arr.shape[-1] == 1:
            inputs[name] = arr.reshape(-1)
    return Seq(np.concatenate([model_input, targets[-1:]]), inputs)


def _fb_output(logprobs: list[np.ndarray], metrics: Mapping[str, float]) -> Payload:
    """A ``ForwardBackwardOutput`` as JSON (and protobuf, which the SDK also accepts)."""
    from runner.serve._tinker import forward_backward_output

    arrays = [np.asarray(lp, np.float32).reshape(-1) for lp in logprobs]
    body = {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {"logprobs": {"data": a.tolist(), "dtype": "float32", "shape": [a.shape[0]]}}
            for a in arrays
        ],
        "metrics": {k: float(v) for k, v in metrics.items()},
    }
    return Payload(json=body, proto=forward_backward_output(arrays, metrics))


# -- the flavour --------------------------------------------------------------------------------


class FireworksFlavour:
    """The Fireworks SDK (`runner.serve._core.Flavour`).

    Claims the SDK's training runtime (User-Agent ``AsyncTinker/Python 0.23``) and every request
    under a trainer's gateway prefix; serves the control plane (`ControlPlane`) and the
    completions endpoint (`SamplingRoutes`) as its own routes.

    Args:
      state_dir: the server's state directory (the control plane keeps its records below
        ``<state_dir>/fireworks``).
      account: the one account the control plane reports.
    """

    name = "fireworks"
    #: Checked before flavours with a broader claim (tinker claims every ``AsyncTinker/``).
    claim_priority = 1

    def __init__(self, state_dir: str, account: str = "foldloss-local") -> None:
        self.control = ControlPlane(state_dir, account)
        self.sampling = SamplingRoutes(self.control)
        self.handlers = {
            "healthz": self.healthz,
            "create_session": self.create_session,
            "retrieve_future": self.retrieve_future,
            "create_model": self.create_model,
            "forward": self.forward,
            "forward_backward": self.forward_backward,
            "optim_step": self.optim_step,
            "save_weights": self.save_weights,
            "load_weights": self.load_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler,
            "list_checkpoints": self.list_checkpoints,
            "unload_model": self.unload_model,
            **self.control.handlers,
            **self.sampling.handlers,
        }
        self.extra_routes = {
            "load_adapter": ("POST", "/api/v1/load_adapter"),
            **self.control.routes,
            **self.sampling.routes,
        }
        self.handlers["load_adapter"] = self.load_adapter
        self._session_ns: dict[str, Namespace] = {}
        self._model_ns: dict[str, Namespace] = {}

    def claims(self, request: web.Request) -> bool:
        agent = request.headers.get("User-Agent", "")
        return agent.startswith(USER_AGENT_PREFIX) or request.path.startswith(GATEWAY_PREFIX)

    # -- sessions and namespaces --------------------------------------------------------------

    def _gateway_job(self, request: web.Request) -> str | None:
        """The trainer job of a gateway-prefixed request (a user error when it is not live)."""
        account, job = request.match_info.get("account"), request.match_info.get("job")
        if job is None:
            return None
        self.control.check_account(account)
        record = self.control.job(job)
        if record["state"] != "JOB_STATE_RUNNING":
            raise user_error(f"trainer job {job} is {record['state']}, not running", 410)
        return job

    def _namespace(self, model_id: str) -> Namespace:
        ns = self._model_ns.get(model_id)
        if ns is None:
            raise user_error(f"unknown model_id {model_id!r} (not loaded on this server)", 404)
        if ns.job is not None:
            state = self.control.job(ns.job)["state"]
            if state != "JOB_STATE_RUNNING":
                raise user_error(f"trainer job {ns.job} is {state}: its models are gone", 410)
        return ns

    async def healthz(self, server: Server, request: web.Request) -> web.Response:
        self._gateway_job(request)
        return json_response({"status": "ok"})

    async def create_session(self, server: Server, request: web.Request) -> web.Response:
        job = self._gateway_job(request)
        req, _ = parse_model(
            ft.CreateSessionRequest, await server.json(request), what="create_session"
        )
        if req.project_id is not None:
            raise user_error("create_session: project_id is not supported")
        session = server.new_session(self.name, req.sdk_version, request)
        self._session_ns[session.session_id] = Namespace(job, session.session_id)
        return json_response({"type": "create_session", "session_id": session.session_id})

    async def retrieve_future(self, server: Server, request: web.Request) -> web.StreamResponse:
        req, _ = parse_model(
            ft.FutureRetrieveRequest, await server.json(request), what="retrieve_future"
        )
        accept = request.headers.get("Accept", "")
        return await retrieve(server.futures, req.request_id, accept, server.config.long_poll_s)

    # -- models -------------------------------------------------------------------------------

    async def create_model(self, server: Server, request: web.Request) -> web.Response:
        body = await server.json(request)
        req, _ = parse_model(ft.CreateModelRequest, body, what="create_model")
        if body.get("base_only"):
            raise user_error("create_model: reference (base_only) models are not supported")
        if req.projection_head_dim:
            raise user_error("create_model: projection heads are not supported")
        session = server.session(req.session_id)
        ns = self._session_ns.get(session.session_id)
        if ns is None:
            raise user_error(f"session {session.session_id} is not a Fireworks session")
        model_id = f"{session.session_id}:train:{req.model_seq_id}"
        known = session.model_seq.get(req.model_seq_id)
        if known is not None:  # a resubmission
            return json_response({"request_id": known, "model_id": model_id})
        base = server.engine.base(req.base_model)  # an unknown base model fails here, at once
        server.check_new_model(session)
        if ns.job is not None:
            self.control.check_base(ns.job, base.name)
        lora = req.lora_config
        rank = int(lora.rank) if lora is not None else 0
        if rank < 0:
            raise user_error(f"create_model: lora_config.rank must be >= 0, got {rank}")
        request = None
        if lora is not None:
            if rank and base.supports_lora and lora.init_method not in (None, "kaiming"):
                raise user_error(
                    f"create_model: lora_config.init_method {lora.init_method!r} is not "
                    "supported (the local trainer's LoRA initializes as 'kaiming')"
                )
            # the SDK sends alpha (default 32); None asks for the backend's default, 2·rank
            request = LoraRequest(
                rank=rank,
                alpha=None if lora.alpha is None else float(lora.alpha),
                train_attn=bool(lora.train_attn),
                train_mlp=bool(lora.train_mlp),
                train_unembed=bool(lora.train_unembed),
                default_alpha=2.0 * rank,
            )
        fut = server.futures.create("CreateModel")
        session.model_seq[req.model_seq_id] = fut.request_id

        def build():
            return server.engine.create_model(
                model_id,
                base.name,
                seed=lora.seed if lora is not None else None,
                lora=request,
                flavour=self.name,
            )

        def done(_):
            server.add_queue(model_id)
            self._model_ns[model_id] = ns
            if ns.job is not None:
                self.control.add_model(ns.job, model_id)
            # capabilities the SDK gates on: the kernel table's reinforce runs here
            fut.complete(
                Payload(
                    json={
                        "model_id": model_id,
                        "type": "create_model",
                        "supports_reinforce": "reinforce" in KERNELS,
                        "supports_target_logprob_support": False,
                    }
                )
            )

        server.complete_later(fut, build, done)
        return json_response({"request_id": fut.request_id, "model_id": model_id})

    async def unload_model(self, server: Server, request: web.Request) -> web.Response:
        req, _ = parse_model(ft.UnloadModelRequest, await server.json(request), what="unload_model")
        queue = server.queue(req.model_id)
        queue.close()
        server.queues.pop(req.model_id, None)
        server.engine.unload(req.model_id)
        self._model_ns.pop(req.model_id, None)
        fut = server.futures.completed(
            "UnloadModel", Payload(json={"model_id": req.model_id, "type": "unload_model"})
        )
        return json_response({"request_id": fut.request_id, "model_id": req.model_id})

    async def load_adapter(self, server: Server, request: web.Request) -> web.Response:
        body = await server.json(request)
        err = user_error("load_adapter: PEFT adapters are not supported by the local server")
        return await self._submit_error(server, body, "LoadAdapter", err)

    # -- ordered training requests ------------------------------------------------------------

    async def _submit_error(self, server, body, kind, err: ServeError) -> web.Response:
        """Fails a request in its seq_id turn when it names one (the id is consumed), else now."""
        queue = server.queue(body.get("model_id"))
        seq_id = body.get("seq_id")
        if isinstance(seq_id, int) and not isinstance(seq_id, bool):
            fut = queue.submit(seq_id, kind, err)
            return json_response({"request_id": fut.request_id, "model_id": queue.name})
        raise err

    async def _ordered(self, server, request, cls, what, kind, make_job) -> web.Response:
        body = await server.json(request)
        queue = server.queue(body.get("model_id"))
        try:
            req, _ = parse_model(cls, body, what=what)
            if req.seq_id is None:
                raise user_error(f"{what}: seq_id is required")
            job = make_job(req, body)
        except ServeError as err:
            return await self._submit_error(server, body, kind, err)
        fut = queue.submit(req.seq_id, kind, job)
        return json_response({"request_id": fut.request_id, "model_id": queue.name})

    def _fb(self, server: Server, forward_only: bool):
        def make_job(req, body):
            self._namespace(req.model_id)
            model = server.engine.model(req.model_id)
            fb = req.forward_input if forward_only else req.forward_backward_input
            if not fb.data:
                raise user_error("forward_backward: no data")
            over_limit(server.config, "max_batch_rows", "forward_backward's datums", len(fb.data))
            seqs = [datum_to_seq(d, i) for i, d in enumerate(fb.data)]
            if forward_only and fb.loss_fn == "cross_entropy":
                # a forward needs no weights: absent ones count every target (the SDK's
                # ``response_tokens`` rule), so ``loss:sum`` is the sequences' NLL
                seqs = [
                    s
                    if "weights" in s.inputs
                    else s.with_inputs(**s.inputs, weights=np.ones(s.num_targets, np.float32))
                    for s in seqs
                ]
            config = dict(fb.loss_fn_config or {})
            run = server.engine.forward if forward_only else server.engine.forward_backward

            def job() -> Payload:
                logprobs, metrics = run(model, seqs, fb.loss_fn, config)
                return _fb_output(logprobs, metrics)

            return job

        return make_job

    async def forward(self, server: Server, request: web.Request) -> web.Response:
        return await self._ordered(
            server, request, WireForwardRequest, "forward", "Forward", self._fb(server, True)
        )

    async def forward_backward(self, server: Server, request: web.Request) -> web.Response:
        return await self._ordered(
            server,
            request,
            WireForwardBackwardRequest,
            "forward_backward",
            "ForwardBackward",
            self._fb(server, False),
        )

    async def optim_step(self, server: Server, request: web.Request) -> web.Response:
        def make_job(req, body):
            self._namespace(req.model_id)
            model = server.engine.model(req.model_id)
            norm = body.get("grad_accumulation_normalization")
            if norm is not None and norm not in NORMALIZATIONS:
                raise user_error(
                    "optim_step: grad_accumulation_normalization must be one of "
                    f"{list(NORMALIZATIONS)}, got {norm!r}"
                )
            params = req.adam_params.model_dump(exclude={"emit_grad_norm_metrics"})
            try:
                adam = AdamParams(**params)
            except ValueError as exc:
                raise user_error(f"optim_step: {exc}") from None

            def job() -> Payload:
                metrics = server.engine.optim_step(model, adam, norm)
                return Payload(json={"metrics": metrics, "type": "optim_step"})

            return job

        return await self._ordered(
            server, request, ft.OptimStepRequest, "optim_step", "OptimStep", make_job
        )

    # -- checkpoints --------------------------------------------------------------------------

    async def save_weights(self, server: Server, request: web.Request) -> web.Response:
        def make_job(req, body):
            ns = self._namespace(req.model_id)
            model = server.engine.model(req.model_id)
            if req.ttl_seconds is not None or req.overwrite:
                raise user_error("save_weights: ttl_seconds and overwrite are not supported")
            name = check_label(req.path, "save_weights: path")

            def job() -> Payload:
                self.control.reserve(ns, name)
                try:
                    ref = server.engine.save(model, "state", name, overwrite=False)
                except BaseException:
                    self.control.release(ns, name)
                    raise
                self.control.add_checkpoint(ns, name, ref, "CHECKPOINT_TYPE_TRAINING", False)
                return Payload(json={"path": name, "type": "save_weights"})

            return job

        return await self._ordered(
            server, request, ft.SaveWeightsRequest, "save_weights", "SaveWeights", make_job
        )

    async def save_weights_for_sampler(self, server: Server, request: web.Request) -> web.Response:
        def make_job(req, body):
            ns = self._namespace(req.model_id)
            model = server.engine.model(req.model_id)
            if req.ttl_seconds is not None:
                raise user_error("save_weights_for_sampler: ttl_seconds is not supported")
            if req.path is None:
                raise user_error(
                    "save_weights_for_sampler: path is required (unnamed sampling sessions are "
                    "not supported by the Fireworks flavour)"
                )
            name = check_label(req.path, "save_weights_for_sampler: path")
            ctype = body.get("checkpoint_type", "base")
            if ctype not in SAMPLER_TYPES:
                raise user_error(
                    f"save_weights_for_sampler: checkpoint_type must be one of "
                    f"{sorted(SAMPLER_TYPES)}, got {ctype!r}"
                )
            if body.get("export_precision") not in (None, "source"):
                raise user_error("save_weights_for_sampler: export_precision is not supported")
            row_type, promotable = SAMPLER_TYPES[ctype]

            def job() -> Payload:
                self.control.reserve(ns, name)
                try:
                    ref = server.engine.save(model, "sampler", name, overwrite=False)
                except BaseException:
                    self.control.release(ns, name)
                    raise
                self.control.add_checkpoint(ns, name, ref, row_type, promotable)
                return Payload(json={"path": name, "type": "save_weights_for_sampler"})

            return job

        return await self._ordered(
            server,
            request,
            ft.SaveWeightsForSamplerRequest,
            "save_weights_for_sampler",
            "SaveWeightsForSampler",
            make_job,
        )

    async def load_weights(self, server: Server, request: web.Request) -> web.Response:
        def make_job(req, body):
            ns = self._namespace(req.model_id)
            model = server.engine.model(req.model_id)
            if req.weights_access_token is not None:
                raise user_error("load_weights: weights_access_token is not supported")
            ref = resolve_ref(self.control, ns, req.path)
            if ref.kind != "state":
                raise user_error(
                    f"load_weights: {req.path!r} is sampler weights, not a resumable (save_state) "
                    "checkpoint"
                )
            if server.engine.recorded_base(ref.model_id) != model.base.name:
                raise user_error(
                    f"load_weights: checkpoint {req.path!r} was trained from base model "
                    f"{server.engine.recorded_base(ref.model_id)!r}, not {model.base.name!r}"
                )

            def job() -> Payload:
                server.engine.load(model, ref, optimizer=req.optimizer)
                return Payload(
                    json={"path": req.path, "model_id": model.model_id, "type": "load_weights"}
                )

            return job

        return await self._ordered(
            server, request, ft.LoadWeightsRequest, "load_weights", "LoadWeights", make_job
        )

    async def list_checkpoints(self, server: Server, request: web.Request) -> web.Response:
        job = self._gateway_job(request)
        names = self.control.state_names(job) if job is not None else []
        return json_response({"checkpoints": sorted(names)})
