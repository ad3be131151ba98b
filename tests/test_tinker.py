"""`runner.tinker.TinkerTrainer` on the real tinker SDK against the local server over loopback.

The reference is a `LocalTrainer` of the served config in this process: the Tinker backend must
compute what the local backend computes. Fault injection answers chosen requests with
``try_again``, 410, 429, 503 or a user error (a server middleware, `Faults`): the trainer either
completes with the same result or raises one `TinkerRequestError` line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
import warnings

import jax
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

import losses  # noqa: E402
from benchmarks.synthetic import multi_turn_seqs  # noqa: E402
from runner import AdamParams, ClientLoss, Seq, StepRunner  # noqa: E402
from runner._net import ServiceUnreachable  # noqa: E402
from runner.checkpoints import CheckpointError  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.local import LocalTrainer  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from runner.tinker import BUILTIN_LOSSES, TinkerRequestError, TinkerTrainer, make_trainer  # noqa: E402
from tests.wire_helpers import TINY, Faults, refused_port, status, try_again, user_error  # noqa: E402

MODEL = "foldloss/tiny"
KEY_ENV = "FOLDLOSS_TEST_TINKER_KEY"
KEY = f"tml-{uuid.uuid4().hex}"
os.environ.setdefault("TINKER_TELEMETRY", "0")
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
TERM = losses.fold(losses.grpo(kl_coef=0.0), losses.echo_env(coef=0.2))


@pytest.fixture(scope="module")
def faults():
    return Faults()


@pytest.fixture(scope="module")
def served(tmp_path_factory, faults):
    models = parse_model_flags([f"{MODEL}=examples/tiny.toml"])
    state = tmp_path_factory.mktemp("tinker-state")
    config = ServeConfig(api_key=KEY, state_dir=str(state), long_poll_s=0.5)
    with ServerThread(config, models, middlewares=[faults.middleware]) as st:
        yield st


@pytest.fixture()
def cfg(served, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    return load_config(
        TINY,
        [
            "run.backend='tinker'",
            f"tinker.base_url='{served.url}'",
            f"tinker.base_model='{MODEL}'",
            f"tinker.api_key_env='{KEY_ENV}'",
            "tinker.lora_rank=8",
            "tinker.request_timeout_s=60.0",
        ],
    )


@pytest.fixture()
def trainer(cfg, faults):
    faults.clear()
    t = make_trainer(cfg)
    yield t
    faults.clear()
    t.close()


def _reference(served) -> LocalTrainer:
    return LocalTrainer(served.server.engine.base_models[MODEL].config)


def _served_params(served, trainer):
    return served.server.engine.models[trainer.model_id].trainer.params


def _assert_params_equal(a, b, atol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def _rl_seqs(served, seed=0, n=6):
    base = served.server.engine.base_models[MODEL]
    seqs, _ = multi_turn_seqs(
        np.random.default_rng(seed),
        n,
        lengths=(12, 30),
        obs_turn=(1, 4),
        gap=1,
        vocab=base.config.vocab_size,
        trainer=LocalTrainer(base.config),
    )
    return seqs


def _ce_seqs(n=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(3, 40, size=int(rng.integers(5, 20))).astype(np.int64)
        out.append(Seq(toks, {"weights": rng.uniform(0, 1, toks.shape[0] - 1)}))
    return out


# -- configuration --------------------------------------------------------------------------


def test_tinker_config_rules_and_the_key_is_never_echoed(monkeypatch):
    base = ["run.backend='tinker'", "tinker.base_model='m'"]
    cases = [
        (["run.backend='tinker'"], "[tinker].base_model is required"),
        ([*base, "tinker.lora_rank=0"], "lora_rank must be >= 1"),
        ([*base, "tinker.base_url='ftp://x'"], "must be an http(s) URL"),
        ([*base, "tinker.request_timeout_s=0.0"], "request_timeout_s must be > 0"),
        ([*base, "rl.kl_coef=0.1"], "local backend only"),
        ([*base, "tinker.nope=1"], "unknown key [tinker].nope"),
    ]
    for overrides, message in cases:
        with pytest.raises(
            ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
        ):
            load_config(TINY, overrides)
    with pytest.raises(ValueError) as exc:
        load_config(TINY, [*base, f"tinker.api_key_env='{KEY}'"])
    assert KEY not in str(exc.value) and "not the key itself" in str(exc.value)
    monkeypatch.delenv(KEY_ENV, raising=False)
    cfg = load_config(TINY, [*base, f"tinker.api_key_env='{KEY_ENV}'"])
    with pytest.raises(ValueError, match=f"set the environment variable {KEY_ENV}"):
        make_trainer(cfg)
    # the [tinker] section is where the service is, not what the run computes: a resume may
    # reach the same run at another URL
    moved = load_config(
        TINY, [*base, f"tinker.api_key_env='{KEY_ENV}'", "tinker.base_url='http://h:1'"]
    )
    assert moved.identity() == cfg.identity()


def test_an_unreachable_service_fails_fast_in_one_line(monkeypatch):
    port = refused_port()  # a port nothing listens on
    monkeypatch.setenv(KEY_ENV, KEY)
    cfg = load_config(
        TINY,
        [
            "run.backend='tinker'",
            "tinker.base_model='m'",
            f"tinker.api_key_env='{KEY_ENV}'",
            f"tinker.base_url='http://127.0.0.1:{port}'",
            "tinker.connect_timeout_s=2.0",
        ],
    )
    t0 = time.monotonic()
    with pytest.raises(ServiceUnreachable) as exc:
        make_trainer(cfg)
    assert time.monotonic() - t0 < 10
    msg = str(exc.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and "[tinker].connect_timeout_s" in msg
    assert KEY not in msg


def test_an_unknown_base_model_is_one_clear_error(served, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    cfg = load_config(
        TINY,
        [
            "run.backend='tinker'",
            "tinker.base_model='nobody/none'",
            f"tinker.api_key_env='{KEY_ENV}'",
            f"tinker.base_url='{served.url}'",
        ],
    )
    with pytest.raises(TinkerRequestError, match="unknown base model 'nobody/none'") as exc:
        make_trainer(cfg)
    assert "\n" not in str(exc.value) and KEY not in str(exc.value)


# -- the trainer ----------------------------------------------------------------------------


def test_trainer_equals_the_local_trainer(served, trainer):
    """forward, every builtin kernel, optim_step and sampling, against the in-process trainer."""
    assert trainer.builtin_losses == BUILTIN_LOSSES
    assert set(BUILTIN_LOSSES) == {
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
    }
    ref = _reference(served)
    _assert_params_equal(_served_params(served, trainer), ref.params)
    seqs = _ce_seqs(seed=1)
    for a, b in zip(trainer.forward(seqs), ref.forward(seqs), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b, np.float32))
    got = trainer.forward_backward(seqs, "cross_entropy")
    want = ref.forward_backward(seqs, "cross_entropy")
    assert got.metrics == pytest.approx(want.metrics, rel=1e-6)
    rl = [
        s.with_inputs(
            logprobs=np.minimum(s.inputs["sampling_logprobs"], 0.0),
            advantages=s.inputs["advantages"] * s.inputs["action_mask"],
        )
        for s in _rl_seqs(served, seed=2)
    ]
    for loss in ("importance_sampling", "ppo", "cispo", "dro", "gspo"):
        got = trainer.forward_backward(
            rl, loss, {"clip_low_threshold": 0.7} if loss == "ppo" else None
        )
        want = ref.forward_backward(
            rl, loss, {"clip_low_threshold": 0.7} if loss == "ppo" else None
        )
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            np.testing.assert_array_equal(a, np.asarray(b, np.float32))
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6), loss
    with pytest.raises(ValueError, match="no normalization option"):
        trainer.optim_step(ADAM, "num_loss_tokens")
    with pytest.raises(ValueError, match="clip_low_threshold"):
        trainer.forward_backward(rl, "ppo", {"clip_low_threshold": 3.0})  # the kernel table's rule
    with pytest.raises(ValueError, match="unknown loss 'dapo'"):
        trainer.forward_backward(rl, "dapo")
    metrics = trainer.optim_step(ADAM, "none")
    assert metrics["grad_norm"] == pytest.approx(
        ref.optim_step(ADAM, "none")["grad_norm"], rel=1e-5
    )
    _assert_params_equal(_served_params(served, trainer), ref.params, atol=1e-6)
    # sampling: the local backend's samples, prompt by prompt, stop tokens included
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11, 12]]
    kw = dict(num_samples=3, max_tokens=6, temperature=1.0, seed=7, stop_token_ids=[5, 9])
    got, want = trainer.sample(prompts, **kw), ref.sample(prompts, **kw)
    for g_row, w_row in zip(got, want, strict=True):
        for g, w in zip(g_row, w_row, strict=True):
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_array_equal(g.logprobs, w.logprobs)
            assert g.stop_reason == w.stop_reason
    assert trainer.counters["sampler_sync"] == 1
    trainer.sample(prompts, **kw)
    assert trainer.counters["sampler_sync"] == 1  # same weights: the same sampling client


def test_resumable_checkpoints_resolve_and_restore_exactly(served, trainer, cfg):
    seqs = _ce_seqs(seed=3)
    trainer.forward_backward(seqs, "cross_entropy")
    trainer.optim_step(ADAM)
    record = trainer.save_resumable("ckpt-a")
    assert record["checkpoint_kind"] == "tinker_state" and record["identity_resolved"] is True
    assert record["tinker_path"] == f"tinker://{trainer.model_id}/weights/ckpt-a"
    assert record["checkpoint_time"] and record["base_model"] == MODEL
    promo = trainer.save_promotable("ckpt-a")
    assert promo["snapshot_path"] == f"tinker://{trainer.model_id}/sampler_weights/ckpt-a"
    assert promo["snapshot_path"] != record["tinker_path"] and promo["identity_resolved"]
    json.dumps(record), json.dumps(promo)  # manifest-ready
    other = make_trainer(cfg)
    try:
        other.load_resumable(record)
        assert other.model_id != trainer.model_id
        for t in (trainer, other):
            t.forward_backward(seqs, "cross_entropy")
            t.optim_step(ADAM)
        _assert_params_equal(_served_params(served, other), _served_params(served, trainer))
    finally:
        other.close()


def test_resume_fails_closed(served, trainer, cfg):
    trainer.forward_backward(_ce_seqs(seed=4), "cross_entropy")
    trainer.optim_step(ADAM)
    record = trainer.save_resumable("ckpt-b")
    bad = [
        (dict(record, checkpoint_kind="fireworks_dcp"), "not a Tinker state"),
        (dict(record, base_model="other/model"), "base model 'other/model'"),
        (dict(record, checkpoint_name="ckpt-x"), "the manifest was edited"),
        (
            dict(
                record, tinker_path=record["tinker_path"].replace("/weights/", "/sampler_weights/")
            ),
            "the manifest was edited",
        ),
        (dict(record, training_run_id="someone:train:0"), "names training run"),
        (dict(record, tinker_path="gs://bucket/x"), "not a tinker:// checkpoint path"),
        (dict(record, checkpoint_time="2020-01-01T00:00:00+00:00"), "was replaced"),
    ]
    other = TinkerTrainer(
        trainer.client, service=trainer.service, rest=trainer.rest, base_model=MODEL
    )
    for identity, message in bad:
        with pytest.raises(CheckpointError, match=message):
            other.load_resumable(identity)
    assert other.counters["load_state"] == 0  # nothing was loaded
    # the same name saved again (overwrite) is another checkpoint: refused
    time.sleep(0.01)
    trainer.client.save_state("ckpt-b", overwrite=True).result()
    with pytest.raises(CheckpointError, match="was replaced"):
        other.load_resumable(record)
    # gone from the service
    record_c = trainer.save_resumable("ckpt-c")
    state = served.server.engine.run_dir(trainer.model_id) / "trainer" / "state" / "ckpt-c"
    shutil.rmtree(state)
    with pytest.raises(CheckpointError, match="no longer in its run's checkpoint listing"):
        other.load_resumable(record_c)
    # an identity the service could not resolve loads by path, with a warning
    record_d = dict(trainer.save_resumable("ckpt-d"), identity_resolved=False, checkpoint_time=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_resumable(record_d)
    assert any("identity unresolved" in str(w.message) for w in caught)
    assert other.counters["load_state"] == 1


# -- fault injection ------------------------------------------------------------------------


def test_faults_the_sdk_retries_complete_with_the_same_result(served, trainer, faults):
    ref = _reference(served)
    faults.add(
        "poll", path="/retrieve_future", request_type="ForwardBackward", reply=try_again, count=40
    )
    faults.add("503", path="/retrieve_future", request_type="OptimStep", reply=status(503), count=5)
    faults.add("429", path="/optim_step", reply=status(429, **{"retry-after-ms": "5"}), count=2)
    faults.add(
        "fb429", path="/forward_backward", reply=status(429, **{"retry-after-ms": "5"}), count=1
    )
    seqs = _ce_seqs(seed=5)
    got = trainer.forward_backward(seqs, "cross_entropy")
    want = ref.forward_backward(seqs, "cross_entropy")
    assert got.metrics == pytest.approx(want.metrics, rel=1e-6)
    trainer.optim_step(ADAM)
    ref.optim_step(ADAM)
    assert faults.hits == {"poll": 40, "503": 5, "429": 2, "fb429": 1}
    queue = served.server.queues[trainer.model_id]
    assert list(queue.executed) == [1, 2]  # the resubmitted seq_ids ran once
    _assert_params_equal(_served_params(served, trainer), ref.params, atol=1e-6)
    # a 429 on a sample resubmits it (the same seq_id): the samples are the local ones
    faults.add("s429", path="/asample", reply=status(429), count=1)
    kw = dict(num_samples=2, max_tokens=4, temperature=1.0, seed=3)
    got = trainer.sample([[3, 4]], **kw)[0]
    want = ref.sample([[3, 4]], **kw)[0]
    assert faults.hits["s429"] == 1
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.tokens, w.tokens)


@pytest.mark.parametrize(
    "fault, message",
    [
        (
            dict(path="/retrieve_future", request_type="OptimStep", reply=status(410)),
            "Promise expired",
        ),
        (
            dict(path="/retrieve_future", request_type="ForwardBackward", reply=user_error),
            "(user error): Request failed: injected: bad datum 0",
        ),
        (
            dict(
                path="/forward_backward",
                reply=status(400, {"error": "injected bad request", "category": "user"}),
            ),
            "HTTP 400",
        ),
    ],
)
def test_faults_that_stop_the_trainer_are_one_clear_line(
    served, trainer, faults, fault, message, caplog
):
    caplog.set_level(logging.DEBUG)
    faults.add("fault", **fault)
    with pytest.raises(TinkerRequestError) as exc:
        trainer.forward_backward(_ce_seqs(seed=6), "cross_entropy")
        trainer.optim_step(ADAM)
    text = str(exc.value)
    assert message in text and "\n" not in text and text.startswith(f"Tinker ({served.url}):")
    assert KEY not in text and all(KEY not in r.getMessage() for r in caplog.records)


def test_a_silent_service_times_out_in_one_line(served, cfg, faults):
    import asyncio

    async def hang(request):
        await asyncio.sleep(5)

    faults.clear()
    trainer = make_trainer(
        dataclasses.replace(cfg, tinker=dataclasses.replace(cfg.tinker, request_timeout_s=1.5))
    )
    try:
        faults.add("hang", path="/retrieve_future", request_type="Forward", reply=hang, count=100)
        t0 = time.monotonic()
        with pytest.raises(
            TinkerRequestError, match="no result within \\[tinker\\].request_timeout_s = 1.5 s"
        ):
            trainer.forward(_ce_seqs(seed=7))
        assert time.monotonic() - t0 < 10
    finally:
        faults.clear()
        trainer.close()


def test_a_waiting_run_says_so_and_a_listener_that_never_answers_ends_in_one_line(cfg, capsys):
    """Issue #23 item 3: against a listener that never answers the runner printed nothing for
    120 s (the SDK creates its session synchronously, with no timeout of its own)."""
    import socket

    from runner import __main__ as cli

    with socket.socket() as listener:  # accepts connections (the probe passes), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        args = ["train", "--config", str(TINY), "--no-progress", "--output-dir"]
        args += [str(cfg.run.output_dir), "--backend", "tinker"]
        for key in ("base_model", "api_key_env", "lora_rank"):
            args += ["--set", f"tinker.{key}={getattr(cfg.tinker, key)!r}"]
        args += ["--set", f"tinker.base_url='{url}'", "--set", "tinker.request_timeout_s=6"]
        capsys.readouterr()
        t0 = time.monotonic()
        assert cli.main(args) == 2
        assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        f"waiting for create_lora_training_client from {url}: 5 s so far (gives up after 6 s, "
        "[tinker].request_timeout_s)"
    )
    assert err[1:] == [
        f"error: Tinker ({url}): cannot create a training client of '{MODEL}': no answer within "
        "[tinker].request_timeout_s = 6 s"
    ]


# -- the torch bridge -----------------------------------------------------------------------


def test_client_loss_through_the_sdk_equals_the_sdks_forward_backward_custom(served, trainer, cfg):
    torch = pytest.importorskip("torch")
    del torch
    from runner.tinker import torch_loss_fn
    from runner.tinker._convert import to_datums

    seqs = _rl_seqs(served, seed=8, n=5)
    other = make_trainer(cfg)  # a second model from the same initialization
    try:
        value, metrics = ClientLoss(TERM)(trainer, seqs)  # forward + linear cross_entropy
        data = to_datums([s.with_inputs() for s in seqs], ())
        result = other.client.forward_backward_custom(data, torch_loss_fn(TERM, seqs)).result()
        assert result.metrics["loss:sum"] == pytest.approx(value, rel=1e-5)  # the custom value
        assert result.metrics["grpo/loss"] == pytest.approx(metrics["grpo/loss"], rel=1e-5)
        grads = [
            served.server.engine.models[t.model_id].trainer.accumulated_grads()
            for t in (trainer, other)
        ]
        for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        # and both equal the local backend's fused client step
        ref = _reference(served)
        StepRunner(TERM, mode="client").step(ref, seqs, ADAM)
        trainer.optim_step(ADAM)
        _assert_params_equal(_served_params(served, trainer), ref.params, atol=1e-6)
    finally:
        other.close()
