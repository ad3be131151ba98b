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

import uuid
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

from runner import __main__ as cli  # noqa: E402
from runner import checkpoints as ckpt  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from tests.reference_run import tiny_reference_args  # noqa: E402
from tests.wire_helpers import (  # noqa: E402
    Faults,
    ServeProcess,
    assert_no_key,
    assert_same_metrics,
    assert_weights_close,
    final_weights,
    kill_the_runner_then_the_server,
    one_error_line,
    status,
    subprocess_env,
    try_again,
    user_error,
)

MODEL = "foldloss/tiny"
KEY_ENV = "FOLDLOSS_TEST_TINKER_MAIN_KEY"
KEY = f"tml-SENTINEL-{uuid.uuid4().hex}"


def _env(tmp_path: Path) -> dict[str, str]:
    return subprocess_env(tmp_path, {KEY_ENV: KEY})


def _train_args(out: Path, *extra: str) -> list[str]:
    """The reference run's arguments (`tests.reference_run`), into ``out``, then ``extra``."""
    return tiny_reference_args(out, *extra)


def _tinker_args(url: str, timeout_s: float = 60.0) -> list[str]:
    sets = [
        f"tinker.base_url='{url}'",
        f"tinker.base_model='{MODEL}'",
        f"tinker.api_key_env='{KEY_ENV}'",
        "tinker.lora_rank=8",
        f"tinker.request_timeout_s={timeout_s}",
    ]
    return ["--backend", "tinker", *(a for s in sets for a in ("--set", s))]


def _assert_same_run(got_dir, want_dir, got_state, want_state=None):
    assert_same_metrics(got_dir, want_dir)
    assert_weights_close(final_weights(got_dir, got_state), final_weights(want_dir, want_state))


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


# -- processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_cli_run(tiny_reference_run):
    """``--backend local`` in a child process with `_train_args`: conftest's session-wide
    reference run."""
    return tiny_reference_run[0]


def _server(state: Path, env: dict[str, str], log: Path) -> ServeProcess:
    return ServeProcess(state, env, log, models=[f"{MODEL}=examples/tiny.toml"], key_envs=[KEY_ENV])


def test_sigkill_and_a_killed_server_resume_to_the_local_run(local_cli_run, tmp_path):
    env = _env(tmp_path)
    state, out, log = tmp_path / "state", tmp_path / "runs", tmp_path / "server.log"

    def argv(url: str, phase: str) -> list[str]:
        if phase == "start":
            return _train_args(out, *_tinker_args(url))
        # issue #23 item 3: with a 300 s request timeout the killed server is found down in
        # seconds (it printed nothing for 4.5 minutes)
        return _train_args(out, "--resume", *_tinker_args(url, 300.0))

    def check_error(err: str, url: str) -> None:
        line = one_error_line(err, alone=False)
        assert (
            f"Tinker ({url}): " in line and f"the service at {url} refuses connections" in line
        ) or "cannot reach the Tinker service" in line

    err, r3 = kill_the_runner_then_the_server(
        out, env, lambda: _server(state, env, log), argv, check_error
    )
    _assert_same_run(out / "tiny", local_cli_run, state)
    _assert_tinker_manifests(out / "tiny")
    assert_no_key(KEY, r3.stdout, r3.stderr, err, log.read_text(), dirs=(out, state))


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
        line = one_error_line(err1)
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
        assert "(user error)" in one_error_line(err2) and "injected: bad datum 0" in err2
        assert ckpt.latest_step(out / "tiny" / "checkpoints") == 4
        # no faults: the resume completes
        faults.clear()
        assert cli.main([*args, "--resume"]) == 0
        done = capsys.readouterr()
    _assert_same_run(out / "tiny", local_cli_run, state)
    _assert_tinker_manifests(out / "tiny")
    assert_no_key(KEY, err1, err2, done.out, done.err, dirs=(out, state))
