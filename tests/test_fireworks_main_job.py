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

import json
import logging
import socket
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from runner import __main__ as cli  # noqa: E402
from runner import checkpoints as ckpt  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from tests.wire_helpers import (  # noqa: E402
    TINY,
    Faults,
    ServeProcess,
    assert_no_key,
    assert_same_metrics,
    assert_weights_close,
    final_weights,
    kill_the_runner_then_the_server,
    no_control_plane_waits,
    one_error_line,
    promoted_weights,
    refused_port,
    status,
    subprocess_env,
    try_again,
    user_error,
)

BASE = "accounts/fireworks/models/qwen3-8b"
SHAPE = "accounts/fireworks/trainingShapes/ts-qwen3-8b-policy"
KEY_ENV = "FOLDLOSS_TEST_FIREWORKS_KEY"
TML_ENV = "FOLDLOSS_TEST_TINKER_KEY"
SENTINEL = f"fw-SENTINEL-{uuid.uuid4().hex}"
FW = [
    f"fireworks.base_model='{BASE}'",
    f"fireworks.training_shape_id='{SHAPE}'",
    f"fireworks.api_key_env='{KEY_ENV}'",
]


def _train_args(out: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--output-dir", str(out), "--no-progress", *extra]


def _fw_args(url: str, *sets: str) -> list[str]:
    args = ["--backend", "fireworks", "--set", f"fireworks.base_url='{url}'"]
    for s in (*FW, *sets):
        args += ["--set", s]
    return args


def _assert_same_run(got_dir: Path, state: Path, want_dir: Path) -> None:
    assert_same_metrics(got_dir, want_dir)
    assert_weights_close(promoted_weights(got_dir, state), final_weights(want_dir))


def _assert_fireworks_manifests(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    for step in range(2, ckpt.latest_step(root) + 1, 2):
        r = ckpt.read_manifest(root, step)["resumable"]
        assert r["checkpoint_kind"] == "fireworks_dcp" and r["identity_resolved"], step
        assert r["checkpoint_resource"].endswith("/checkpoints/" + r["checkpoint_name"])
        assert r["base_model"] == BASE and r["source_trainer_job_id"]


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
    no_control_plane_waits(monkeypatch)  # the control plane answers at once
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
        line = one_error_line(err1, alone=False)
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
        line = one_error_line(err2, alone=False)
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
    assert_no_key(SENTINEL, *texts, dirs=(out, state))


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


def test_an_unreachable_control_plane_fails_fast_in_one_line(tmp_path, monkeypatch, capsys):
    """Issue #12 row 8: offline, the SDK's retry loop ran 5 min, then a 101-line traceback."""
    monkeypatch.setenv(KEY_ENV, SENTINEL)
    url = f"http://127.0.0.1:{refused_port()}"
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
    # the tinker SDK's key beside ours: the server takes both
    keys = {KEY_ENV: SENTINEL, TML_ENV: f"tml-{uuid.uuid4().hex}"}
    return subprocess_env(tmp_path, keys, x64=True)


def _server(state: Path, env: dict[str, str], log: Path) -> ServeProcess:
    return ServeProcess(
        state,
        env,
        log,
        models=[f"{BASE}=examples/tiny.toml"],
        key_envs=[TML_ENV, KEY_ENV],
        extra=["--long-poll-s", "2"],
    )


def test_sigkill_and_a_killed_server_resume_to_the_local_run(local_run, tmp_path):
    env = _env(tmp_path)
    state, out, log = tmp_path / "state", tmp_path / "runs", tmp_path / "server.log"

    def argv(url: str, phase: str) -> list[str]:
        if phase == "start":  # then resumed on a new trainer job
            return _train_args(out, *_fw_args(url))
        if phase == "resume":
            return _train_args(out, "--resume", *_fw_args(url, "fireworks.request_timeout_s=20"))
        return _train_args(
            out, "--resume", *_fw_args(url, "fireworks.output_model_id='tiny-final'")
        )

    def check_error(err: str, url: str) -> None:
        line = one_error_line(err, alone=False)
        assert f"Fireworks ({url})" in line, line

    err, r3 = kill_the_runner_then_the_server(
        out, env, lambda: _server(state, env, log), argv, check_error
    )
    _assert_same_run(out / "tiny", state, local_run)
    _assert_fireworks_manifests(out / "tiny")
    assert_no_key(SENTINEL, r3.stdout, r3.stderr, err, log.read_text(), dirs=(out, state))
