"""What the tests of the hosted backends over loopback share.

The tests that run the real tinker / Fireworks SDKs against the local server
(tests/test_tinker.py, test_tinker_main_job.py, test_fireworks_main_job.py, test_hosted_tasks.py)
inject faults on the wire (`Faults` and its canned replies), start ``python -m runner serve`` as a
process (`ServeProcess`), read a run's metrics and final weights, and compare a hosted run with a
``--backend local`` one. Import it after ``pytest.importorskip("aiohttp")``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from runner import checkpoints as ckpt
from runner.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
#: The per-step metrics a hosted run must reproduce (relative 1e-6) ...
COMPARED = ("sft/nll", "reward", "loss", "grpo/loss", "echo_env/nll", "eval_reward")
#: ... and those it must reproduce exactly.
COUNTED = ("passes/forwards", "passes/backwards", "plan/client", "tokens")


# -- fault injection --------------------------------------------------------------------------


class Faults:
    """A server middleware answering matching requests with canned replies.

    `add` a rule: requests whose path ends with ``path`` (and, for ``retrieve_future``, of the
    SDK's ``X-Tinker-Request-Type``) are answered by ``reply(request)`` ``count`` times after
    ``skip`` matching requests passed through. With ``on_result``, a ``retrieve_future`` is
    served first and only a finished result counts (and is replaced): the fault lands on the
    ``skip + 1``-th result whatever the long polls in between. ``hits`` counts the faults.
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


def status(code, body=None, **headers):
    """A reply of HTTP ``code`` (a server error by default) with ``headers``."""

    def reply(request):
        return web.json_response(
            body or {"error": f"injected {code}", "category": "server"},
            status=code,
            headers=headers,
        )

    return reply


def user_error(request):
    return web.json_response({"error": "injected: bad datum 0", "category": "user"})


def refused_port() -> int:
    """A loopback port that refuses connections (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_control_plane_waits(monkeypatch) -> None:
    """Fireworks trainers that poll the control plane for a checkpoint's row without waiting: the
    local server's control plane answers at once."""
    import runner.fireworks._trainer as fw_trainer

    monkeypatch.setattr(
        fw_trainer,
        "FireworksTrainer",
        functools.partial(fw_trainer.FireworksTrainer, settle_s=0.0, poll_interval_s=0.01),
    )


# -- a run's outputs --------------------------------------------------------------------------


def records(run_dir: Path) -> dict[int, dict]:
    """``metrics.jsonl`` by step; a missing or repeated step fails."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"a step is missing or repeated: {steps}"
    return {r["step"]: r for r in recs}


def final_weights(run_dir: Path, state_dir: Path | None = None) -> dict[str, np.ndarray]:
    """The promotable snapshot of the run's latest checkpoint: a file of the run (the local
    backend), or with ``state_dir`` the ``tinker://`` sampler weights the server stored there."""
    from safetensors.numpy import load_file

    root = run_dir / "checkpoints"
    manifest = ckpt.read_manifest(root, ckpt.latest_step(root))
    path = manifest["promotable"]["snapshot_path"]
    if state_dir is None:
        return load_file(run_dir / path)
    from runner.serve._tinker import parse_tinker_path

    ref = parse_tinker_path(path)
    return load_file(
        state_dir / "runs" / ref.model_id / "trainer" / "sampler" / f"{ref.name}.safetensors"
    )


def promoted_weights(run_dir: Path, state: Path) -> dict[str, np.ndarray]:
    """The final model a ``--backend fireworks`` run promoted, as the server stored it."""
    from safetensors.numpy import load_file

    final = json.loads((run_dir / "fireworks_final_model.json").read_text())
    model_id = final["output_model_id"]
    assert final["model"]["name"].endswith(f"/models/{model_id}")
    return load_file(state / "fireworks" / "models" / f"{model_id}.safetensors")


def assert_same_metrics(
    got_dir: Path,
    want_dir: Path,
    compared: Sequence[str] = COMPARED,
    counted: Sequence[str] = COUNTED,
) -> None:
    """Both runs have the same steps, and at every step the ``compared`` metrics agree within
    relative 1e-6 or absolute 1e-7 and the ``counted`` ones exactly (where the reference has
    them). The absolute part is float32 rounding of O(1) summands: a GRPO loss whose group
    terms cancel to 0.0018 differed by 1.5e-8 between a hosted and a local run whose total
    loss agreed to 9e-8 relative."""
    got, want = records(got_dir), records(want_dir)
    assert sorted(got) == sorted(want) == list(range(len(want)))
    for step, w in want.items():
        g = got[step]
        for key in compared:
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-7), (step, key)
        # A hosted step may run as one server pass where the reference ran the fused client
        # path (docs/server-side-losses.md): 1F + 1B per micro-batch instead of 2F + 1B.
        server = g.get("plan/server") == 1.0 and w.get("plan/client") == 1.0
        if server:
            assert g["passes/forwards"] == g["passes/backwards"] == w["passes/backwards"], step
        for key in counted:
            if key in w and not (server and key in ("plan/client", "passes/forwards")):
                assert g[key] == w[key], (step, key)


def assert_weights_close(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> None:
    """The same tensors, agreeing within 1e-6."""
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)


def assert_no_key(key: str, *texts: str, dirs: tuple[Path, ...] = ()) -> None:
    """``key`` appears in none of ``texts`` and in no file under ``dirs``."""
    for text in texts:
        assert key not in text
    for d in dirs:
        for path in d.rglob("*"):
            if path.is_file():
                assert key.encode() not in path.read_bytes(), path


def one_error_line(stderr: str, *, alone: bool = True) -> str:
    """The run's one ``error:`` line, without a traceback: the only line besides the runner's
    "waiting for" notes, or with ``alone=False`` the last (the SDK's own log warnings may
    precede it)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    # a slow call's progress notes (runner._net: "waiting for ... s so far") are not errors
    lines = [line for line in lines if not line.startswith("waiting for ")]
    assert "Traceback" not in stderr, stderr[-3000:]
    if alone:
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
        return lines[0]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
    return errors[0]


# -- processes --------------------------------------------------------------------------------


def subprocess_env(tmp_path: Path, keys: Mapping[str, str], *, x64: bool = False) -> dict[str, str]:
    """The environment of a ``python -m runner`` child: the keys (variable → value), telemetry
    off, ``JAX_ENABLE_X64`` with ``x64``, and a persistent compilation cache shared by the
    module's tests."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TINKER_TELEMETRY="0")
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    env.update(keys)
    cache = "jax-cache-x64" if x64 else "jax-cache"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path.parent / cache))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


class ServeProcess:
    """``python -m runner serve`` on an ephemeral port (stopped by the test).

    Args:
      state: the ``--state-dir``.
      env: the child's environment (`subprocess_env`), holding the keys.
      log: the file its stderr is appended to.
      models: the ``--model NAME=CONFIG.toml`` flags.
      key_envs: the ``--api-key-env`` variables.
      extra: further flags.
    """

    def __init__(
        self,
        state: Path,
        env: dict[str, str],
        log: Path,
        *,
        models: Sequence[str],
        key_envs: Sequence[str],
        extra: Sequence[str] = (),
    ) -> None:
        cmd = [sys.executable, "-m", "runner", "serve", "--port", "0"]
        cmd += ["--api-key-env", ",".join(key_envs)]
        for model in models:
            cmd += ["--model", model]
        cmd += ["--state-dir", str(state), *extra]
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


def wait_for_step(proc, marker: Path, step: int, timeout_s: float = 600) -> None:
    """Waits until the run's ``latest`` marker reaches ``step``; fails if the run ends first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = marker.read_text().strip() if marker.exists() else ""
        if text and int(text) >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {step}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no checkpoint of step {step} within {timeout_s} s")


def kill_the_runner_then_the_server(
    out: Path,
    env: dict[str, str],
    serve: Callable[[], ServeProcess],
    argv: Callable[[str, str], list[str]],
    check_error: Callable[[str, str], None],
) -> tuple[str, subprocess.CompletedProcess]:
    """examples/tiny.toml's run (``out/tiny``) through two kills, to the end.

    The runner is killed with SIGKILL after the checkpoint of step 2 and resumed; the server is
    killed after the checkpoint of step 4, and the runner stops (exit code 2; its stderr goes to
    ``check_error(stderr, url)``) with steps left; a new server on the same state directory, at
    another port, serves the last resume to the end.

    Args:
      out: the runs' output directory.
      env: the processes' environment (`subprocess_env`).
      serve: starts a server (`ServeProcess`) on the state directory.
      argv: the runner's arguments after ``python -m runner`` for the server at ``url`` and the
        phase: ``"start"``, ``"resume"`` (the one the server's kill stops: a short request
        timeout) or ``"finish"``.
      check_error: asserts on the stopped runner's stderr.

    Returns:
      The stopped runner's stderr and the last run's completed process.
    """
    marker = out / "tiny" / "checkpoints" / "latest"
    train = [sys.executable, "-m", "runner"]
    server = serve()
    try:
        # 1. the runner is killed with SIGKILL after the checkpoint of step 2
        r1 = subprocess.Popen(
            [*train, *argv(server.url, "start")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for_step(r1, marker, 2)
        r1.send_signal(signal.SIGKILL)
        r1.wait(timeout=60)
        # 2. resumed; the server is killed mid-run: the runner stops with one error line
        r2 = subprocess.Popen(
            [*train, *argv(server.url, "resume")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for_step(r2, marker, 4)
        server.kill()
        _, err = r2.communicate(timeout=300)
        assert r2.returncode == 2, err[-3000:]
        check_error(err, server.url)
        stopped_at = ckpt.latest_step(out / "tiny" / "checkpoints")
        assert 4 <= stopped_at < load_config(TINY).total_steps
    finally:
        server.stop()
    # 3. a new server on the same state directory (another port); the run resumes there
    server = serve()
    try:
        r3 = subprocess.run(
            [*train, *argv(server.url, "finish")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r3.returncode == 0, r3.stderr[-3000:]
    finally:
        server.stop()
    return err, r3
