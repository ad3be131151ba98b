"""The main job on ``--backend fireworks`` against the local server equals ``--backend local``.

The real, unmodified Fireworks SDK provisions a trainer and a hot-load deployment through the
server's control plane (`runner.serve._fw_control`), trains over its JSON training wire and
samples through its streamed completions; only the base URL differs from a hosted run. One
local run of examples/tiny.toml (in process, ``x64`` on) is the reference of two regimes:

- in process: a server thread with fault injection and ``runner.__main__.main``. The faults the
  SDK retries (``try_again`` streaks, 429s, 503s) are invisible; a 410 on a result and a user
  error stop the run with one error line; ``--resume`` continues (a new trainer job loads the
  checkpoint through ``cross_job://``, a reattached one by name), and the last phase promotes
  the final model and deletes its trainer;
- processes (``JAX_ENABLE_X64=1``, so both regimes compute the same numbers): ``python -m runner
  serve`` and ``python -m runner train --backend fireworks``; the runner is killed with SIGKILL
  and resumed, then the *server* is killed mid-step (the runner stops with one error line),
  restarted on the same state directory at another port, and the run resumed there.

Either way the per-step metrics equal the local run's and the final weights agree within 1e-6:
no step was lost or trained twice. The API key (a fresh sentinel) appears nowhere.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402

import runner.fireworks._trainer as fw_trainer  # noqa: E402
from runner import __main__ as cli  # noqa: E402
from runner import checkpoints as ckpt  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
BASE = "accounts/fireworks/models/qwen3-8b"
SHAPE = "accounts/fireworks/trainingShapes/ts-qwen3-8b-policy"
KEY_ENV = "FOLDLOSS_TEST_FIREWORKS_KEY"
TML_ENV = "FOLDLOSS_TEST_TINKER_KEY"
SENTINEL = f"fw-SENTINEL-{uuid.uuid4().hex}"
COMPARED = ("sft/nll", "reward", "loss", "grpo/loss", "echo_env/nll", "eval_reward")
COUNTED = ("passes/forwards", "passes/backwards", "plan/client", "tokens")
FW = [
    f"fireworks.base_model='{BASE}'",
    f"fireworks.training_shape_id='{SHAPE}'",
    f"fireworks.api_key_env='{KEY_ENV}'",
]


class Faults:
    """A server middleware answering matching requests with canned replies.

    `add` a rule: requests whose path ends with ``path`` (and, for ``retrieve_future``, of the
    SDK's ``X-Tinker-Request-Type``) are answered by ``reply(request)`` ``count`` times after
    ``skip`` matching requests passed through. With ``on_result``, a ``retrieve_future`` is
    served first and only a finished result counts (and is replaced). ``hits`` counts faults.
    """

    def __init__(self) -> None:
        self.rules: list[dict] = []
        self.hits: dict[str, int] = {}

    def add(self, name, *, path, reply, request_type=None, count=1, skip=0, on_result=False):
        self.rules.append(
            dict(
                name=name,
                path=path,
                reply=reply,
                type=request_type,
                count=count,
                skip=skip,
                on_result=on_result,
            )
        )

    def clear(self) -> None:
        self.rules.clear()

    @property
    def middleware(self):
        @web.middleware
        async def faults(request, handler):
            for rule in self.rules:
                if not request.path.endswith(rule["path"]) or rule["count"] <= 0:
                    continue
                if rule["type"] and request.headers.get("X-Tinker-Request-Type") != rule["type"]:
                    continue
                if rule["on_result"]:
                    response = await handler(request)
                    if b'"try_again"' in (getattr(response, "body", b"") or b""):
                        return response
                    if rule["skip"] > 0:
                        rule["skip"] -= 1
                        return response
                    rule["count"] -= 1
                    self.hits[rule["name"]] = self.hits.get(rule["name"], 0) + 1
                    return rule["reply"](request)
                if rule["skip"] > 0:
                    rule["skip"] -= 1
                    continue
                rule["count"] -= 1
                self.hits[rule["name"]] = self.hits.get(rule["name"], 0) + 1
                reply = rule["reply"](request)
                return await reply if inspect.isawaitable(reply) else reply
            return await handler(request)

        return faults


def try_again(request):
    return web.json_response({"type": "try_again", "request_id": "x", "queue_state": "active"})


def status(code, **headers):
    def reply(request):
        body = {"error": f"injected {code}", "category": "server"}
        return web.json_response(body, status=code, headers=headers)

    return reply


def user_error(request):
    return web.json_response({"error": "injected: bad datum 0", "category": "user"})


def _train_args(out: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--output-dir", str(out), "--no-progress", *extra]


def _fw_args(url: str, *sets: str) -> list[str]:
    args = ["--backend", "fireworks", "--set", f"fireworks.base_url='{url}'"]
    for s in (*FW, *sets):
        args += ["--set", s]
    return args


def _records(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"a step is missing or repeated: {steps}"
    return {r["step"]: r for r in records}


def _local_weights(run_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    root = run_dir / "checkpoints"
    manifest = ckpt.read_manifest(root, ckpt.latest_step(root))
    return load_file(run_dir / manifest["promotable"]["snapshot_path"])


def _promoted_weights(run_dir: Path, state: Path) -> dict[str, np.ndarray]:
    """The final model the run promoted, as the server stored it."""
    from safetensors.numpy import load_file

    final = json.loads((run_dir / "fireworks_final_model.json").read_text())
    model_id = final["output_model_id"]
    assert final["model"]["name"].endswith(f"/models/{model_id}")
    return load_file(state / "fireworks" / "models" / f"{model_id}.safetensors")


def _assert_same_run(got_dir: Path, state: Path, want_dir: Path) -> None:
    got, want = _records(got_dir), _records(want_dir)
    assert sorted(got) == sorted(want) == list(range(len(want)))
    for step, w in want.items():
        g = got[step]
        for key in COMPARED:
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), (step, key)
        for key in COUNTED:
            if key in w:
                assert g[key] == w[key], (step, key)
    a, b = _promoted_weights(got_dir, state), _local_weights(want_dir)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)


def _assert_fireworks_manifests(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    for step in range(2, ckpt.latest_step(root) + 1, 2):
        r = ckpt.read_manifest(root, step)["resumable"]
        assert r["checkpoint_kind"] == "fireworks_dcp" and r["identity_resolved"], step
        assert r["checkpoint_resource"].endswith("/checkpoints/" + r["checkpoint_name"])
        assert r["base_model"] == BASE and r["source_trainer_job_id"]


def _assert_no_key(*texts: str, dirs: tuple[Path, ...] = ()) -> None:
    for text in texts:
        assert SENTINEL not in text
    for d in dirs:
        for path in d.rglob("*"):
            if path.is_file():
                assert SENTINEL.encode() not in path.read_bytes(), path


def _one_error_line(stderr: str) -> str:
    """The run's one ``error:`` line, last (the SDK's own log warnings may precede it)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    assert cli.main(_train_args(out, "--set", "checkpoint.save_promotable=true")) == 0
    return out / "tiny"


# -- in process, with faults ----------------------------------------------------------------


def test_faults_on_the_wire_stop_cleanly_and_resume_to_the_local_run(
    local_run, tmp_path, monkeypatch, capsys, caplog, recwarn
):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(KEY_ENV, SENTINEL)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    # the control plane answers at once: no need to wait for late rows between polls
    monkeypatch.setattr(
        fw_trainer,
        "FireworksTrainer",
        functools.partial(fw_trainer.FireworksTrainer, settle_s=0.0, poll_interval_s=0.01),
    )
    faults = Faults()
    models = parse_model_flags([f"{BASE}=examples/tiny.toml"])
    state, out = tmp_path / "state", tmp_path / "runs"
    config = ServeConfig(api_key=SENTINEL, state_dir=str(state), long_poll_s=0.5)
    with ServerThread(config, models, middlewares=[faults.middleware]) as st:
        control = st.server.flavours[1].control
        run_dir = out / "tiny"
        # 1. retried by the SDK (invisible to the run): a try_again streak, 429s and 503s; then a
        #    410 on the 3rd optimizer step's result stops the run after the checkpoint of step 2
        faults.add(
            "poll",
            path="/retrieve_future",
            request_type="ForwardBackward",
            reply=try_again,
            count=40,
        )
        faults.add("429", path="/optim_step", reply=status(429, **{"retry-after-ms": "5"}), count=2)
        faults.add(
            "503", path="/retrieve_future", request_type="OptimStep", reply=status(503), count=5
        )
        faults.add(
            "410",
            path="/retrieve_future",
            request_type="OptimStep",
            reply=status(410),
            skip=2,
            on_result=True,
        )
        capsys.readouterr()
        assert cli.main(_train_args(out, *_fw_args(st.url, "rl.steps=1"))) == 2
        err1 = capsys.readouterr().err
        line = _one_error_line(err1)
        assert "optim_step" in line and "Promise expired" in line and st.url in line, line
        assert ckpt.latest_step(run_dir / "checkpoints") == 2
        assert faults.hits == {"poll": 40, "429": 2, "503": 5, "410": 1}
        job_a = ckpt.read_manifest(run_dir / "checkpoints", 2)["resumable"]["source_trainer_job_id"]
        # 2. a user error on the first result after the resume stops it again, with its category
        faults.clear()
        faults.add(
            "user", path="/retrieve_future", request_type="ForwardBackward", reply=user_error
        )
        assert cli.main(_train_args(out, "--resume", *_fw_args(st.url, "rl.steps=1"))) == 2
        err2 = capsys.readouterr().err
        line = _one_error_line(err2)
        assert "(user error)" in line and "injected: bad datum 0" in line, line
        assert ckpt.latest_step(run_dir / "checkpoints") == 2
        # 3. steps 3-4 on the first trainer job, reattached: the checkpoint loads by name
        faults.clear()
        reattach = _fw_args(st.url, "rl.steps=1", f"fireworks.trainer_job_id='{job_a}'")
        assert cli.main(_train_args(out, "--resume", *reattach)) == 0
        assert ckpt.latest_step(run_dir / "checkpoints") == 4
        step4 = ckpt.read_manifest(run_dir / "checkpoints", 4)["resumable"]
        assert step4["source_trainer_job_id"] == job_a
        # 4. steps 5-6 on a new trainer (cross_job:// resume), then promotion, then deletion
        final = _fw_args(st.url, "fireworks.output_model_id='tiny-final'")
        assert cli.main(_train_args(out, "--resume", *final)) == 0
        done = capsys.readouterr()
        record = json.loads((run_dir / "fireworks_final_model.json").read_text())
        job_d = record["trainer_job_id"]
        assert job_d != job_a and record["step"] == 6
        assert control.jobs[job_d]["state"] == "JOB_STATE_DELETED"
        assert control.jobs[job_a]["state"] == "JOB_STATE_RUNNING"  # only the final one goes
        promoted = control.models["tiny-final"]
        assert promoted["checkpoint"] == record["checkpoint_resource"]
        assert "run directory" in done.out
    _assert_same_run(run_dir, state, local_run)
    _assert_fireworks_manifests(run_dir)
    texts = [err1, err2, done.out, done.err, *(r.getMessage() for r in caplog.records)]
    texts += [str(w.message) for w in recwarn]
    _assert_no_key(*texts, dirs=(out, state))


def test_cli_without_the_api_key_fails_naming_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV, raising=False)
    args = _train_args(tmp_path, *_fw_args("http://127.0.0.1:9"))
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"set the environment variable {KEY_ENV}" in err


def test_cli_rejects_a_vision_model_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, SENTINEL)
    vlm = "fireworks.base_model='accounts/fireworks/models/qwen2p5-vl-32b-instruct'"
    assert cli.main(_train_args(tmp_path, *_fw_args("http://127.0.0.1:9", vlm))) == 2
    err = capsys.readouterr().err
    assert "vision-language model" in err and SENTINEL not in err
    assert not (tmp_path / "tiny").exists()


def _refused_port() -> int:
    """A loopback port that refuses connections (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_control_plane_fails_fast_in_one_line(tmp_path, monkeypatch, capsys):
    """Issue #12 row 8: offline, the SDK's retry loop ran 5 min, then a 101-line traceback."""
    monkeypatch.setenv(KEY_ENV, SENTINEL)
    url = f"http://127.0.0.1:{_refused_port()}"
    t0 = time.monotonic()
    assert cli.main(_train_args(tmp_path, *_fw_args(url))) == 2
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert elapsed < 10.0, elapsed  # the default bound is 10 s; a refusal answers at once
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the Fireworks control "), (
        err
    )
    assert url in err and "refused" in err.lower() and SENTINEL not in err


def test_a_host_that_never_answers_is_bounded_by_connect_timeout(monkeypatch):
    from runner._net import ServiceUnreachable, probe

    with socket.socket() as listener:  # a full accept backlog: connects hang, never refused
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        hogs = []
        try:
            for _ in range(8):
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                hogs.append(c)
            t0 = time.monotonic()
            try:
                probe(f"http://127.0.0.1:{port}", timeout_s=0.5, what="test service", setting="x")
            except ServiceUnreachable as exc:
                assert "after" in str(exc) and "x = 0.5 s" in str(exc)
            # (Linux may complete the handshake into the backlog: then the probe succeeds.)
            assert time.monotonic() - t0 < 3.0
        finally:
            for c in hogs:
                c.close()
    with pytest.raises(ServiceUnreachable, match="cannot resolve host"):
        probe("https://no-such-host.invalid", timeout_s=5.0, what="test service", setting="x")


# -- processes: SIGKILL, and a server killed mid-step ---------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TINKER_TELEMETRY="0", JAX_ENABLE_X64="1")
    env[KEY_ENV] = SENTINEL
    env[TML_ENV] = f"tml-{uuid.uuid4().hex}"  # the tinker SDK's key: the server takes both
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path.parent / "jax-cache-x64"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


class _Server:
    """``python -m runner serve`` on an ephemeral port (stopped by the test)."""

    def __init__(self, state: Path, env: dict[str, str], log: Path) -> None:
        cmd = [sys.executable, "-m", "runner", "serve", "--port", "0"]
        cmd += ["--api-key-env", f"{TML_ENV},{KEY_ENV}"]
        cmd += ["--model", f"{BASE}=examples/tiny.toml", "--state-dir", str(state)]
        cmd += ["--long-poll-s", "2"]
        self._log = open(log, "a")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        line = self.proc.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", line), (line, log.read_text()[-2000:])
        self.url = line

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.proc.stdout.close()
        self._log.close()


def _wait_for_step(proc, marker: Path, step: int, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = marker.read_text().strip() if marker.exists() else ""
        if text and int(text) >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {step}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no checkpoint of step {step} within {timeout_s} s")


def test_sigkill_and_a_killed_server_resume_to_the_local_run(local_run, tmp_path):
    env = _env(tmp_path)
    state, out, log = tmp_path / "state", tmp_path / "runs", tmp_path / "server.log"
    marker = out / "tiny" / "checkpoints" / "latest"
    train = [sys.executable, "-m", "runner"]
    server = _Server(state, env, log)
    try:
        # 1. the runner is killed with SIGKILL after the checkpoint of step 2
        r1 = subprocess.Popen(
            [*train, *_train_args(out, *_fw_args(server.url))],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_for_step(r1, marker, 2)
        r1.send_signal(signal.SIGKILL)
        r1.wait(timeout=60)
        # 2. resumed on a new trainer job; the server is killed mid-run: one error line
        r2 = subprocess.Popen(
            [
                *train,
                *_train_args(
                    out, "--resume", *_fw_args(server.url, "fireworks.request_timeout_s=8")
                ),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_for_step(r2, marker, 4)
        server.kill()
        _, err = r2.communicate(timeout=300)
        assert r2.returncode == 2, err[-3000:]
        line = _one_error_line(err)
        assert f"Fireworks ({server.url})" in line, line
        stopped_at = ckpt.latest_step(out / "tiny" / "checkpoints")
        assert 4 <= stopped_at < load_config(TINY).total_steps
    finally:
        server.stop()
    # 3. a new server on the same state directory (another port); the run resumes there
    server = _Server(state, env, log)
    try:
        final = _fw_args(server.url, "fireworks.output_model_id='tiny-final'")
        r3 = subprocess.run(
            [*train, *_train_args(out, "--resume", *final)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r3.returncode == 0, r3.stderr[-3000:]
    finally:
        server.stop()
    _assert_same_run(out / "tiny", state, local_run)
    _assert_fireworks_manifests(out / "tiny")
    _assert_no_key(r3.stdout, r3.stderr, err, log.read_text(), dirs=(out, state))
