"""The main job on ``--backend tinker`` against the local server equals ``--backend local``.

Two regimes, each compared like with like:

- processes (the real command lines, ``x64`` off): ``python -m runner serve`` and
  ``python -m runner train --backend tinker``; the runner is killed with SIGKILL and resumed, then
  the *server* is killed mid-step (the runner stops with one error line), restarted on the same
  state directory at another port, and the run resumed there;
- in process: a server thread with fault injection (``try_again`` streaks, 429s, a 410 and a
  user error) and ``runner.__main__.main``: the faults the SDK retries are invisible, the others
  stop the run with one error line, and ``--resume`` continues. (The test process enables
  ``x64``; the local run is bitwise the same either way, so both regimes compare with the one
  local command-line run.)

Either way the per-step metrics equal the local run's and the final parameters agree within
1e-6: no step was lost or trained twice. The API key (a fresh sentinel) appears nowhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

from runner import __main__ as cli  # noqa: E402
from runner import checkpoints as ckpt  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from runner.serve._tinker import parse_tinker_path  # noqa: E402
from tests.test_tinker import Faults, status, try_again, user_error  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
MODEL = "foldloss/tiny"
KEY_ENV = "FOLDLOSS_TEST_TINKER_MAIN_KEY"
KEY = f"tml-SENTINEL-{uuid.uuid4().hex}"
COMPARED = ("sft/nll", "reward", "loss", "grpo/loss", "echo_env/nll", "eval_reward")
COUNTED = ("passes/forwards", "passes/backwards", "plan/client", "tokens")


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TINKER_TELEMETRY="0")
    env[KEY_ENV] = KEY
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path.parent / "jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def _train_args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(TINY),
        "--output-dir",
        str(out),
        "--no-progress",
        "--checkpoint-interval",
        "1",
        "--set",
        "checkpoint.save_promotable=true",
        *extra,
    ]


def _tinker_args(url: str, timeout_s: float = 60.0) -> list[str]:
    sets = [
        f"tinker.base_url='{url}'",
        f"tinker.base_model='{MODEL}'",
        f"tinker.api_key_env='{KEY_ENV}'",
        "tinker.lora_rank=8",
        f"tinker.request_timeout_s={timeout_s}",
    ]
    return ["--backend", "tinker", *(a for s in sets for a in ("--set", s))]


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"a step is missing or repeated: {steps}"
    return {r["step"]: r for r in records}


def _final_weights(run_dir: Path, state_dir: Path | None = None) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    root = run_dir / "checkpoints"
    manifest = ckpt.read_manifest(root, ckpt.latest_step(root))
    path = manifest["promotable"]["snapshot_path"]
    if state_dir is None:
        return load_file(run_dir / path)
    ref = parse_tinker_path(path)
    return load_file(
        state_dir / "runs" / ref.model_id / "trainer" / "sampler" / f"{ref.name}.safetensors"
    )


def _assert_same_run(got_dir, want_dir, got_state, want_state=None):
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
    a, b = _final_weights(got_dir, got_state), _final_weights(want_dir, want_state)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)


def _assert_tinker_manifests(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    for step in range(1, ckpt.latest_step(root) + 1):
        m = ckpt.read_manifest(root, step)
        assert m["backend"] == "tinker"
        r, p = m["resumable"], m["promotable"]
        assert r["checkpoint_kind"] == "tinker_state" and r["identity_resolved"], step
        assert r["tinker_path"].startswith("tinker://") and "/weights/" in r["tinker_path"]
        assert (
            p["snapshot_path"].startswith("tinker://") and "/sampler_weights/" in p["snapshot_path"]
        )
        assert r["checkpoint_name"] == p["snapshot_name"] == m["saved_as"]


def _assert_no_key(*texts: str, dirs: tuple[Path, ...] = ()) -> None:
    for text in texts:
        assert KEY not in text
    for d in dirs:
        for path in d.rglob("*"):
            if path.is_file():
                assert KEY.encode() not in path.read_bytes(), path


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


# -- processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    cmd = [sys.executable, "-m", "runner", *_train_args(out)]
    proc = subprocess.run(cmd, env=_env(out), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tiny"


class _Server:
    """``python -m runner serve`` on an ephemeral port (stopped by the test)."""

    def __init__(self, state: Path, env: dict[str, str], log: Path) -> None:
        cmd = [sys.executable, "-m", "runner", "serve", "--port", "0", "--api-key-env", KEY_ENV]
        cmd += ["--model", f"{MODEL}=examples/tiny.toml", "--state-dir", str(state)]
        self.log = log
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


def test_sigkill_and_a_killed_server_resume_to_the_local_run(local_cli_run, tmp_path):
    env = _env(tmp_path)
    state, out, log = tmp_path / "state", tmp_path / "runs", tmp_path / "server.log"
    marker = out / "tiny" / "checkpoints" / "latest"
    train = [sys.executable, "-m", "runner"]
    server = _Server(state, env, log)
    try:
        # 1. the runner is killed with SIGKILL after the checkpoint of step 2
        r1 = subprocess.Popen(
            [*train, *_train_args(out, *_tinker_args(server.url))],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_for_step(r1, marker, 2)
        r1.send_signal(signal.SIGKILL)
        r1.wait(timeout=60)
        # 2. resumed; the server is killed mid-run: the runner stops with one error line
        r2 = subprocess.Popen(
            [*train, *_train_args(out, "--resume", *_tinker_args(server.url, timeout_s=8.0))],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_for_step(r2, marker, 4)
        server.kill()
        _, err = r2.communicate(timeout=300)
        assert r2.returncode == 2
        line = _one_error_line(err)
        assert "Tinker (http://127.0.0.1:" in line or "cannot reach the Tinker service" in line
        stopped_at = ckpt.latest_step(out / "tiny" / "checkpoints")
        assert 4 <= stopped_at < load_config(TINY).total_steps
    finally:
        server.stop()
    # 3. a new server on the same state directory (another port); the run resumes there
    server = _Server(state, env, log)
    try:
        r3 = subprocess.run(
            [*train, *_train_args(out, "--resume", *_tinker_args(server.url))],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r3.returncode == 0, r3.stderr[-3000:]
    finally:
        server.stop()
    _assert_same_run(out / "tiny", local_cli_run, state)
    _assert_tinker_manifests(out / "tiny")
    _assert_no_key(r3.stdout, r3.stderr, err, log.read_text(), dirs=(out, state))


# -- in process, with faults ----------------------------------------------------------------


def test_faults_on_the_wire_stop_cleanly_and_resume_to_the_local_run(
    local_cli_run, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = Faults()
    models = parse_model_flags([f"{MODEL}=examples/tiny.toml"])
    state, out = tmp_path / "state", tmp_path / "runs"
    config = ServeConfig(api_key=KEY, state_dir=str(state), long_poll_s=0.5)
    with ServerThread(config, models, middlewares=[faults.middleware]) as st:
        args = _train_args(out, *_tinker_args(st.url))
        # retried by the SDK (invisible to the run): try_again streaks, 429s, 503s; then a 410
        # on the 5th optimizer step's result stops the run after the checkpoint of step 4
        faults.add(
            "poll",
            path="/retrieve_future",
            request_type="ForwardBackward",
            reply=try_again,
            count=60,
        )
        faults.add("429", path="/optim_step", reply=status(429, **{"retry-after-ms": "5"}), count=2)
        faults.add(
            "503", path="/retrieve_future", request_type="Sample", reply=status(503), count=20
        )
        faults.add(
            "410",
            path="/retrieve_future",
            request_type="OptimStep",
            reply=status(410),
            skip=4,
            on_result=True,
        )
        capsys.readouterr()
        assert cli.main(args) == 2
        err1 = capsys.readouterr().err
        line = _one_error_line(err1)
        assert "optim_step" in line and "Promise expired" in line
        assert ckpt.latest_step(out / "tiny" / "checkpoints") == 4
        assert faults.hits["poll"] == 60 and faults.hits["429"] == 2 and faults.hits["410"] == 1
        # a user error on the first result after the resume stops it again, with its category
        faults.clear()
        faults.add(
            "user", path="/retrieve_future", request_type="ForwardBackward", reply=user_error
        )
        assert cli.main([*args, "--resume"]) == 2
        err2 = capsys.readouterr().err
        assert "(user error)" in _one_error_line(err2) and "injected: bad datum 0" in err2
        assert ckpt.latest_step(out / "tiny" / "checkpoints") == 4
        # no faults: the resume completes
        faults.clear()
        assert cli.main([*args, "--resume"]) == 0
        done = capsys.readouterr()
    _assert_same_run(out / "tiny", local_cli_run, state)
    _assert_tinker_manifests(out / "tiny")
    _assert_no_key(err1, err2, done.out, done.err, dirs=(out, state))
