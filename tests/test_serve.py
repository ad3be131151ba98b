"""The local server (`runner.serve`) with the real, unmodified tinker SDK and raw HTTP over loopback.

Every server here binds 127.0.0.1 on an ephemeral port and is stopped by its fixture. The served
model is examples/tiny.toml's; a `LocalTrainer` built from the same config in this process is the
reference: what the SDK gets over the wire must equal what the trainer computes in process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from runner import AdamParams, Seq  # noqa: E402
from runner.local import LocalTrainer  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from runner.serve._tinker import forward_backward_output, parse_tinker_path  # noqa: E402
from runner.tinker._convert import to_datums  # noqa: E402
from runner.tinker._seeds import prompt_seed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "foldloss/tiny"
KEY = f"tml-{uuid.uuid4().hex}"  # a fresh key per run (no key-shaped literal in the source)
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="module")
def models():
    return parse_model_flags([f"{MODEL}=examples/tiny.toml"])


def _server(tmp_path_factory, models, **config):
    state = tmp_path_factory.mktemp("serve-state")
    return ServerThread(ServeConfig(api_key=KEY, state_dir=str(state), **config), models)


@pytest.fixture(scope="module")
def served(tmp_path_factory, models):
    with _server(tmp_path_factory, models, long_poll_s=0.5) as st:
        yield st


@pytest.fixture(scope="module")
def service(served):
    svc = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    yield svc
    svc.close("success").result(timeout=30)


def _base(served):
    return served.server.engine.base_models[MODEL]


def _reference(served) -> LocalTrainer:
    return LocalTrainer(_base(served).config)


def _client(service, served):
    return service.create_lora_training_client(
        MODEL, rank=8, seed=_base(served).config.seed
    ).result()


def _params(served, model_id):
    return jax.tree.map(np.asarray, served.server.engine.models[model_id].trainer.params)


def _assert_params_equal(a, b, atol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def _seqs(n=4, seed=0, *, rl=False, length=(5, 20)):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(3, 40, size=int(rng.integers(*length)))
        m = toks.shape[0] - 1
        if rl:
            inputs = {
                "logprobs": -rng.uniform(2.0, 5.0, m),
                "advantages": rng.normal(size=m),
            }
        else:
            inputs = {"weights": rng.uniform(0.0, 1.0, m)}
        out.append(Seq(toks.astype(np.int64), inputs))
    return out


def _http(served, method, path, *, key=KEY, **kw):
    headers = dict(kw.pop("headers", {}))
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.request(method, served.url + path, headers=headers, timeout=30, **kw)


def _proto_fb(model_id, seq_id, seqs, loss_fn, fields, config=None, forward_only=False):
    msg = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only
    )
    for s in seqs:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = s.tokens[:-1].astype(np.int32).tobytes()
        tt = d.loss_fn_inputs["target_tokens"]
        tt.dtype, tt.dense = pb.DTYPE_INT64, s.tokens[1:].astype(np.int64).tobytes()
        tt.shape.append(s.num_targets)
        for name in fields:
            t = d.loss_fn_inputs[name]
            t.dtype, t.dense = pb.DTYPE_FLOAT32, np.asarray(s.inputs[name], np.float32).tobytes()
            t.shape.append(s.num_targets)
    for k, v in (config or {}).items():
        if isinstance(v, str):
            msg.loss_fn_config_v2[k].text = v
        else:
            msg.loss_fn_config_v2[k].number = float(v)
    return msg.SerializeToString()


def _post_proto(served, body):
    return _http(
        served,
        "POST",
        "/api/v1/forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf"},
    )


def _retrieve(served, request_id, accept="application/x-protobuf"):
    return _http(
        served,
        "POST",
        "/api/v1/retrieve_future",
        json={"request_id": request_id, "allow_metadata_only": True},
        headers={"Accept": accept},
    )


def _result(served, request_id):
    for _ in range(200):
        r = _retrieve(served, request_id)
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/x-protobuf"):
            out = pb.ForwardBackwardOutput()
            out.ParseFromString(r.content)
            return out
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError("no result")


def _proto_logprobs(out):
    bt = out.loss_fn_outputs[0].fields["logprobs"]
    offsets = np.frombuffer(bt.offsets, np.int64) // 4
    data = np.frombuffer(bt.data, np.float32)
    return [data[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


# -- authentication and logging -------------------------------------------------------------


def test_requests_without_or_with_a_wrong_key_are_refused(served, caplog):
    caplog.set_level(logging.INFO, logger="runner.serve")
    for key in (None, "tml-wrong", KEY + "x"):
        r = _http(served, "GET", "/api/v1/healthz", key=key)
        assert r.status_code == 401
        assert r.json()["category"] == "user" and "API key" in r.json()["error"]
    r = _http(
        served, "GET", "/api/v1/healthz", key=None, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert _http(served, "GET", "/api/v1/healthz").json() == {"status": "ok"}
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=served.url, api_key="tml-wrong").create_lora_training_client(
            MODEL, rank=8
        ).result(timeout=60)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "GET /api/v1/healthz 401" in logged and "GET /api/v1/healthz 200" in logged
    assert KEY not in logged and "tml-wrong" not in logged


def test_endpoints_are_also_served_under_the_serverless_prefix(served):
    # (the trainer-job prefix names a Fireworks account and job: tests/test_serve_fireworks.py)
    r = _http(served, "GET", "/training/v1/serverless/api/v1/healthz")
    assert r.json() == {"status": "ok"}
    caps = _http(served, "GET", "/api/v1/get_server_capabilities").json()
    assert caps["supported_models"][0]["model_name"] == MODEL
    assert caps["supported_models"][0]["max_context_length"] == _base(served).max_seq_len


# -- sessions -------------------------------------------------------------------------------


def test_session_lifecycle_raw(served):
    cfg = _http(served, "POST", "/api/v1/client/config", json={"sdk_version": "0.38.0"}).json()
    assert cfg["pjwt_auth_enabled"] is False and cfg["sample_use_retrieve_futures"] is False
    body = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}
    sid = _http(served, "POST", "/api/v1/create_session", json=body).json()["session_id"]
    beat = {"session_id": sid, "type": "session_heartbeat"}
    assert _http(served, "POST", "/api/v1/session_heartbeat", json=beat).json() == {
        "type": "session_heartbeat"
    }
    tele = {"events": [], "platform": "x", "sdk_version": "0.38.0", "session_id": sid}
    assert _http(served, "POST", "/api/v1/telemetry", json=tele).json() == {"status": "accepted"}
    fin = {"reason": {"type": "success"}, "detail": None}
    assert _http(served, "POST", f"/api/v1/sessions/{sid}/finish", json=fin).status_code == 200
    r = _http(served, "POST", "/api/v1/session_heartbeat", json=beat)
    assert r.status_code == 410 and r.json()["category"] == "user"
    r = _http(served, "POST", "/api/v1/create_model", json={**_model_body(sid), "model_seq_id": 9})
    assert r.status_code == 410  # a finished session creates nothing


def _model_body(session_id, base=MODEL):
    return {
        "session_id": session_id,
        "model_seq_id": 0,
        "base_model": base,
        "lora_config": {"rank": 8},
        "type": "create_model",
    }


def _raw_model(served):
    body = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}
    sid = _http(served, "POST", "/api/v1/create_session", json=body).json()["session_id"]
    ack = _http(served, "POST", "/api/v1/create_model", json=_model_body(sid)).json()
    assert _result(served, ack["request_id"])["model_id"] == ack["model_id"]
    return ack["model_id"]


# -- kernels --------------------------------------------------------------------------------


def test_every_kernel_over_the_sdk_equals_the_local_trainer(served, service):
    """forward and forward_backward of every kernel (the SDK's six, the rest as raw proto): the
    same logprobs, metrics and accumulated gradient as the in-process trainer."""
    client = _client(service, served)
    info = client.get_info()
    assert info.model_data.model_name == MODEL and info.is_lora is False  # the truth
    ref = _reference(served)
    _assert_params_equal(_params(served, client.model_id), ref.params)
    configs = {
        "ppo": {"clip_low_threshold": 0.7},
        "gspo": {},
        "cispo": {"clip_high_threshold": 3.0},
    }
    for loss in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"):
        seqs = _seqs(4, seed=len(loss), rl=loss != "cross_entropy")
        fields = ("weights",) if loss == "cross_entropy" else ("logprobs", "advantages")
        data = to_datums(seqs, fields)
        cfg = configs.get(loss)
        fwd = client.forward(data, loss, cfg).result()
        out = client.forward_backward(data, loss, cfg).result()
        want_fwd = ref.forward([s.with_inputs() for s in seqs])
        want = ref.forward_backward(seqs, loss, cfg)
        for o, lp in zip(out.loss_fn_outputs, want.logprobs, strict=True):
            np.testing.assert_array_equal(o["logprobs"].to_numpy(), np.asarray(lp, np.float32))
        for o, lp in zip(fwd.loss_fn_outputs, want_fwd, strict=True):
            np.testing.assert_array_equal(o["logprobs"].to_numpy(), np.asarray(lp, np.float32))
        assert out.metrics.keys() == want.metrics.keys(), loss
        for k, v in want.metrics.items():
            assert out.metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (loss, k)
        assert fwd.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5), loss
    # the kernels tinker's LossFnType lacks, over raw proto (the Fireworks SDK sends them)
    model = served.server.queues[client.model_id]
    seq = model.next_seq
    for loss, cfg in (
        ("dapo", {"eps_clip_c": 3.0}),
        ("dppo", {"divergence": "binary_kl"}),
        ("reinforce", {}),
    ):
        seqs = _seqs(3, seed=len(loss) + 10, rl=True)
        body = _proto_fb(client.model_id, seq, seqs, loss, ("logprobs", "advantages"), cfg)
        seq += 1
        out = _result(served, _post_proto(served, body).json()["request_id"])
        want = ref.forward_backward(seqs, loss, cfg)
        assert out.metrics["loss:sum"] == pytest.approx(
            want.metrics["loss:sum"], rel=1e-6, abs=1e-6
        )
    # the SDK's seq_ids continue after the raw ones only if it sent them: step through raw
    adam = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    ack = _http(
        served,
        "POST",
        "/api/v1/optim_step",
        json={"model_id": client.model_id, "seq_id": seq, "adam_params": vars(adam) | {}},
    ).json()
    metrics = _result(served, ack["request_id"])["metrics"]
    want = ref.optim_step(adam, "none")
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    _assert_params_equal(_params(served, client.model_id), ref.params, atol=1e-6)


# -- bad input ------------------------------------------------------------------------------


def test_bad_input_is_a_user_error_never_a_5xx(served, service):
    model_id = _raw_model(served)
    sid = model_id.split(":train:")[0]
    cases = [
        (
            "POST",
            "/api/v1/create_model",
            {"json": _model_body(sid, base="nope/x") | {"model_seq_id": 5}},
            "unknown base model",
        ),
        ("POST", "/api/v1/create_model", {"json": {"session_id": sid}}, "field 'model_seq_id'"),
        ("POST", "/api/v1/create_model", {"content": b"{not json"}, "not valid JSON"),
        (
            "POST",
            "/api/v1/forward_backward",
            {"content": b"\xff\xff\xff", "headers": {"Content-Type": "application/x-protobuf"}},
            "not a valid ForwardBackwardRequest",
        ),
        (
            "POST",
            "/api/v1/forward_backward",
            {"content": b"{}", "headers": {"Content-Type": "application/json"}},
            "x-protobuf",
        ),
        (
            "POST",
            "/api/v1/optim_step",
            {"json": {"model_id": "nobody:train:1", "seq_id": 1, "adam_params": {}}},
            "unknown model_id",
        ),
        (
            "POST",
            "/api/v1/retrieve_future",
            {"json": {"request_id": "req-gone"}},
            "unknown or expired",
        ),
        ("GET", "/api/v1/nowhere", {}, "Not Found"),
    ]
    for method, path, kw, message in cases:
        r = _http(served, method, path, **kw)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        assert r.json()["category"] == "user" and message in r.json()["error"], (path, r.text)
    # a bad request that names its seq_id fails in its turn; the next seq_id still runs
    seqs = _seqs(2)
    bad_cfg = _proto_fb(model_id, 1, seqs, "ppo", ("weights",), {"clip_low_threshold": 5.0})
    shifted = [Seq(s.tokens, s.inputs) for s in seqs]
    shifted_body = pb.ForwardBackwardRequest()
    shifted_body.ParseFromString(_proto_fb(model_id, 2, shifted, "cross_entropy", ("weights",)))
    shifted_body.data[0].loss_fn_inputs["target_tokens"].dense = (
        np.roll(shifted[0].tokens[1:], 1).astype(np.int64).tobytes()
    )
    good = _proto_fb(model_id, 3, seqs, "cross_entropy", ("weights",))
    acks = [
        _post_proto(served, b).json() for b in (bad_cfg, shifted_body.SerializeToString(), good)
    ]
    errors = [_result(served, a["request_id"]) for a in acks[:2]]
    assert [e["category"] for e in errors] == ["user", "user"]
    assert "ppo" in errors[0]["error"]  # the kernel table's rule, naming the kernel
    assert "next-token targets" in errors[1]["error"]
    assert isinstance(_result(served, acks[2]["request_id"]), pb.ForwardBackwardOutput)
    # sampling: stop strings need a tokenizer the server does not have
    client = _client(service, served)
    sampler = client.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="stop strings"):
        sampler.sample(
            types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2, stop=["\n"])
        ).result(timeout=60)


def test_bodies_over_the_limit_are_refused(tmp_path_factory, models):
    with _server(tmp_path_factory, models, max_body_bytes=4096) as st:
        r = _http(st, "POST", "/api/v1/create_session", content=b"x" * 10_000)
        assert r.status_code == 413 and r.json()["category"] == "user"
        import zstandard

        bomb = zstandard.ZstdCompressor().compress(b"{" + b" " * 100_000 + b"}")
        r = _http(
            st, "POST", "/api/v1/create_session", content=bomb, headers={"Content-Encoding": "zstd"}
        )
        assert r.status_code == 413 and "decompressed" in r.json()["error"]


# -- ordering -------------------------------------------------------------------------------


def test_seq_ids_run_in_order_once_and_retrieve_long_polls(served):
    model_id = _raw_model(served)
    queue = served.server.queues[model_id]
    seqs = _seqs(2, seed=3)
    bodies = {k: _proto_fb(model_id, k, seqs, "cross_entropy", ("weights",)) for k in (1, 2, 3)}
    ack3 = _post_proto(served, bodies[3]).json()
    ack2 = _post_proto(served, bodies[2]).json()
    assert _post_proto(served, bodies[2]).json()["request_id"] == ack2["request_id"]  # dedup
    r = _retrieve(served, ack3["request_id"])  # seq 1 is missing: nothing ran
    assert r.json() == {
        "type": "try_again",
        "request_id": ack3["request_id"],
        "queue_state": "active",
    }
    assert list(queue.executed) == [] and queue.waiting_for == 1
    ack1 = _post_proto(served, bodies[1]).json()
    outs = [_result(served, a["request_id"]) for a in (ack1, ack2, ack3)]
    assert list(queue.executed) == [1, 2, 3] and list(queue.arrived) == [3, 2, 1]
    # each ran once: three identical cross-entropy passes accumulate 3x one pass's gradient
    ref = _reference(served)
    for _ in range(3):
        ref.forward_backward(seqs, "cross_entropy")
    grads = served.server.engine.models[model_id].trainer.accumulated_grads()
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref.accumulated_grads()), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert all(isinstance(o, pb.ForwardBackwardOutput) for o in outs)
    r = _post_proto(served, bodies[1])  # already executed: the same future
    assert r.json()["request_id"] == ack1["request_id"]


def test_the_sdk_sends_chunks_two_to_n_first_and_compressed(tmp_path_factory, models):
    flags = {"fwdbwd_max_chunk_len": 2, "proto_compress_fwdbwd": True}
    with _server(tmp_path_factory, models, client_config=flags) as st:
        svc = tinker.ServiceClient(base_url=st.url, api_key=KEY)
        client = _client(svc, st)
        seqs = _seqs(6, seed=4)
        out = client.forward_backward(to_datums(seqs, ("weights",)), "cross_entropy").result()
        queue = st.server.queues[client.model_id]
        # chunks 2 and 3 go out concurrently (in either order), chunk 1 last; they run 1, 2, 3
        arrived = list(queue.arrived)
        assert sorted(arrived[:2]) == [2, 3] and arrived[2] == 1, arrived
        assert list(queue.executed) == [1, 2, 3]
        ref = _reference(st)
        want = ref.forward_backward(seqs, "cross_entropy")
        for o, lp in zip(out.loss_fn_outputs, want.logprobs, strict=True):
            np.testing.assert_array_equal(o["logprobs"].to_numpy(), np.asarray(lp, np.float32))
        assert out.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        ref.optim_step(AdamParams(learning_rate=1e-2))
        _assert_params_equal(_params(st, client.model_id), ref.params, atol=1e-6)
        svc.close("success").result(timeout=30)


# -- checkpoints ----------------------------------------------------------------------------


def test_save_and_load_with_and_without_optimizer_state(served, service):
    client = _client(service, served)
    seqs = _seqs(3, seed=5)
    data = to_datums(seqs, ("weights",))
    adam = types.AdamParams(learning_rate=1e-2)
    client.forward_backward(data, "cross_entropy").result()
    client.optim_step(adam).result()
    path = client.save_state("after-one").result().path
    assert path == f"tinker://{client.model_id}/weights/after-one"
    with pytest.raises(tinker.RequestFailedError, match="already exists") as exc:
        client.save_state("after-one").result()
    assert exc.value.category == types.RequestErrorCategory.User
    sampler_path = client.save_weights_for_sampler("after-one").result().path
    assert sampler_path == f"tinker://{client.model_id}/sampler_weights/after-one"

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    fresh = service.create_training_client_from_state(path).result()
    assert resumed.get_info().model_data.model_name == MODEL
    for c in (client, resumed, fresh):
        c.forward_backward(data, "cross_entropy").result()
        c.optim_step(adam).result()
    _assert_params_equal(_params(served, resumed.model_id), _params(served, client.model_id))
    ref = _reference(served)  # weights only: a fresh AdamW state on the loaded weights
    ref.load_state(str(served.server.engine._state_path(parse_tinker_path(path))), False)
    ref.forward_backward(seqs, "cross_entropy")
    ref.optim_step(AdamParams(learning_rate=1e-2))
    _assert_params_equal(_params(served, fresh.model_id), ref.params, atol=1e-7)

    listed = tinker.RestClient(base_url=served.url, api_key=KEY).list_checkpoints(client.model_id)
    rows = {c.tinker_path: c for c in listed.result().checkpoints}
    assert (
        rows[path].checkpoint_type == "training" and rows[path].checkpoint_id == "weights/after-one"
    )
    assert rows[sampler_path].checkpoint_type == "sampler"

    # sampling from the named sampler weights equals sampling from an unnamed snapshot of them
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=6, seed=11, stop=[])
    named = service.create_sampling_client(model_path=sampler_path).result()
    a = named.sample(prompt, 3, params).result()
    reloaded = service.create_training_client_from_state(path).result()
    b = reloaded.save_weights_and_get_sampling_client().result().sample(prompt, 3, params).result()
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.tokens == y.tokens and x.logprobs == y.logprobs


# -- sampling -------------------------------------------------------------------------------


def test_per_prompt_requests_reproduce_one_local_sample_call(served, service):
    client = _client(service, served)
    sampler = client.save_weights_and_get_sampling_client().result()
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 40, size=int(rng.integers(2, 12))).tolist() for _ in range(5)]
    calls = served.server.batcher.calls
    order = [len(prompts) - 1, *range(len(prompts) - 1)]  # the last first, as the runner does
    futures = {
        i: sampler.sample(
            types.ModelInput.from_ints(prompts[i]),
            3,
            types.SamplingParams(
                max_tokens=8, temperature=1.0, seed=prompt_seed(42, i, 3), stop=[1]
            ),
        )
        for i in order
    }
    got = [futures[i].result() for i in range(len(prompts))]
    want = _reference(served).sample(
        prompts, num_samples=3, max_tokens=8, temperature=1.0, seed=42, stop_token_ids=[1]
    )
    for g, w in zip(got, want, strict=True):
        assert len(g.sequences) == 3
        assert len({s.sequence_id for s in g.sequences}) == 3
        for s, ref in zip(g.sequences, w, strict=True):
            np.testing.assert_array_equal(s.tokens_np, ref.tokens.astype(np.int32))
            np.testing.assert_array_equal(s.logprobs_np, ref.logprobs)
            assert s.stop_reason == ref.stop_reason
    assert served.server.batcher.calls == calls + 1  # coalesced into one sample call
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompts[0])).result()
    assert lps[0] is None
    (want_lp,) = _reference(served).forward([Seq(np.asarray(prompts[0], np.int64))])
    np.testing.assert_allclose(lps[1:], want_lp, rtol=0, atol=1e-6)


# -- command line ---------------------------------------------------------------------------


def test_serve_refuses_to_start_without_its_key(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FOLDLOSS_TEST_UNSET_KEY", None)
    cmd = [sys.executable, "-m", "runner", "serve", "--port", "0"]
    proc = subprocess.run(
        [*cmd, "--api-key-env", "FOLDLOSS_TEST_UNSET_KEY", "--state-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "FOLDLOSS_TEST_UNSET_KEY" in proc.stderr
    pasted = subprocess.run(
        [*cmd, "--api-key-env", KEY, "--state-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        pasted.returncode == 2
        and KEY not in pasted.stderr
        and "not the key itself" in pasted.stderr
    )


def test_forward_backward_output_encoding_round_trips():
    from tinker.proto.response_conv import deserialize_forward_backward_output

    lps = [np.arange(3, dtype=np.float32), np.zeros(0, np.float32), -np.ones(2, np.float32)]
    out = deserialize_forward_backward_output(forward_backward_output(lps, {"loss:sum": 2.5}))
    assert [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs] == [
        [0.0, 1.0, 2.0],
        [],
        [-1.0, -1.0],
    ]
    assert out.metrics == {"loss:sum": 2.5} and json.dumps(out.metrics)


def test_every_client_controlled_size_is_bounded_naming_its_flag(tmp_path_factory, models, served):
    """Issue #23 item 2: ``sample(num_samples=10**6)`` grew the server to 14 GB until it was
    OOM-killed; now each size a client controls has a bound, and a request over one is a 400
    naming the bound and the flag that raises it."""
    service = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    sampler = _client(service, served).save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([3, 4])
    with pytest.raises(tinker.BadRequestError, match=r"num_samples is 1000000, .*--max-samples"):
        sampler.sample(prompt, 10**6, types.SamplingParams(max_tokens=2)).result(timeout=60)
    service.close("success").result(timeout=30)
    limits = dict(max_sample_tokens=100, max_sessions=1, max_models=1, max_batch_rows=2)
    with _server(tmp_path_factory, models, long_poll_s=0.5, **limits) as st:
        first = tinker.ServiceClient(base_url=st.url, api_key=KEY)
        client = _client(first, st)
        sampler = client.save_weights_and_get_sampling_client().result()
        with pytest.raises(tinker.BadRequestError, match=r"\(2 \+ 10 x 20\).*--max-sample-tokens"):
            sampler.sample(prompt, 10, types.SamplingParams(max_tokens=20)).result(timeout=60)
        out = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=20)).result(timeout=60)
        assert len(out.sequences) == 4  # within the bound
        with pytest.raises(tinker.BadRequestError, match=r"training models .* --max-models"):
            _client(first, st)
        datums = to_datums(_seqs(3), ("weights",))
        with pytest.raises(Exception, match=r"datums is 3, .*--max-batch-rows"):
            client.forward_backward(datums, "cross_entropy").result(timeout=60)
        with pytest.raises(Exception, match=r"live sessions of this API key is 2, .*--max-sess"):
            _client(tinker.ServiceClient(base_url=st.url, api_key=KEY), st)
        first.close("success").result(timeout=30)


def test_a_short_api_key_is_refused():
    """Issue #23 item 8: a one-character API key was accepted."""
    with pytest.raises(ValueError, match="at least 16 characters"):
        ServeConfig(api_key="k", state_dir="unused")
    with pytest.raises(ValueError, match="--max-samples must be an integer >= 1"):
        ServeConfig(api_key=KEY, state_dir="unused", max_samples=0)


def test_a_deeply_nested_body_is_a_400_not_a_500(served):
    """Issue #23 item 7: a 100,000-deep JSON body was answered with a 500."""
    body = b'{"sdk_version": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = _http(served, "POST", "/api/v1/create_session", content=body)
    assert r.status_code == 400 and r.json()["category"] == "user"
    assert "nested more than 512 levels" in r.json()["error"]
    twice = b'{"sdk_version": "1", "sdk_version": "2"}'
    r = _http(served, "POST", "/api/v1/create_session", content=twice)
    assert r.status_code == 400 and "duplicate key 'sdk_version'" in r.json()["error"]
