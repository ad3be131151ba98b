"""The main job on ``--backend fireworks`` against the SDK fake equals ``--backend local``.

One local run of examples/tiny.toml; one Fireworks run of the same config split in three
processes' worth of work: steps 1-4 through the CLI on a new trainer job, a same-job resume for
step 5, then a cross-job resume on a new trainer for step 6 that promotes the final model and
deletes the trainer. Final parameters and per-step metrics match the local run; the API key (a
sentinel value) appears in no output file, log record, warning or console output.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest

import runner.fireworks._trainer as fw_trainer
from runner import __main__ as cli
from runner import checkpoints as ckpt
from runner.config import load_config
from runner.train import make_trainer, run
from tests.fireworks_fake import FakeFireworks, local_config_from

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
KEY_ENV = "FOLDLOSS_TEST_FIREWORKS_KEY"
SENTINEL = f"fw-SENTINEL-{uuid.uuid4().hex}"
FW = [
    "fireworks.base_model='accounts/fireworks/models/qwen3-8b'",
    "fireworks.training_shape_id='ts-qwen3-8b-policy'",
    f"fireworks.api_key_env='{KEY_ENV}'",
]


class FakeService:
    def __init__(self, job_id: str) -> None:
        self.trainer_job_id = job_id
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    cfg = load_config(TINY, [f"run.output_dir='{out}'"])
    trainer = make_trainer(cfg, out / "tiny")
    result = run(cfg, trainer=trainer, progress=False)
    return result, jax.tree.map(np.asarray, trainer.params)


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_fireworks_main_job_matches_local_and_never_leaks_the_key(
    local_run, tmp_path, monkeypatch, caplog, capsys, recwarn
):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(KEY_ENV, SENTINEL)
    cfg0 = load_config(TINY)
    world = FakeFireworks(tmp_path / "fake", local_config_from(cfg0))
    connected, services = [], []

    def fake_connect(fcfg, api_key):
        assert api_key == SENTINEL  # read from the environment variable named in the config
        client = world.connect(fcfg.trainer_job_id or None)
        connected.append((client.job.id, fcfg.trainer_job_id))
        services.append(FakeService(client.job.id))
        return services[-1], client, world.control, client.job.id

    monkeypatch.setattr(fw_trainer, "_connect", fake_connect)
    monkeypatch.setattr(fw_trainer, "probe", lambda url, **_: None)  # the fake has no socket
    monkeypatch.setattr(
        fw_trainer,
        "FireworksTrainer",
        functools.partial(fw_trainer.FireworksTrainer, settle_s=0.0, poll_interval_s=0.01),
    )
    out = tmp_path / "runs"

    # 1. steps 1-4 through the CLI, on a new trainer job
    args = ["train", "--config", str(TINY), "--backend", "fireworks", "--output-dir", str(out)]
    args += ["--no-progress", "--rl-steps", "1"]
    for s in FW:
        args += ["--set", s]
    assert cli.main(args) == 0
    job_a = connected[-1][0]
    run_dir = out / "tiny"
    assert ckpt.latest_step(run_dir / "checkpoints") == 4

    # 2. step 5: same-job resume (reattach to job A, load by name)
    base = [f"run.output_dir='{out}'", "run.backend='fireworks'", *FW]
    cfg = load_config(TINY, [*base, "rl.steps=2", f"fireworks.trainer_job_id='{job_a}'"])
    run(cfg, resume=True, progress=False)
    assert connected[-1] == (job_a, job_a)
    step4 = ckpt.read_manifest(run_dir / "checkpoints", 4)["resumable"]
    assert ("load", step4["checkpoint_name"]) in world.events

    # 3. step 6: cross-job resume on a new trainer, then promotion and deletion
    cfg = load_config(TINY, [*base, "rl.steps=3", "fireworks.output_model_id='tiny-final'"])
    result = run(cfg, resume=True, progress=False)
    job_c = connected[-1][0]
    assert job_c != job_a
    step5 = ckpt.read_manifest(run_dir / "checkpoints", 5)["resumable"]
    assert ("load", f"cross_job://{job_a}/{step5['checkpoint_name']}") in world.events
    final = json.loads((run_dir / "fireworks_final_model.json").read_text())
    assert [e for e in world.events if e[0] in ("promote", "delete")] == [
        ("promote", final["checkpoint_resource"]),
        ("delete", job_c),
    ]
    assert world.jobs[job_c].state == "JOB_STATE_DELETED"
    assert world.jobs[job_a].state == "JOB_STATE_RUNNING"  # only the final trainer is deleted
    assert final["output_model_id"] == "tiny-final" and final["step"] == 6
    assert all(s.closed == 1 for s in services)

    # final parameters and per-step metrics equal the local run's
    local_result, local_params = local_run
    fw_params = jax.tree.map(np.asarray, world.jobs[job_c].local.params)
    for a, b in zip(jax.tree.leaves(fw_params), jax.tree.leaves(local_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    fw_rec, local_rec = _records(run_dir), _records(local_result.run_dir)
    assert sorted(fw_rec) == sorted(local_rec) == list(range(7))
    for step, want in local_rec.items():
        got = fw_rec[step]
        for key in ("sft/nll", "reward", "loss", "grpo/loss", "echo_env/nll", "eval_reward"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (step, key)
        for key in ("passes/forwards", "passes/backwards", "plan/client", "tokens"):
            if key in want:
                assert got[key] == want[key], (step, key)
    assert len(result.metrics) == 7

    # every manifest records the provider identity, never the key
    for step in (2, 4, 5, 6):
        r = ckpt.read_manifest(run_dir / "checkpoints", step)["resumable"]
        assert r["identity_resolved"] and r["base_model"].endswith("qwen3-8b")
        assert r["source_trainer_job_id"] == (job_a if step <= 5 else job_c)

    # the sentinel key is nowhere: files, logs, warnings, console
    captured = capsys.readouterr()
    texts = [captured.out, captured.err]
    texts += [r.getMessage() for r in caplog.records]
    texts += [str(w.message) for w in recwarn]
    assert "run directory" in captured.out
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SENTINEL.encode() not in path.read_bytes(), path
    assert not [t for t in texts if SENTINEL in t]


def test_cli_without_the_api_key_fails_naming_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV, raising=False)
    args = ["train", "--config", str(TINY), "--backend", "fireworks", "--output-dir", str(tmp_path)]
    args += ["--no-progress"]
    for s in FW:
        args += ["--set", s]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"set the environment variable {KEY_ENV}" in err


def test_cli_rejects_a_vision_model_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, SENTINEL)
    args = ["train", "--config", str(TINY), "--backend", "fireworks", "--output-dir", str(tmp_path)]
    args += ["--set", "fireworks.base_model='accounts/fireworks/models/qwen2p5-vl-32b-instruct'"]
    for s in FW[1:]:
        args += ["--set", s]
    assert cli.main(args) == 2
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
    args = ["train", "--config", str(TINY), "--backend", "fireworks", "--output-dir", str(tmp_path)]
    args += ["--no-progress", "--set", f"fireworks.base_url='{url}'"]
    for s in FW:
        args += ["--set", s]
    t0 = time.monotonic()
    assert cli.main(args) == 2
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
