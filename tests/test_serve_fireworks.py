"""The local server's Fireworks flavour and the real, unmodified ``fireworks-ai`` SDK (loopback).

Every server here binds 127.0.0.1 on an ephemeral port and is stopped by its fixture. The SDK
provisions through the control plane exactly as `runner.fireworks._trainer._connect` does
(``FiretitanServiceClient.from_firetitan_config``: account lookup, training shape, trainer job,
healthz through the trainer's gateway prefix, hot-load deployment), then trains and samples. A
`LocalTrainer` built in this process is the reference: what the SDK gets over the wire equals
what the trainer computes in process.

This module also holds the helpers the Fireworks backend's tests use (`fireworks_server`,
`connect`, `Wire`): the real server in place of an imitation, with the faults a hosted control
plane can show injected as server middlewares.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import types as pytypes
import uuid
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("fireworks.training.sdk")

from aiohttp import web  # noqa: E402

import runner  # noqa: E402
from runner import AdamParams, make_seq  # noqa: E402
from runner._kernels import KERNELS  # noqa: E402
from runner.fireworks import BUILTIN_LOSSES, FireworksTrainer, sample_seed  # noqa: E402
from runner.fireworks._trainer import _connect  # noqa: E402
from runner.local import LocalTrainer, LocalTrainerConfig  # noqa: E402
from runner.serve import BaseModel, ServeConfig, ServerThread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = "accounts/fireworks/models/qwen3-8b"
SHAPE = "accounts/fireworks/trainingShapes/ts-qwen3-8b-policy"
KEY = f"fw-{uuid.uuid4().hex}"  # a fresh key per run (no key-shaped literal in the source)
TML_KEY = f"tml-{uuid.uuid4().hex}"  # the tinker SDK's key, accepted beside it
VOCAB = 24
CFG = LocalTrainerConfig(
    vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64, seed=3
)
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
os.environ.setdefault("TINKER_TELEMETRY", "0")
TRAINING = ("forward", "forward_backward", "optim_step", "save_weights", "load_weights")
TRAINING += ("save_weights_for_sampler",)


# -- helpers shared with tests/test_fireworks*.py -------------------------------------------


class Wire:
    """A server middleware that records what the SDK sends and injects control-plane faults.

    Records ``(model_id, kind, body)`` for every training request (`TRAINING` kinds) and
    ``events``: ``("load", path)``, ``("promote", checkpoint resource)``, ``("delete", job)``.

    Fault knobs (the behaviours of a hosted control plane the local one does not show):
    ``hide_rows`` (listings are empty), ``extra_rows`` (each listing adds a second, shadow row
    per checkpoint row), ``row_lag`` (a new row is listed only from its ``row_lag + 1``-th
    listing on), ``list_fails`` (True or a count: listings answer 403), ``promote_error`` (a
    message: promotion answers 400 with it), ``delete_noop`` (a trainer deletion is accepted
    and ignored), ``strip_outputs`` (``forward_backward`` results carry no per-datum outputs),
    ``save_delay_s`` (each ``save_weights`` waits first).

    ``strip_outputs`` answers ``retrieve_future`` of ``forward_backward`` as JSON (the SDK also
    accepts protobuf, which this rewrite does not read).
    """

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict]] = []
        self.events: list[tuple[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.events.clear()
        self.hide_rows = False
        self.extra_rows = False
        self.row_lag = 0
        self.list_fails: bool | int = False
        self.promote_error: str | None = None
        self.delete_noop = False
        self.strip_outputs = False
        self.save_delay_s = 0.0
        self._first_listed: dict[str, int] = {}
        self.list_calls = 0

    def of(self, model_id: str) -> list[tuple[str, dict]]:
        return [(k, b) for m, k, b in self.requests if m == model_id]

    def counts(self, model_id: str) -> dict[str, int]:
        out = dict.fromkeys(TRAINING, 0)
        for kind, _ in self.of(model_id):
            out[kind] += 1
        return out

    @property
    def middleware(self):
        @web.middleware
        async def wire(request, handler):
            path = request.path
            kind = path.rsplit("/", 1)[-1]
            if request.method == "POST" and "/api/v1/" in path and kind in TRAINING:
                body = await request.json()
                self.requests.append((str(body.get("model_id")), kind, body))
                if kind == "load_weights":
                    self.events.append(("load", body.get("path")))
                if kind == "save_weights" and self.save_delay_s:
                    await asyncio.sleep(self.save_delay_s)
            if request.method == "POST" and path.endswith(":promote"):
                body = await request.json()
                name = (
                    f"{body.get('trainer_job_id')}/checkpoints/{request.match_info['checkpoint']}"
                )
                if self.promote_error:
                    return web.json_response({"error": self.promote_error}, status=400)
                self.events.append(("promote", name))
            if request.method == "DELETE" and "/rlorTrainerJobs/" in path:
                self.events.append(("delete", path.rsplit("/", 1)[-1]))
                if self.delete_noop:
                    return web.json_response({})
            if (
                request.method == "GET"
                and path.endswith("/checkpoints")
                and "/v1/accounts/" in path
            ):
                return await self._listing(request, handler)
            if self.strip_outputs and path.endswith("/retrieve_future"):
                if request.headers.get("X-Tinker-Request-Type") == "ForwardBackward":
                    return self._stripped(
                        await handler(request.clone(headers=_json_accept(request)))
                    )
            return await handler(request)

        return wire

    async def _listing(self, request, handler):
        self.list_calls += 1
        if self.list_fails:
            if not isinstance(self.list_fails, bool):
                self.list_fails -= 1
            return web.json_response({"error": "injected listing failure"}, status=403)
        response = await handler(request)
        data = json.loads(response.body)
        rows = []
        for row in data["checkpoints"]:
            first = self._first_listed.setdefault(row["name"], self.list_calls)
            if self.list_calls - first < self.row_lag:
                continue
            rows.append(row)
            if self.extra_rows:
                rows.append({**row, "name": row["name"] + "-shadow"})
        data["checkpoints"] = [] if self.hide_rows else rows
        return web.json_response(data)

    @staticmethod
    def _stripped(response):
        data = json.loads(response.body)
        if isinstance(data, dict) and "loss_fn_outputs" in data:
            # only the aggregate loss: no outputs, and so no output-weighted (mean) metrics,
            # which the SDK's chunk merge could not weight
            data["loss_fn_outputs"] = []
            data["metrics"] = {
                k: v for k, v in data["metrics"].items() if not k.endswith((":mean", ":slack"))
            }
        return web.json_response(data)


def _json_accept(request) -> dict[str, str]:
    headers = dict(request.headers)
    headers["Accept"] = "application/json"
    return headers


def fireworks_server(state_dir: Path, base_models=None, *, wire: Wire | None = None, **config):
    """A started `ServerThread` serving ``base_models`` (default: `CFG` as `BASE`)."""
    if base_models is None:
        base_models = {BASE: BaseModel(BASE, dataclasses.replace(CFG, checkpoint_dir=None))}
    config.setdefault("long_poll_s", 0.5)
    middlewares = [wire.middleware] if wire is not None else []
    config.setdefault("extra_api_keys", (TML_KEY,))
    cfg = ServeConfig(api_key=KEY, state_dir=str(state_dir), **config)
    return ServerThread(cfg, base_models, middlewares=middlewares).start()


def connect(st: ServerThread, *, base_model: str = BASE, trainer_job_id: str = "", **kw):
    """A `FireworksTrainer` on the server, provisioned as the main job provisions one."""
    fcfg = pytypes.SimpleNamespace(
        base_url=st.url,
        base_model=base_model,
        training_shape_id=SHAPE,
        trainer_job_id=trainer_job_id,
        deployment_id="",
        max_seq_len=CFG.max_seq_len,
    )
    service, client, control, job = _connect(fcfg, KEY)
    kw.setdefault("poll_interval_s", 0.01)
    kw.setdefault("settle_s", 0.0)
    kw.setdefault("identity_timeout_s", 0.5)
    kw.setdefault("max_seq_len", CFG.max_seq_len)
    return FireworksTrainer(
        client,
        service=service,
        control_plane=control,
        trainer_job_id=job,
        base_model=base_model,
        base_url=st.url,
        **kw,
    )


def served_model(st: ServerThread, trainer: FireworksTrainer):
    """The server's `TrainingModel` behind a trainer (its `LocalTrainer`: ``.trainer``)."""
    return st.server.engine.models[trainer.client.model_id]


def control_plane(st: ServerThread):
    return next(f for f in st.server.flavours if f.name == "fireworks").control


def assert_params_equal(a, b, atol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wire():
    return Wire()


@pytest.fixture(scope="module")
def served(tmp_path_factory, wire):
    st = fireworks_server(tmp_path_factory.mktemp("fw-state"), wire=wire)
    yield st
    st.stop()


@pytest.fixture
def trainer(served, wire):
    wire.reset()
    t = connect(served)
    yield t
    t.close()


def _raw(served, method, path, *, key=KEY, **kw):
    headers = dict(kw.pop("headers", {}))
    if key is not None:
        headers.setdefault("X-Api-Key", key)
    return httpx.request(method, served.url + path, headers=headers, timeout=30, **kw)


def _job_prefix(trainer) -> str:
    return f"/training/v1/rlorTrainerJobs/foldloss-local/{trainer.trainer_job_id}"


# -- authentication -------------------------------------------------------------------------


def test_requests_without_or_with_a_wrong_key_are_refused(served, trainer, caplog):
    caplog.set_level(logging.INFO, logger="runner.serve")
    prefix = _job_prefix(trainer)
    routes = [
        ("GET", "/v1/accounts", None),
        ("GET", f"/v1/accounts/foldloss-local/rlorTrainerJobs/{trainer.trainer_job_id}", None),
        ("POST", f"{prefix}/api/v1/create_session", {"tags": [], "sdk_version": "0.23.0"}),
        ("GET", f"{prefix}/api/v1/healthz", None),
        ("POST", f"{prefix}/api/v1/forward_backward", {}),
        ("POST", "/inference/v1/completions", {"model": BASE, "prompt": [1]}),
        ("GET", "/hot_load/v1/models/hot_load", None),
        ("POST", "/v1/accounts/foldloss-local/checkpoints/x:promote", {}),
    ]
    wrong = "fw-" + "0" * 32
    for method, path, body in routes:
        for key, headers in [(None, {}), (wrong, {}), (None, {"Authorization": f"Bearer {wrong}"})]:
            r = _raw(served, method, path, key=key, headers=headers, json=body)
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["category"] == "user"
    # the right key, as the SDK's REST clients send it (X-Api-Key, or Bearer for completions);
    # the tinker SDK's key, which the server also accepts
    assert _raw(served, "GET", "/v1/accounts").status_code == 200
    assert _raw(served, "GET", "/v1/accounts", key=TML_KEY).status_code == 200
    r = _raw(served, "GET", f"{prefix}/api/v1/healthz", key=None,
             headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 200
    # and the SDK's own control-plane client with a wrong key fails (no retries for minutes)
    from fireworks.training.sdk import TrainerJobManager

    with pytest.raises(Exception, match="401"):
        TrainerJobManager(api_key=wrong, base_url=served.url).list_checkpoints("x")
    assert not [r for r in caplog.records if KEY in r.getMessage() or wrong in r.getMessage()]


# -- training over the SDK equals the local trainer -----------------------------------------


def _rl_seq(tokens, rng):
    n = len(tokens) - 1
    return make_seq(
        tokens,
        logprobs=-rng.uniform(0.5, 4.0, n).astype(np.float32),
        advantages=rng.normal(size=n).astype(np.float32),
    )


def test_every_kernel_over_the_sdk_equals_the_local_trainer(served, trainer, wire):
    local = LocalTrainer(CFG)
    rng = np.random.default_rng(0)
    seqs = [_rl_seq(rng.integers(1, VOCAB, size=k).tolist(), rng) for k in (5, 9, 7)]
    ce = [s.with_inputs(weights=np.abs(s.inputs["advantages"])) for s in seqs]
    # reinforce is opt-in and capability-gated: the server advertises it
    opted = FireworksTrainer(
        trainer.client, base_model=BASE, builtin_losses=(*BUILTIN_LOSSES, "reinforce")
    )
    for loss in opted.builtin_losses:
        batch = ce if loss == "cross_entropy" else seqs
        got = opted.forward_backward(batch, loss)
        want = local.forward_backward(batch, loss)
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6), loss
        for key, value in want.metrics.items():
            assert got.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (loss, key)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            np.testing.assert_array_equal(a, b)
        assert set(KERNELS[loss].inputs) <= set(
            wire.of(trainer.client.model_id)[-1][1]["forward_backward_input"]["data"][0][
                "loss_fn_inputs"
            ]
        )
    for norm in ("none", "num_loss_tokens", "num_sequences"):
        trainer.forward_backward(ce, "cross_entropy")
        local.forward_backward(ce, "cross_entropy")
        m_fw, m_local = trainer.optim_step(ADAM, norm), local.optim_step(ADAM, norm)
        assert m_fw == pytest.approx(m_local, rel=1e-6)
    assert_params_equal(served_model(served, trainer).trainer.params, local.params)
    assert np.array_equal(trainer.forward(seqs)[1], local.forward(seqs)[1])
    body = wire.of(trainer.client.model_id)[-2][1]  # the SDK's extra field reached the server
    assert body["grad_accumulation_normalization"] == "num_sequences"


def test_sampling_reproduces_the_local_backend_sample_by_sample(served, trainer):
    local = LocalTrainer(CFG)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    kw = dict(num_samples=3, max_tokens=6, temperature=1.0, seed=11, stop_token_ids=[0, 1])
    a, b = trainer.sample(prompts, **kw), local.sample(prompts, **kw)
    for row_a, row_b in zip(a, b, strict=True):
        for sa, sb in zip(row_a, row_b, strict=True):
            assert np.array_equal(sa.tokens, sb.tokens) and sa.stop_reason == sb.stop_reason
            # The SDK sends at most 8 requests at once at first (its adaptive concurrency window),
            # so the server may sample these 9 rows in two batches of other shapes than the local
            # call's: the same random stream per row (the same tokens), logprobs to rounding.
            assert sa.logprobs.dtype == np.float32
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=1e-6, atol=1e-6)
        assert len({s.tokens.tobytes() for s in row_a}) > 1  # distinct samples per prompt
    assert trainer.counters["sample"] == 9 and trainer.counters["sampler_sync"] == 1


class _FrozenClock:
    """The `time` module, except that ``time()`` stands still (one second for everyone)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def test_trainers_provisioned_in_one_second_each_hot_load_their_own_deployment(served, monkeypatch):
    # The SDK's default deployment id is `<model>-<unix seconds>`: without the runner's own
    # id (`fresh_deployment_id`), the second trainer got the first one's deployment, still
    # hot-loading the first trainer's job (a flaky CI failure of the test below).
    import time

    from fireworks.training.sdk import managed

    monkeypatch.setattr(managed, "time", _FrozenClock(time.time()))
    first, second = connect(served), connect(served)
    try:
        control = control_plane(served)
        ids = []
        for t in (first, second):
            t.sample([[1, 2]], num_samples=1, max_tokens=2)
            dep = t.service.deployment_id
            assert control.deployments[dep]["hotLoadTrainerJob"] == control.job_name(
                t.trainer_job_id
            )
            ids.append(dep)
        assert ids[0] != ids[1]
    finally:
        first.close()
        second.close()


def test_completions_seeds_echo_and_non_streamed_replies(served, trainer):
    trainer.sample([[1, 2]], num_samples=1, max_tokens=2)  # hot-load the current weights
    control = control_plane(served)
    job = control.job_name(trainer.trainer_job_id)
    (deployment,) = [d for d, r in control.deployments.items() if r["hotLoadTrainerJob"] == job]
    model = f"accounts/foldloss-local/deployments/{deployment}"
    body = {"model": model, "prompt": [3, 4, 5], "max_tokens": 4, "logprobs": True,
            "raw_output": True, "seed": sample_seed(7, 2, 1, 2)}  # fmt: skip
    one, two = (_raw(served, "POST", "/inference/v1/completions", json=body) for _ in range(2))
    assert one.status_code == two.status_code == 200
    c1, c2 = one.json()["choices"][0], two.json()["choices"][0]
    assert c1["raw_output"] == c2["raw_output"]  # equal seeds: equal completions
    local = LocalTrainer(CFG)
    local.set_params(served.server.engine.sampler(control.hot[deployment]["sampler_id"]).params)
    want = local.sample([[3, 4, 5]], num_samples=2, max_tokens=4, seed=7, row_offsets=[4])[0][1]
    assert c1["raw_output"]["completion_token_ids"] == want.tokens.tolist()
    lps = [e["sampling_logprob"] for e in c1["logprobs"]["content"]]
    # the same tokens; the logprobs to float32 rounding (the server's call has another row
    # count than this one, and XLA:CPU's reductions may round differently per shape: a CI run
    # saw 1 ulp)
    np.testing.assert_allclose(np.float32(lps), want.logprobs, rtol=1e-6, atol=0)
    # echo: the prompt's logprobs (the model's), then the completion
    r = _raw(served, "POST", "/inference/v1/completions", json={**body, "echo": True})
    choice = r.json()["choices"][0]
    assert choice["raw_output"]["completion_token_ids"] == [3, 4, 5, *want.tokens.tolist()]
    (fwd,) = local.forward([runner.Seq(np.array([3, 4, 5]))])
    prompt_lps = [e["logprob"] for e in choice["logprobs"]["content"][1:3]]
    np.testing.assert_allclose(prompt_lps, fwd, rtol=0, atol=1e-6)
    # streamed: server-sent events ending with [DONE]
    r = _raw(served, "POST", "/inference/v1/completions", json={**body, "stream": True})
    events = [line for line in r.text.split("\n\n") if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: ") :])
    assert first["choices"][0]["raw_output"] == c1["raw_output"]


# -- checkpoints and the control plane ------------------------------------------------------


def test_control_plane_rows_promotion_deletion_and_restart(tmp_path, wire):
    st = fireworks_server(tmp_path / "state", wire=wire)
    try:
        t = connect(st)
        job = t.trainer_job_id
        seqs = [make_seq([1, 2, 3, 4, 5], weights=[0.0, 1.0, 1.0, 0.5])]
        t.forward_backward(seqs, "cross_entropy")
        t.optim_step(ADAM, "none")
        resumable = t.save_resumable("s1")
        promotable = t.save_promotable("s1")
        rows = t.control_plane.list_checkpoints(job)
        assert [r["checkpointType"] for r in rows] == [
            "CHECKPOINT_TYPE_TRAINING",
            "CHECKPOINT_TYPE_INFERENCE_BASE",
        ]
        assert [r["promotable"] for r in rows] == [False, True]
        assert rows[0]["name"] == resumable["checkpoint_resource"]
        assert t.client.list_checkpoints() == [resumable["checkpoint_name"]]
        model = t.control_plane.promote_checkpoint(
            name=promotable["checkpoint_resource"], output_model_id="m-1", base_model=BASE
        )
        assert model["name"] == "accounts/foldloss-local/models/m-1"
        with pytest.raises(RuntimeError, match="not promotable"):
            t.control_plane.promote_checkpoint(
                name=resumable["checkpoint_resource"], output_model_id="m-2", base_model=BASE
            )
        saved = jax.tree.map(np.asarray, served_model(st, t).trainer.params)
        t.control_plane.delete(job)
        assert t.control_plane.try_get(job)["state"] == "JOB_STATE_DELETED"
        with pytest.raises(ValueError, match=f"trainer job {job} is JOB_STATE_DELETED"):
            t.forward_backward(seqs, "cross_entropy")
        assert len(t.control_plane.list_checkpoints(job)) == 2  # rows outlive the trainer
        t.close()
    finally:
        st.stop()
    # a restarted server keeps the records: a new trainer resumes across jobs
    st = fireworks_server(tmp_path / "state", wire=wire)
    try:
        t2 = connect(st)
        t2.load_resumable(resumable)
        assert ("load", f"cross_job://{job}/{resumable['checkpoint_name']}") in wire.events
        assert_params_equal(served_model(st, t2).trainer.params, saved)
        assert served_model(st, t2).trainer.step == 1
        t2.close()
    finally:
        st.stop()


# -- bad input: user errors in the SDK's shape, never a 5xx ---------------------------------


def test_bad_input_is_a_user_error_never_a_5xx(served, trainer):
    model_id = trainer.client.model_id
    prefix = _job_prefix(trainer)
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64",
                                                  "shape": [3]},
                                "weights": {"data": [1, 1, 1], "dtype": "float32",
                                            "shape": [3]}}}  # fmt: skip

    def fb(d, loss="cross_entropy", **extra):
        return {"forward_backward_input": {"data": [d], "loss_fn": loss}, "model_id": model_id,
                **extra}  # fmt: skip

    shifted = json.loads(json.dumps(datum))
    shifted["loss_fn_inputs"]["target_tokens"]["data"] = [9, 3, 4]
    image = json.loads(json.dumps(datum))
    image["model_input"]["chunks"] = [{"type": "image", "data": "AA==", "format": "png"}]
    direct = [
        ("POST", "/v1/accounts/foldloss-local/rlorTrainerJobs",
         {"trainingConfig": {"baseModel": "no/such-model"}}, 400, "unknown base model"),
        ("POST", "/v1/accounts/other/rlorTrainerJobs", {}, 404, "unknown account"),
        ("GET", "/v1/accounts/foldloss-local/rlorTrainerJobs/nope", None, 404, "not found"),
        ("POST", f"{prefix}/api/v1/forward_backward", fb(datum, "grpo"), 400,
         "forward_backward: field 'forward_backward_input.loss_fn'"),
        ("POST", f"{prefix}/api/v1/forward_backward", {"model_id": "x:train:0"}, 404,
         "unknown model_id"),
        ("POST", f"{prefix}/api/v1/optim_step", {"model_id": model_id, "adam_params": {}},
         400, "seq_id is required"),
        ("POST", "/inference/v1/completions", {"model": BASE, "prompt": "text"}, 400,
         "tokenizer"),
        ("POST", "/inference/v1/completions", {"model": BASE, "prompt": [1], "top_p": 0.5},
         400, "top_p"),
        ("POST", "/inference/v1/completions", {"model": BASE, "prompt": [1], "images": []},
         400, "images"),
        ("POST", "/inference/v1/completions", {"model": "nope", "prompt": [1]}, 400,
         "unknown model"),
        ("POST", "/inference/v1/completions", {"model": BASE, "prompt": [99], "max_tokens": 2},
         400, "vocabulary"),
        ("POST", "/v1/accounts/foldloss-local/checkpoints/nope:promote",
         {"output_model": "accounts/foldloss-local/models/m",
          "trainer_job_id": f"accounts/foldloss-local/rlorTrainerJobs/{trainer.trainer_job_id}",
          "base_model": BASE}, 404, "no checkpoint"),
        ("POST", f"{prefix}/api/v1/create_session", b"{not json", 400, "not valid JSON"),
    ]  # fmt: skip
    for method, path, body, code, match in direct:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = _raw(served, method, path, **kw)
        assert r.status_code == code, (path, r.status_code, r.text)
        err = r.json()
        assert err["category"] == "user" and match in err["error"], (path, err)
    # a request that names its seq_id but fails validation fails in its turn, as a user error
    # of its future, and consumes the id: the model's next request still runs (a model of its
    # own, made over raw HTTP, so the SDK client's seq_ids stay its own)
    sid = _raw(served, "POST", f"{prefix}/api/v1/create_session",
               json={"tags": [], "user_metadata": None, "sdk_version": "0.23.0"})  # fmt: skip
    sid = sid.json()["session_id"]
    made = _raw(served, "POST", f"{prefix}/api/v1/create_model",
                json={"session_id": sid, "model_seq_id": 0, "base_model": BASE})  # fmt: skip
    raw_model = made.json()["model_id"]
    _result(served, prefix, made.json()["request_id"])

    def raw_fb(d, seq, loss="cross_entropy"):
        body = {"forward_backward_input": {"data": [d], "loss_fn": loss}, "model_id": raw_model,
                "seq_id": seq}  # fmt: skip
        r = _raw(served, "POST", f"{prefix}/api/v1/forward_backward", json=body)
        assert r.status_code == 200, r.text
        return _result(served, prefix, r.json()["request_id"])

    for seq, (d, loss, match) in enumerate(
        [
            (shifted, "cross_entropy", "target_tokens must be the model input shifted by one"),
            (image, "cross_entropy", "image chunks are not supported"),
            (datum, "ppo", "missing required field 'logprobs'"),
        ],
        start=1,
    ):
        out = raw_fb(d, seq, loss)
        assert out["category"] == "user" and match in out["error"], out
    out = raw_fb(datum, 4)
    assert out["metrics"]["loss:sum"] > 0 and len(out["loss_fn_outputs"]) == 1
    # over the SDK: a user error of the future, raised as the SDK's RequestFailedError
    from fireworks.training.sdk import RequestFailedError, types

    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [9, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(RequestFailedError, match="target_tokens must be the model input") as info:
        trainer.client.forward_backward([bad], "cross_entropy").result(timeout=60)
    assert info.value.category == "user"


def _result(served, prefix: str, request_id: str) -> dict:
    """A future's JSON result (long-polled until it is not ``try_again``)."""
    for _ in range(240):
        req = {"request_id": request_id}
        accept = {"Accept": "application/json"}
        r = _raw(served, "POST", f"{prefix}/api/v1/retrieve_future", json=req, headers=accept)
        assert r.status_code == 200, r.text
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError(f"no result for {request_id}")


def test_bodies_over_the_limit_are_refused(tmp_path):
    st = fireworks_server(tmp_path / "state", max_body_bytes=4096)
    try:
        r = _raw(st, "POST", "/inference/v1/completions",
                 json={"model": BASE, "prompt": [1] * 4000})  # fmt: skip
        assert r.status_code == 413 and r.json()["category"] == "user"
    finally:
        st.stop()


def test_fireworks_helpers_leave_the_tinker_flavour_the_default(served):
    # a client nobody claims (no SDK User-Agent, no trainer prefix) reaches the default flavour
    r = _raw(served, "POST", "/api/v1/create_session",
             json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})  # fmt: skip
    assert r.status_code == 200
    session = served.server.sessions[r.json()["session_id"]]
    assert session.flavour == "tinker"


def test_reinforce_is_opt_in_and_gated_on_the_advertised_capability(served, trainer, wire):
    # reinforce (undocumented formula) is used only when named and advertised
    default = FireworksTrainer(trainer.client, base_model=BASE)
    assert "reinforce" not in default.builtin_losses
    rng = np.random.default_rng(5)
    seqs = [_rl_seq(rng.integers(1, VOCAB, size=k).tolist(), rng) for k in (5, 8)]
    with pytest.raises(ValueError, match="unknown loss 'reinforce'"):
        default.forward_backward(seqs, "reinforce")
    assert trainer.client.supports_reinforce is True  # what this server's create_model said
    trainer.client.supports_reinforce = False  # a trainer that does not advertise it
    try:
        with pytest.raises(ValueError, match="does not advertise supports_reinforce"):
            FireworksTrainer(
                trainer.client, base_model=BASE, builtin_losses=(*BUILTIN_LOSSES, "reinforce")
            )
    finally:
        trainer.client.supports_reinforce = True
    opted = FireworksTrainer(
        trainer.client, base_model=BASE, builtin_losses=(*BUILTIN_LOSSES, "reinforce")
    )
    got = opted.forward_backward(seqs, "reinforce", {})
    kind, body = wire.of(trainer.client.model_id)[-1]
    assert kind == "forward_backward"
    assert body["forward_backward_input"]["loss_fn"] == "reinforce"
    assert not body["forward_backward_input"].get("loss_fn_config")  # no defaults sent
    want = LocalTrainer(CFG).forward_backward(seqs, "reinforce")
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
    # score centering needs its own capability (the SDK's check), then the local limit
    with pytest.raises(ValueError, match="score centering"):
        opted.forward_backward(seqs, "reinforce", {"score_centering": True})
