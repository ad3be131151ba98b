"""The tinker 0.38 flavour of the local server: its endpoints, encodings and checkpoint paths.

Request bodies are validated with the tinker SDK's own request models (`parse_model`, lenient
for unknown fields) and ``forward_backward`` bodies with its protobuf schema
(``tinker.proto.tinker_public_pb2``); results of ``forward_backward`` and ``asample`` are
protobuf (``ForwardBackwardOutput``, ``SampleResponse``), everything else JSON
(docs/wire.md#client-architecture (and #endpoints-and-encodings, #metrics-and-errors)).

Checkpoints are ``tinker://<model_id>/weights/<name>`` (resumable state) and
``tinker://<model_id>/sampler_weights/<name>`` (sampler weights); the model id is
``<session_id>:train:<model_seq_id>``, as the SDK derives it on create-via-load.

What this flavour does not implement (a user error says so): image/audio chunks, targets that
are not the next tokens, the ``stable_reinforce`` loss, the Dimuon optimizer,
stop strings (integer stop tokens are supported), ``top_k``/``top_p``, top-k or target prompt
logprobs, prompt-alt tokens, ``prompt_logprobs_last_n``, stability recording, JWT auth,
``retrieve_futures``, sampling cancel, checkpoint TTLs and publishing.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import web
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from runner._types import AdamParams, Seq
from runner.serve._core import (
    PROTO_CONTENT_TYPE,
    Payload,
    ServeError,
    Server,
    json_response,
    over_limit,
    parse_model,
    retrieve,
    user_error,
)
from runner.serve._custom_loss import CUSTOM, create_custom_loss, program_for, run_custom
from runner.serve._engine import CheckpointRef, LoraRequest, SampleJob, decode_seed

#: ``tinker://`` path segment of each checkpoint kind, and back.
KIND_SEGMENT = {"state": "weights", "sampler": "sampler_weights"}
SEGMENT_KIND = {v: k for k, v in KIND_SEGMENT.items()}
#: ``/client/config`` flags a test or an operator may set (``ServeConfig.client_config``); the
#: flags that need endpoints this server lacks (JWT auth, retrieve_futures, joined sampling
#: sessions) are always off.
CONFIGURABLE_FLAGS = (
    "use_pyqwest_transport",
    "parallel_fwdbwd_chunks",
    "proto_compress_fwdbwd",
    "fwdbwd_max_chunk_len",
    "fwdbwd_max_chunk_bytes_count",
    "sample_max_concurrent_requests",
)
_OFF_FLAGS = {
    "pjwt_auth_enabled": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
}
#: Flags this server turns on: it stores and runs custom losses (`runner.serve._custom_loss`).
_ON_FLAGS = {"custom_loss_server_side": True}
#: tinker SDK 0.25 (what SkyRL tx pins) creates a model from a saved state through
#: ``load_weights`` (create-via-load, as 0.38 always does) only with this flag; 0.38 ignores it.
_VIA_LOAD_FLAGS = {"create_model_via_load_weights": True}
_PROTO_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


def tinker_path(ref: CheckpointRef) -> str:
    return f"tinker://{ref.model_id}/{KIND_SEGMENT[ref.kind]}/{ref.name}"


def parse_tinker_path(path: Any) -> CheckpointRef:
    """A ``tinker://<model_id>/<weights|sampler_weights>/<name>`` path (a user error if not)."""
    try:
        parsed = tt.ParsedCheckpointTinkerPath.from_tinker_path(str(path))
    except ValueError:
        raise user_error(
            f"invalid checkpoint path {path!r}: expected tinker://<model_id>/weights/<name> or "
            "tinker://<model_id>/sampler_weights/<name>"
        ) from None
    segment, _, name = parsed.checkpoint_id.partition("/")
    if segment not in SEGMENT_KIND:
        raise user_error(f"checkpoint path {path!r}: {segment} checkpoints are not served here")
    return CheckpointRef(parsed.training_run_id, SEGMENT_KIND[segment], name)


def _session_of(model_id: str) -> str:
    return model_id.split(":train:", 1)[0]


# -- protobuf -----------------------------------------------------------------------------------


def _tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _PROTO_DTYPES.get(msg.dtype)
    if dtype is None:
        raise user_error(f"{where}: unsupported tensor dtype {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise user_error(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(csr.values, dtype)
        crow = np.frombuffer(csr.crow_indices, np.int64)
        col = np.frombuffer(csr.col_indices, np.int64)
        if crow.shape[0] != shape[0] + 1 or col.shape != values.shape:
            raise user_error(f"{where}: inconsistent sparse CSR indices")
        dense = np.zeros(shape, dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        if col.size and (col.min() < 0 or col.max() >= shape[1]):
            raise user_error(f"{where}: sparse CSR column index out of range")
        dense[rows, col] = values
        return dense
    data = msg.dense
    if len(data) % dtype.itemsize:
        raise user_error(f"{where}: {len(data)} bytes is not a whole number of {dtype} values")
    arr = np.frombuffer(data, dtype)
    if shape:
        if math.prod(shape) != arr.size:
            raise user_error(f"{where}: shape {shape} does not match {arr.size} values")
        arr = arr.reshape(shape)
    return arr


def datum_to_seq(datum: Any, index: int) -> Seq:
    """A proto ``Datum`` as a `runner.Seq` (next-token targets only; a user error otherwise)."""
    where = f"datum {index}"
    parts = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise user_error(f"{where}: {kind} chunks are not supported (text tokens only)")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
    model_input = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    inputs = {
        name: _tensor(t, f"{where} loss_fn_inputs['{name}']")
        for name, t in datum.loss_fn_inputs.items()
    }
    targets = inputs.pop("target_tokens", None)
    if targets is None:
        raise user_error(f"{where}: loss_fn_inputs has no 'target_tokens'")
    targets = targets.reshape(-1) if targets.ndim > 1 and targets.shape[-1] == 1 else targets
    if targets.ndim != 1 or targets.shape[0] != model_input.shape[0] or not targets.size:
        raise user_error(
            f"{where}: target_tokens must be 1-D with one target per model input token "
            f"({model_input.shape[0]}), got shape {targets.shape}"
        )
    if not np.array_equal(model_input[1:], targets[:-1]):
        raise user_error(
            f"{where}: target_tokens must be the model input shifted by one (next-token "
            "targets); the local server trains next-token targets only"
        )
    tokens = np.concatenate([model_input.astype(np.int64), targets[-1:].astype(np.int64)])
    return Seq(tokens, inputs)


def _loss_config(req: Any) -> dict[str, Any]:
    if req.loss_fn_config_v2:
        out = {}
        for key, value in req.loss_fn_config_v2.items():
            which = value.WhichOneof("value")
            out[key] = value.text if which == "text" else float(value.number)
        return out
    return {key: float(value) for key, value in req.loss_fn_config.items()}


def forward_backward_output(logprobs: list[np.ndarray], metrics: Mapping[str, float]) -> bytes:
    """A proto ``ForwardBackwardOutput``: one ``ArrayRecord`` of per-datum float32 logprobs."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(logprobs)
    arrays = [np.asarray(lp, np.float32).reshape(-1) for lp in logprobs]
    bt = record.fields["logprobs"]
    bt.dtype = pb.DTYPE_FLOAT32
    bt.data = np.concatenate(arrays).tobytes() if arrays else b""
    offsets = np.zeros(len(arrays) + 1, np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    bt.offsets = offsets.tobytes()
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def sample_response(samples: list[Any], prompt_logprobs: np.ndarray | None) -> bytes:
    out = pb.SampleResponse()
    for s in samples:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()


# -- handlers -----------------------------------------------------------------------------------


async def _parse(server: Server, request: web.Request, cls: type, what: str):
    model, _ = parse_model(cls, await server.json(request), what=what)
    return model


def _ack(fut: Any, **extra: Any) -> web.Response:
    return json_response({"request_id": fut.request_id, **extra})


async def healthz(server: Server, request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def capabilities(server: Server, request: web.Request) -> web.Response:
    models = [
        {
            "model_name": b.name,
            "max_context_length": b.max_seq_len,
            "trainable": True,
            "sampleable": True,
        }
        for b in server.engine.base_models.values()
    ]
    return json_response({"supported_models": models})


async def client_config(server: Server, request: web.Request) -> web.Response:
    await _parse(server, request, tt.ClientConfigRequest, "client/config")
    flags = {k: v for k, v in server.config.client_config.items() if k in CONFIGURABLE_FLAGS}
    on = _ON_FLAGS
    if server.config.test_cross_entropy == "skyrl":  # SkyRL tx runs no custom losses either
        on = {name: False for name in _ON_FLAGS}
    return json_response({**flags, **_OFF_FLAGS, **on, **_VIA_LOAD_FLAGS})


async def dynamic_config(server: Server, request: web.Request) -> web.Response:
    await _parse(server, request, tt.ClientConfigRequest, "client/dynamic_config")
    return json_response({"sample_cancel_enabled": False})


async def create_session(server: Server, request: web.Request) -> web.Response:
    req = await _parse(server, request, tt.CreateSessionRequest, "create_session")
    session = server.new_session(TinkerFlavour.name, req.sdk_version, request)
    return json_response({"type": "create_session", "session_id": session.session_id})


async def session_heartbeat(server: Server, request: web.Request) -> web.Response:
    req = await _parse(server, request, tt.SessionHeartbeatRequest, "session_heartbeat")
    session = server.sessions.get(req.session_id)
    if session is None or session.finished is not None:
        raise user_error(f"session {req.session_id} is not active", 410)
    session.last_heartbeat = time.monotonic()
    return json_response({"type": "session_heartbeat"})


async def telemetry(server: Server, request: web.Request) -> web.Response:
    # Read (the size limit applies) but never parsed or logged: tinker's error events carry the
    # client's request headers, its API key included.
    await server.body(request)
    return json_response({"status": "accepted"})


async def finish_session(server: Server, request: web.Request) -> web.Response:
    body = await server.json(request)
    session = server.session(request.match_info["session_id"], live=False)
    reason = body.get("reason")
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in ("success", "errored", "interrupted"):
        raise user_error("finish: reason.type must be success, errored or interrupted")
    if session.finished is None:
        session.finished = kind
    return json_response({})


async def retrieve_future(server: Server, request: web.Request) -> web.StreamResponse:
    req = await _parse(server, request, tt.FutureRetrieveRequest, "retrieve_future")
    accept = request.headers.get("Accept", "")
    return await retrieve(server.futures, req.request_id, accept, server.config.long_poll_s)


async def create_model(server: Server, request: web.Request) -> web.Response:
    req = await _parse(server, request, tt.CreateModelRequest, "create_model")
    session = server.session(req.session_id)
    model_id = f"{session.session_id}:train:{req.model_seq_id}"
    known = session.model_seq.get(req.model_seq_id)
    if known is not None:  # a resubmission
        return _ack(server.futures.get(known), model_id=model_id)
    server.engine.base(req.base_model)  # an unknown base model fails here, at once
    server.check_new_model(session)
    if getattr(req.optimizer_config, "type", "adamw") != "adamw":
        raise user_error(
            f"optimizer {req.optimizer_config.type!r} is not supported (the server trains AdamW)"
        )
    lora = req.lora_config
    fut = server.futures.create("CreateModel")
    session.model_seq[req.model_seq_id] = fut.request_id
    # tinker's LoraConfig has no alpha: the engine's rule (the served config's, else 32)
    request = None
    if lora is not None:
        request = LoraRequest(
            rank=lora.rank,
            train_attn=bool(lora.train_attn),
            train_mlp=bool(lora.train_mlp),
            train_unembed=bool(lora.train_unembed),
        )

    def build():
        return server.engine.create_model(
            model_id,
            req.base_model,
            seed=lora.seed if lora is not None else None,
            lora=request,
            flavour=TinkerFlavour.name,
        )

    def done(_):
        server.add_queue(model_id)
        fut.complete(Payload(json={"model_id": model_id, "type": "create_model"}))

    server.complete_later(fut, build, done)
    return _ack(fut, model_id=model_id)


async def get_info(server: Server, request: web.Request) -> web.Response:
    req = await _parse(server, request, tt.GetInfoRequest, "get_info")
    model = server.engine.model(req.model_id)
    decoder = model.base.config.decoder  # a Llama / Qwen2 / Qwen3 family, or the toy model
    arch = decoder.family if decoder is not None else "foldloss-local-transformer"
    return json_response(
        {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {"arch": arch, "model_name": model.base.name},
            "model_name": model.base.name,
            # The truth: LoRA adapters of this rank on a decoder; every weight on the toy model,
            # whatever rank was asked for.
            "is_lora": model.is_lora,
            "lora_rank": model.lora.rank if model.is_lora else None,
        }
    )


async def forward_backward(server: Server, request: web.Request) -> web.Response:
    if PROTO_CONTENT_TYPE not in request.headers.get("Content-Type", ""):
        raise user_error(
            "the tinker flavour takes forward_backward as application/x-protobuf "
            "(tinker_public.ForwardBackwardRequest)",
            415,
        )
    raw = await server.body(request)
    req = pb.ForwardBackwardRequest()
    try:
        req.ParseFromString(raw)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise user_error("forward_backward: body is not a valid ForwardBackwardRequest") from None
    queue = server.queue(req.model_id)
    model = server.engine.model(req.model_id)
    kind = "Forward" if req.forward_only else "ForwardBackward"
    try:
        if not req.data:
            raise user_error("forward_backward: no data")
        over_limit(server.config, "max_batch_rows", "forward_backward's datums", len(req.data))
        seqs = [datum_to_seq(d, i) for i, d in enumerate(req.data)]
        loss_fn, config = req.loss_fn, _loss_config(req)
    except ServeError as err:  # consumes the seq_id in its turn: later requests still run
        return _ack(queue.submit(req.seq_id, kind, err), model_id=req.model_id)
    run = server.engine.forward if req.forward_only else server.engine.forward_backward
    if loss_fn == CUSTOM and not req.forward_only:
        try:
            program = program_for(server, _session_of(req.model_id), config)
        except ServeError as err:
            return _ack(queue.submit(req.seq_id, kind, err), model_id=req.model_id)

        def run(model, seqs, loss_fn, config):  # noqa: F811 - the custom loss's one pass
            return run_custom(model, seqs, program)

    def job() -> Payload:
        logprobs, metrics = run(model, seqs, loss_fn, config)
        return Payload(proto=forward_backward_output(logprobs, metrics))

    return _ack(queue.submit(req.seq_id, kind, job), model_id=req.model_id)


async def _ordered(server, request, cls, what, kind, make_job):
    """Parses an ordered JSON request and submits its job (or its validation error) in turn."""
    return await _ordered_body(server, await server.json(request), cls, kind, make_job, what)


async def optim_step(server: Server, request: web.Request) -> web.Response:
    def make_job(req):
        params = req.optim_params
        if not isinstance(params, tt.AdamParams):
            raise user_error(f"optimizer {getattr(params, 'type', '?')!r} is not supported (AdamW)")
        try:
            adam = AdamParams(**params.model_dump())
        except ValueError as exc:
            raise user_error(str(exc)) from None
        model = server.engine.model(req.model_id)

        def job() -> Payload:
            # tinker has no normalization option: the accumulated gradient is applied as is.
            metrics = server.engine.optim_step(model, adam, None)
            return Payload(json={"metrics": metrics, "type": "optim_step"})

        return job

    return await _ordered(server, request, tt.OptimStepRequest, "optim_step", "OptimStep", make_job)


def _checkpoint_name(name: Any, seq_id: Any) -> str:
    return name if name else f"ckpt-{seq_id}-{uuid.uuid4().hex[:8]}"


async def save_weights(server: Server, request: web.Request) -> web.Response:
    def make_job(req):
        model = server.engine.model(req.model_id)
        name = _checkpoint_name(req.path, req.seq_id)

        def job() -> Payload:
            ref = server.engine.save(model, "state", name, overwrite=req.overwrite)
            return Payload(json={"path": tinker_path(ref), "type": "save_weights"})

        return job

    return await _ordered(
        server, request, tt.SaveWeightsRequest, "save_weights", "SaveWeights", make_job
    )


async def save_weights_for_sampler(server: Server, request: web.Request) -> web.Response:
    def make_job(req):
        model = server.engine.model(req.model_id)
        if req.path:

            def named() -> Payload:
                ref = server.engine.save(model, "sampler", req.path)
                return Payload(json={"path": tinker_path(ref), "type": "save_weights_for_sampler"})

            return named
        if req.sampling_session_seq_id is None:
            raise user_error("save_weights_for_sampler: give a path or a sampling_session_seq_id")
        session = server.session(_session_of(model.model_id))
        seq = req.sampling_session_seq_id

        def unnamed() -> Payload:
            sampler_id = session.sampler_seq.get(seq)
            if sampler_id is None:
                sampler_id = f"{session.session_id}:sample:{seq}"
                server.engine.new_sampler(sampler_id, model.sampling_base, model.trainer.params)
                session.sampler_seq[seq] = sampler_id
            return Payload(
                json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
            )

        return unnamed

    return await _ordered(
        server,
        request,
        tt.SaveWeightsForSamplerRequest,
        "save_weights_for_sampler",
        "SaveWeightsForSampler",
        make_job,
    )


async def load_weights(server: Server, request: web.Request) -> web.Response:
    body = await server.json(request)
    if body.get("model_id") is not None:  # into an existing model, in its seq order

        def make_job(req):
            model = server.engine.model(req.model_id)
            ref = parse_tinker_path(req.path)

            def job() -> Payload:
                server.engine.load(model, ref, optimizer=req.optimizer)
                return Payload(
                    json={"path": req.path, "model_id": model.model_id, "type": "load_weights"}
                )

            return job

        return await _ordered_body(server, body, tt.LoadWeightsRequest, "LoadWeights", make_job)
    # create-via-load: the model's first request; its id is derived, not returned first
    req, _ = parse_model(tt.LoadWeightsRequest, body, what="load_weights")
    if req.session_id is None or req.model_seq_id is None:
        raise user_error("load_weights: give model_id and seq_id, or session_id and model_seq_id")
    session = server.session(req.session_id)
    model_id = f"{session.session_id}:train:{req.model_seq_id}"
    known = session.model_seq.get(req.model_seq_id)
    if known is not None:
        return _ack(server.futures.get(known), model_id=model_id)
    ref = parse_tinker_path(req.path)
    if ref.kind != "state" and req.optimizer:
        raise user_error("load_weights: sampler weights hold no optimizer state")
    if req.optimizer_config is not None and getattr(req.optimizer_config, "type", "") != "adamw":
        raise user_error("load_weights: only the adamw optimizer is supported")
    fut = server.futures.create("LoadWeights")
    session.model_seq[req.model_seq_id] = fut.request_id

    def build():
        return server.engine.create_from_checkpoint(
            model_id,
            ref,
            optimizer=req.optimizer,
            base_override=req.base_model,
            flavour=TinkerFlavour.name,
        )

    def done(_):
        server.add_queue(model_id)
        fut.complete(Payload(json={"path": req.path, "model_id": model_id, "type": "load_weights"}))

    server.complete_later(fut, build, done)
    return _ack(fut, model_id=model_id)


async def _ordered_body(server, body, cls, kind, make_job, what=None):
    """Submits the job of a parsed ordered request body (or its validation error) in its
    model's queue at its ``seq_id``; ``what`` names the request in errors (default ``kind``)."""
    what = kind if what is None else what
    queue = server.queue(body.get("model_id"))
    try:
        req, _ = parse_model(cls, body, what=what)
        job = make_job(req)
    except ServeError as err:
        if isinstance(body.get("seq_id"), int):
            return _ack(queue.submit(body["seq_id"], kind, err), model_id=queue.name)
        raise
    if req.seq_id is None:
        raise user_error(f"{what}: seq_id is required")
    return _ack(queue.submit(req.seq_id, kind, job), model_id=queue.name)


async def unload_model(server: Server, request: web.Request) -> web.Response:
    req = await _parse(server, request, tt.UnloadModelRequest, "unload_model")
    queue = server.queue(req.model_id)
    queue.close()
    server.queues.pop(req.model_id, None)
    server.engine.unload(req.model_id)
    fut = server.futures.completed(
        "UnloadModel", Payload(json={"model_id": req.model_id, "type": "unload_model"})
    )
    return _ack(fut, model_id=req.model_id)


async def training_run_checkpoints(server: Server, request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    server.engine.recorded_base(model_id)  # an unknown run: a user error
    rows = await server.run_blocking(server.engine.list_checkpoints, model_id)
    out = []
    for row in rows:
        ref = CheckpointRef(model_id, row["kind"], row["name"])
        out.append(
            {
                "checkpoint_id": f"{KIND_SEGMENT[row['kind']]}/{row['name']}",
                "checkpoint_type": "training" if row["kind"] == "state" else "sampler",
                "time": row["time"].isoformat().replace("+00:00", "Z"),
                "tinker_path": tinker_path(ref),
                "size_bytes": row["size_bytes"],
                "public": False,
            }
        )
    return json_response({"checkpoints": out, "cursor": None})


async def create_sampling_session(server: Server, request: web.Request) -> web.Response:
    req = await _parse(server, request, tt.CreateSamplingSessionRequest, "create_sampling_session")
    session = server.session(req.session_id)
    known = session.sampler_seq.get(req.sampling_session_seq_id)
    if known is None:
        sampler_id = f"{session.session_id}:sample:{req.sampling_session_seq_id}"
        base, params = await _sampler_weights(server, req.model_path, req.base_model)
        server.engine.new_sampler(sampler_id, base, params, req.model_path)
        session.sampler_seq[req.sampling_session_seq_id] = sampler_id
        known = sampler_id
    return json_response({"type": "create_sampling_session", "sampling_session_id": known})


async def _sampler_weights(server: Server, model_path: Any, base_model: Any):
    if model_path:
        ref = parse_tinker_path(model_path)
        base, params = await server.run_blocking(server.engine.params_of, ref)
        if base_model and base_model != base.name:
            raise user_error(f"base_model {base_model!r} differs from {model_path}'s {base.name!r}")
        return base, params
    base = server.engine.base(base_model)
    return base, await server.run_blocking(server.engine.base_params, base)


async def get_sampler(server: Server, request: web.Request) -> web.Response:
    entry = server.engine.sampler(request.match_info["sampler_id"])
    return json_response(
        {
            "sampler_id": entry.sampler_id,
            "base_model": entry.base.name,
            "model_path": entry.model_path,
        }
    )


def _check_sample_request(req: Any) -> None:
    unsupported = [
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("topk_sample_logprobs", req.topk_sample_logprobs),
        ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
        ("prompt_logprobs_last_n", req.prompt_logprobs_last_n is not None),
        ("record_stability_info", bool(req.record_stability_info)),
    ]
    for name, value in unsupported:
        if value:
            raise user_error(f"asample: {name} is not implemented by the local server")
    sp = req.sampling_params
    if sp.top_k not in (-1, 0) or sp.top_p != 1:
        raise user_error("asample: top_k / top_p are not implemented (use top_k=-1, top_p=1)")
    if sp.max_tokens is None or sp.max_tokens < 1:
        raise user_error("asample: sampling_params.max_tokens (>= 1) is required")
    stop = sp.stop
    if isinstance(stop, str) or (stop and not all(isinstance(t, int) for t in stop)):
        raise user_error(
            "asample: stop strings need a tokenizer, which the server does not have; pass "
            "integer stop token ids"
        )


async def asample(server: Server, request: web.Request) -> web.Response:
    req = await _parse(server, request, tt.SampleRequest, "asample")
    _check_sample_request(req)
    if req.sampling_session_id:
        entry = server.engine.sampler(req.sampling_session_id)
    else:
        if not (req.model_path or req.base_model):
            raise user_error("asample: give sampling_session_id, model_path or base_model")
        base, params = await _sampler_weights(server, req.model_path, req.base_model)
        entry = server.engine.new_sampler(f"adhoc-{uuid.uuid4().hex[:12]}", base, params)
    key = ("asample", entry.sampler_id, req.seq_id)
    if req.seq_id is not None and key in server.dedup:  # a resubmission (after a 429)
        fut = server.dedup[key]
        return _ack(fut, sample_sequence_ids=_sequence_ids(fut.request_id, req.num_samples))
    tokens = []
    for chunk in req.prompt.chunks:
        if not isinstance(chunk, tt.EncodedTextChunk):
            raise user_error("asample: only text token chunks are supported")
        tokens.extend(chunk.tokens)
    prompt = np.asarray(tokens, np.int32)
    base_seed, index = decode_seed(req.sampling_params.seed)
    job = SampleJob(
        sampler_id=entry.sampler_id,
        prompt=prompt,
        num_samples=int(req.num_samples),
        max_tokens=int(req.sampling_params.max_tokens),
        temperature=float(req.sampling_params.temperature),
        base_seed=base_seed,
        index=index,
        stops=tuple(int(t) for t in (req.sampling_params.stop or ())),
        prompt_logprobs=bool(req.prompt_logprobs),
    )
    server.engine.check_sample(entry, job)
    fut = server.futures.create("Sample")
    job.done = lambda samples, plp: fut.complete(Payload(proto=sample_response(samples, plp)))
    job.failed = fut.fail
    if req.seq_id is not None:
        server.dedup[key] = fut
    server.batcher.submit(job)
    return _ack(fut, sample_sequence_ids=_sequence_ids(fut.request_id, req.num_samples))


def _sequence_ids(request_id: str, n: int) -> list[str]:
    return [f"{request_id}:{j}" for j in range(n)]


class TinkerFlavour:
    """The tinker 0.38 SDK (`runner.serve._core.Flavour`): claims ``AsyncTinker/`` clients."""

    name = "tinker"
    extra_routes: Mapping[str, tuple[str, str]] = {
        "create_custom_loss": ("POST", "/api/v1/create_custom_loss")
    }
    handlers = {
        "healthz": healthz,
        "get_server_capabilities": capabilities,
        "client_config": client_config,
        "dynamic_config": dynamic_config,
        "create_session": create_session,
        "session_heartbeat": session_heartbeat,
        "telemetry": telemetry,
        "finish_session": finish_session,
        "retrieve_future": retrieve_future,
        "create_model": create_model,
        "get_info": get_info,
        "forward_backward": forward_backward,
        "optim_step": optim_step,
        "save_weights": save_weights,
        "load_weights": load_weights,
        "save_weights_for_sampler": save_weights_for_sampler,
        "training_run_checkpoints": training_run_checkpoints,
        "create_sampling_session": create_sampling_session,
        "get_sampler": get_sampler,
        "asample": asample,
        "unload_model": unload_model,
        "create_custom_loss": create_custom_loss,
    }

    def claims(self, request: web.Request) -> bool:
        return request.headers.get("User-Agent", "").startswith("AsyncTinker/")
