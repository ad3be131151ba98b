"""The main job end to end on a tiny config: outputs, kill-and-resume equivalence, fail-closed resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runner import checkpoints as ckpt
from runner.config import load_config
from tests.reference_run import tiny_reference_args

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    # Share compiled executables between the subprocess runs of one test session.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path.parent / "jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def _cmd(out: Path, *extra: str) -> list[str]:
    """The reference run's command (`tests.reference_run`), into ``out``, then ``extra``."""
    return [sys.executable, "-m", "runner", *tiny_reference_args(out, *extra)]


def _final_weights(run_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    step = ckpt.latest_step(run_dir / "checkpoints")
    manifest = ckpt.read_manifest(run_dir / "checkpoints", step)
    return load_file(run_dir / manifest["promotable"]["snapshot_path"])


@pytest.fixture(scope="module")
def uninterrupted(tiny_reference_run):
    """The uninterrupted run of `_cmd`: conftest's session-wide reference run."""
    return tiny_reference_run


def test_end_to_end_outputs_are_well_formed(uninterrupted):
    run_dir, stdout = uninterrupted
    cfg = load_config(TINY)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(0, cfg.total_steps + 1))
    sft = [r for r in records if r["phase"] == "sft"]
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(sft) == cfg.sft.steps and len(rl) == cfg.rl.steps
    for r in sft:
        assert (
            np.isfinite(r["sft/nll"]) and r["passes/forwards"] == 1 and r["passes/backwards"] == 1
        )
    for r in rl:
        for key in (
            "reward",
            "grpo/loss",
            "echo_env/nll",
            "passes/forwards",
            "passes/backwards",
            "tokens_per_s",
            "optim/grad_norm",
        ):
            assert key in r and np.isfinite(r[key]), key
        assert 0.0 <= r["reward"] <= 1.0
        # ECHO on: one fused client pass = 1 forward + 1 forward/backward.
        assert r["plan/client"] == 1.0 and (r["passes/forwards"], r["passes/backwards"]) == (2, 1)
    assert sft[-1]["sft/nll"] < sft[0]["sft/nll"]
    png = (run_dir / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert ckpt.latest_step(run_dir / "checkpoints") == cfg.total_steps
    for step in range(1, cfg.total_steps + 1):
        m = ckpt.read_manifest(run_dir / "checkpoints", step)
        assert m["run_state"]["step"] == step and m["includes_optimizer_state"]
        # Relative to the run directory (issue #12 rows 2-3: a moved run finds its own files).
        assert not Path(m["resumable"]["provider_path"]).is_absolute()
        assert (run_dir / m["resumable"]["provider_path"]).exists()
        assert (run_dir / m["promotable"]["snapshot_path"]).exists()
        assert m["resumable"]["provider_path"] != m["promotable"]["snapshot_path"]
    assert "eval reward" in stdout and "run directory" in stdout
    # Without a terminal, a progress line per step (runner.progress "lines"; 6 steps: every 1).
    progress = [line for line in stdout.splitlines() if line.startswith("step ")]
    total = cfg.total_steps
    assert [line.split("  ")[:2] for line in progress] == [
        [f"step {s}/{total}", "sft" if s <= cfg.sft.steps else "rl"] for s in range(1, total + 1)
    ]
    assert "nll " in progress[0] and "reward " in progress[-1] and "eval " in progress[-1]


def test_kill_and_resume_matches_the_uninterrupted_run(uninterrupted, tmp_path):
    run_dir, _ = uninterrupted
    cfg = load_config(TINY)
    kill_at = cfg.sft.steps + 1  # inside RL: sampling, rollouts and ECHO all resume exactly
    proc = subprocess.Popen(
        _cmd(tmp_path), env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    marker = tmp_path / "tiny" / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline:
        if marker.exists() and marker.read_text().strip() and int(marker.read_text()) >= kill_at:
            break
        if proc.poll() is not None:
            pytest.fail(f"run ended before it could be killed: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = ckpt.latest_step(tmp_path / "tiny" / "checkpoints")
    assert killed_at < cfg.total_steps, "the run finished before the kill"
    resumed = subprocess.run(
        _cmd(tmp_path, "--resume"), env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r["step"] for r in records]
    assert (
        steps == sorted(set(steps)) == list(range(0, cfg.total_steps + 1))
    )  # none twice or skipped
    a, b = _final_weights(run_dir), _final_weights(tmp_path / "tiny")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-6, atol=1e-7, err_msg=key)
    ref = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r0, r1 in zip(ref, records, strict=True):
        if r0["phase"] == "rl":
            assert r0["reward"] == r1["reward"]  # the same samples, step for step


def changed_args(tmp_path):
    return [f'run.output_dir="{tmp_path}"', "rl.clip_high=0.5"]


def test_resume_fails_closed(tmp_path, uninterrupted):
    from runner.train import run

    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"'])
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint"):
        run(cfg, resume=True, progress=False)
    # A copy of the finished run's checkpoints, then break them one way at a time.
    import shutil

    shutil.copytree(uninterrupted[0], tmp_path / "tiny")
    root = tmp_path / "tiny" / "checkpoints"
    step = ckpt.latest_step(root)
    manifest_path = ckpt.step_dir(root, step) / "manifest.json"
    good = json.loads(manifest_path.read_text())

    broken = dict(good, resumable={"checkpoint_name": "x"})  # no resolvable path
    manifest_path.write_text(json.dumps(broken))
    with pytest.raises(ckpt.CheckpointError, match="no resolved identity"):
        run(cfg, resume=True, progress=False)

    manifest_path.write_text(json.dumps(dict(good, resumable={})))
    with pytest.raises(ckpt.CheckpointError, match="no resolved identity"):
        run(cfg, resume=True, progress=False)

    manifest_path.write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="not valid JSON"):
        run(cfg, resume=True, progress=False)

    manifest_path.write_text(json.dumps(dict(good, format_version=7)))
    with pytest.raises(ckpt.CheckpointError, match="format_version"):
        run(cfg, resume=True, progress=False)

    manifest_path.write_text(json.dumps(good))
    changed = load_config(TINY, [f'run.output_dir="{tmp_path}"', "rl.clip_high=0.5"])
    with pytest.raises(ckpt.CheckpointError, match="config differs"):
        run(changed, resume=True, progress=False)
    # issue #23 item 8: the refusal names the keys that differ
    old = load_config(TINY)
    changed = load_config(TINY, [*changed_args(tmp_path), "sft.learning_rate=0.5"])
    with pytest.raises(ckpt.CheckpointError) as exc:
        run(changed, resume=True, progress=False)
    assert (
        f"[rl].clip_high = {old.rl.clip_high!r} -> 0.5, [sft].learning_rate = "
        f"{old.sft.learning_rate!r} -> 0.5); only step counts" in str(exc.value)
    )
    # an emptied or deleted metrics.jsonl: the history would be lost silently
    metrics = tmp_path / "tiny" / "metrics.jsonl"
    history = metrics.read_text()
    metrics.write_text("")
    with pytest.raises(ckpt.CheckpointError, match=rf"step {step} but .*metrics.jsonl has no rec"):
        run(cfg, resume=True, progress=False)
    metrics.unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"metrics.jsonl is missing: the run's metrics"):
        run(cfg, resume=True, progress=False)
    metrics.write_text(history)

    (root / "latest").write_text("banana")
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        run(cfg, resume=True, progress=False)

    (root / "latest").write_text("1\n")  # stale marker: later step directories exist
    with pytest.raises(ckpt.CheckpointError, match="more than 2 steps past the latest marker"):
        run(cfg, resume=True, progress=False)

    (root / "latest").write_text(f"{step}\n")
    manifest_path.unlink()
    with pytest.raises(ckpt.CheckpointError, match="manifest not found"):
        run(cfg, resume=True, progress=False)

    with pytest.raises(ValueError, match="already holds a run"):
        run(cfg, resume=False, progress=False)


def test_cli_reports_config_errors(tmp_path):
    env = _env(tmp_path)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "train",
            "--config",
            str(TINY),
            "--set",
            "rl.group_size=1",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "[rl].group_size must be >= 2" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "runner", "train", "--config", str(TINY), "--set", "rl.nope=1"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown key [rl].nope" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "runner", "train", "--config", str(tmp_path / "x.toml")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "config file not found" in bad.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rl.clip_low=1.5"], r"config \[rl\]: grpo: clip_low must be < 1"),
        (["rl.env_coef=-1"], r"echo_env: coef must be >= 0"),
        (['rl.reduction="mean"'], "unknown reduction 'mean'"),
        (["model.d_model=31"], "divisible by"),
        (['run.backend="gpu"'], "backend must be"),
        (['run.name="a/b"'], r"\[run\].name must be one path component"),
        (['run.name=".."'], r"\[run\].name must be one path component .*got '\.\.'"),
        (['run.name="."'], r"\[run\].name must be one path component .*got '\.'"),
        (["sft.steps=0", "rl.steps=0"], "must be > 0"),
        (["optim.beta2=1.0"], r"AdamParams.beta2 must be in"),
        (["sft.batch_size=true"], "must be an integer"),
        (["nosuch.key=1"], r"unknown section \[nosuch\]"),
    ],
)
def test_config_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(TINY, overrides)


def test_env_coef_zero_is_plain_grpo_on_the_builtin_kernel(tmp_path):
    from runner.train import run

    cfg = load_config(
        TINY,
        [
            f'run.output_dir="{tmp_path}"',
            "rl.env_coef=0.0",
            "sft.steps=1",
            "rl.steps=1",
            "checkpoint.interval=0",
        ],
    )
    result = run(cfg, progress=False)
    rl = [r for r in result.metrics if r.get("phase") == "rl"]
    assert rl and rl[0]["plan/builtin"] == 1.0
    assert (rl[0]["passes/forwards"], rl[0]["passes/backwards"]) == (1, 1)
    assert rl[0]["loss"] == pytest.approx(rl[0]["server_loss"], rel=1e-4, abs=1e-6)


def test_default_toml_lists_every_knob_with_its_default():
    import dataclasses
    import tomllib

    from runner.config import Config

    data = tomllib.loads((ROOT / "examples" / "default.toml").read_text())
    defaults = Config()
    for section in dataclasses.fields(Config):
        values = data[section.name]
        for f in dataclasses.fields(getattr(defaults, section.name)):
            assert f.name in values, f"[{section.name}].{f.name} missing from default.toml"
            assert values[f.name] == getattr(getattr(defaults, section.name), f.name), (
                f"[{section.name}].{f.name}: default.toml and runner.config disagree"
            )


def test_run_closes_the_trainer_it_built_even_on_error(tmp_path, monkeypatch):
    import runner.train as train_mod

    closed = []
    real_make = train_mod.make_trainer

    def make(cfg, run_dir):
        trainer = real_make(cfg, run_dir)
        trainer.close = lambda: closed.append(True)
        return trainer

    monkeypatch.setattr(train_mod, "make_trainer", make)
    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', "sft.steps=1", "rl.steps=0"])

    def boom(step, record):
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        train_mod.run(cfg, progress=False, on_step=boom)
    assert closed == [True]


def test_resume_refuses_step_counts_that_rewrite_history_and_recovers_a_torn_log(
    tmp_path, uninterrupted
):
    """Issue #12 rows 9, 10 and 13."""
    import shutil

    from runner.train import run

    shutil.copytree(uninterrupted[0], tmp_path / "tiny")
    base = [f'run.output_dir="{tmp_path}"']
    step = ckpt.latest_step(tmp_path / "tiny" / "checkpoints")  # 6: RL began at step 4
    with pytest.raises(ckpt.CheckpointError, match=r"RL had begun .* \[sft\].steps = 6 would"):
        run(load_config(TINY, [*base, "sft.steps=6"]), resume=True, progress=False)
    with pytest.raises(ckpt.CheckpointError, match=f"the run is at step {step}, but .* = 4"):
        run(load_config(TINY, [*base, "rl.steps=1"]), resume=True, progress=False)

    log = tmp_path / "tiny" / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    with pytest.raises(ckpt.CheckpointError, match=r"metrics.jsonl line 3 is not valid JSON"):
        run(load_config(TINY, [*base, "rl.steps=4"]), resume=True, progress=False)
    # A torn line after the checkpoint (an interruption mid-write) is dropped, not an error.
    log.write_text("\n".join(lines) + '\n{"step": 7, "pha')
    result = run(load_config(TINY, [*base, "rl.steps=4"]), resume=True, progress=False)
    assert [r["step"] for r in result.metrics] == list(range(step + 2))


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.num_microbatches=1000", r"num_microbatches \(1000\) exceeds the 8 sequences"),
        ("rl.temperature=1e-30", r"temperature must be in \[0.001, 1000\]"),
        # issue #23 item 5: these ran all of SFT, were ignored or were misreported
        ("rl.mode=builtin", r"\[rl\].mode = 'builtin': builtin path requested but the term"),
        ("rl.loss_kwargs={coef=1.0}", r"\[rl\].loss_kwargs \['coef'\] needs \[rl\].loss"),
        ("rl.learning_rate=inf", r"\[rl\].learning_rate must be a finite number > 0, got inf"),
        ("sft.learning_rate=nan", r"\[sft\].learning_rate must be a finite number > 0, got nan"),
    ],
)
def test_values_that_fail_late_are_refused_before_any_work(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(TINY, [override])


def test_a_model_vocabulary_larger_than_the_tokenizers_is_refused_at_config_load(tmp_path):
    """Issue #23 item 5: sampled ids past the tokenizer's vocabulary failed 9 s in."""
    from test_hf_loading import base_config

    from runner.env.tokenizer import VOCAB_SIZE

    (tmp_path / "config.json").write_text(json.dumps(base_config(vocab_size=VOCAB_SIZE + 11)))
    message = rf"vocab_size {VOCAB_SIZE + 11} is larger than the tokenizer's {VOCAB_SIZE}"
    with pytest.raises(ValueError, match=r"\[model\].path: the checkpoint's " + message):
        load_config(TINY, [f'model.path="{tmp_path}"'])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.max_seq_len=12"],
            r"max_seq_len = 12 is shorter than SFT demonstrations: step \d+, example \d+ needs "
            r"\d+ model-input tokens",
        ),
        (
            ["model.max_seq_len=7", "sft.steps=0"],
            r"max_seq_len = 7 leaves no room for an action after the task's longest prompt",
        ),
    ],
)
def test_max_seq_len_is_checked_against_the_task_before_any_work(tmp_path, overrides, message):
    """Issue #12 item 6: a model context too short for the SFT demonstrations failed at step 1,
    after the step-0 evaluation had written the run directory."""
    from runner.train import run

    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', *overrides])
    with pytest.raises(ValueError, match=message):
        run(cfg, progress=False)
    assert not (tmp_path / "tiny").exists()


def test_two_processes_on_one_run_directory(tmp_path):
    """Issue #12 row 5: two processes with the same --name both ran and interleaved their steps;
    now the second fails at once naming the first's pid, and the first finishes normally."""
    import os
    import subprocess
    import sys
    import time

    from runner._lock import run_lock
    from runner.train import run

    cmd = [sys.executable, "-m", "runner", "train", "--config", str(TINY), "--name", "race",
           "--output-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    first = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    lock = tmp_path / "race" / ".lock"
    try:
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        second = subprocess.run(cmd, capture_output=True, env=env, text=True, timeout=120)
        assert second.returncode == 2
        assert f"is in use by another process (pid {first.pid})" in second.stderr
        assert second.stderr.count("\n") == 1 and second.stderr.startswith("error: ")
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    steps = [json.loads(line)["step"] for line in (tmp_path / "race" / "metrics.jsonl").open()]
    assert steps == list(range(7))
    # The lock is released with its process; in-process, a held lock refuses a run at once.
    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', 'run.name="held"'])
    (tmp_path / "held").mkdir()
    with run_lock(tmp_path / "held"), pytest.raises(ValueError, match=f"pid {os.getpid()}"):
        run(cfg, progress=False)


def test_a_moved_or_copied_run_resumes_from_its_own_files(tmp_path, uninterrupted):
    """Issue #12 rows 2 and 3: a moved run failed with FileNotFoundError; a copy whose original
    was re-created by another run trained on the other run's weights (absolute manifest paths)."""
    import shutil

    from runner.train import run

    shutil.copytree(uninterrupted[0], tmp_path / "first")
    (tmp_path / "first").rename(tmp_path / "moved")  # mv runs/first runs/moved
    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', 'run.name="moved"', "rl.steps=4"])
    result = run(cfg, resume=True, progress=False)
    assert result.metrics[-1]["step"] == 7
    # An old-style manifest with an absolute path into another run directory fails closed.
    root = tmp_path / "moved" / "checkpoints"
    path = ckpt.step_dir(root, 7) / "manifest.json"
    manifest = json.loads(path.read_text())
    other = tmp_path / "other" / manifest["resumable"]["provider_path"]
    manifest["resumable"]["provider_path"] = str(other)
    path.write_text(json.dumps(manifest))
    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', 'run.name="moved"', "rl.steps=5"])
    with pytest.raises(ckpt.CheckpointError, match="outside this run directory"):
        run(cfg, resume=True, progress=False)


def test_a_run_stopped_before_its_first_checkpoint_can_be_restarted(tmp_path, uninterrupted):
    """Issue #12 row 14: --resume said "no checkpoint", a plain rerun "already holds a run"."""
    import shutil

    from runner.train import run

    base = [f'run.output_dir="{tmp_path}"']
    cfg = load_config(TINY, base)
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "phase": "eval"}\n{"step": 1, "ph')
    (run_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="stopped before its first checkpoint; pass --restart"):
        run(cfg, progress=False)
    with pytest.raises(ValueError, match="exclude each other"):
        run(cfg, resume=True, restart=True, progress=False)
    result = run(cfg, restart=True, progress=False)
    assert [r["step"] for r in result.metrics] == list(range(7))
    # A run with a checkpoint is never restarted: that is what --resume is for.
    shutil.copytree(uninterrupted[0], tmp_path / "done")
    done = load_config(TINY, [*base, 'run.name="done"'])
    with pytest.raises(ckpt.CheckpointError, match="has a checkpoint at step 6; --resume"):
        run(done, restart=True, progress=False)
    with pytest.raises(ValueError, match="pass --resume to continue it"):
        run(done, progress=False)


def _flip(path: Path, offset: int, n: int = 1) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_flipped_bytes_in_checkpoint_files_fail_closed_naming_the_file(tmp_path, uninterrupted):
    """Issue #12 rows 1 and 6: 16 (or 1) flipped bytes in the orbax data loaded silently; 4 in a
    sampler file too (max abs diff 163)."""
    from runner.train import make_trainer, run

    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', "rl.steps=4"])
    run_dir = tmp_path / "tiny"
    for n in (16, 1):
        _copy_run(uninterrupted[0], run_dir)
        m = ckpt.read_manifest(run_dir / "checkpoints", 6)
        files = sorted(m["resumable"]["sha256"], key=lambda k: -(run_dir / k).stat().st_size)
        data_file = run_dir / files[0]  # the largest: orbax's array data
        assert "tree" in data_file.parts
        _flip(data_file, data_file.stat().st_size // 2, n)
        with pytest.raises(ckpt.CheckpointError, match=f"file {data_file} is corrupted"):
            run(cfg, resume=True, progress=False)
        # The backend checks its own files too, for a direct load_state without a manifest.
        trainer = make_trainer(cfg, tmp_path / "probe")
        with pytest.raises(ValueError, match=f"file {data_file} is corrupted"):
            trainer.load_state(str(run_dir / m["resumable"]["provider_path"]))
        import shutil

        shutil.rmtree(run_dir)
    # A sampler file (the promotable weights; the same loader reads the KL reference).
    _copy_run(uninterrupted[0], run_dir)
    m = ckpt.read_manifest(run_dir / "checkpoints", 6)
    sampler = run_dir / m["promotable"]["snapshot_path"]
    assert m["promotable"]["sha256"] == {m["promotable"]["snapshot_path"]: ANY_SHA}
    _flip(sampler, sampler.stat().st_size - 64, 4)
    trainer = make_trainer(cfg, tmp_path / "probe")
    with pytest.raises(ValueError, match=f"sampler weights {sampler} are corrupted"):
        trainer.load_weights(str(sampler))
    # ... and the resume from that checkpoint fails closed before any work (#23: it resumed).
    with pytest.raises(ckpt.CheckpointError) as err:
        run(cfg, resume=True, progress=False)
    text = str(err.value)
    assert text.startswith("--resume: checkpoint step 6: promotable weights ")
    assert f"file {sampler} is corrupted" in text and "promotable weights are damaged" in text
    # An untouched copy still resumes.
    import shutil

    shutil.rmtree(run_dir)
    _copy_run(uninterrupted[0], run_dir)
    assert run(cfg, resume=True, progress=False).metrics[-1]["step"] == 7


class _AnySha:
    def __eq__(self, other) -> bool:
        return isinstance(other, str) and other.startswith("sha256:") and len(other) == 71


ANY_SHA = _AnySha()


def test_an_edited_or_foreign_manifest_fails_closed(tmp_path, uninterrupted):
    """Issue #12 rows 2 and 4: the provider path edited to an older step, meta.json's step set
    to 99, or another run's checkpoint in this directory were all accepted."""
    from runner.train import RUN_FILE, run

    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', "rl.steps=4"])
    run_dir = _copy_run(uninterrupted[0], tmp_path / "tiny")
    root = run_dir / "checkpoints"
    path = ckpt.step_dir(root, 6) / "manifest.json"
    good = json.loads(path.read_text())
    older = json.loads((ckpt.step_dir(root, 4) / "manifest.json").read_text())

    # The provider path pointed at step 4's state: its files are not the recorded ones.
    edited = json.loads(path.read_text())
    edited["resumable"]["provider_path"] = older["resumable"]["provider_path"]
    path.write_text(json.dumps(edited))
    with pytest.raises(ckpt.CheckpointError, match="name a file outside it"):
        run(cfg, resume=True, progress=False)
    # ... and with step 4's digests copied along: not the state saved as step 6.
    edited["resumable"]["sha256"] = older["resumable"]["sha256"]
    path.write_text(json.dumps(edited))
    with pytest.raises(ckpt.CheckpointError, match="is not the state saved as"):
        run(cfg, resume=True, progress=False)
    path.write_text(json.dumps(good))

    # meta.json's step set to 99.
    meta = next((run_dir / good["resumable"]["provider_path"]).glob("v-*/meta.json"))
    original = meta.read_text()
    meta.write_text(original.replace('"step": ', '"step": 99, "was": '))
    with pytest.raises(ckpt.CheckpointError, match=f"file {meta} is corrupted"):
        run(cfg, resume=True, progress=False)
    meta.write_text(original)

    # Another run's identity: this directory's run.json names a different run.
    ident = (run_dir / RUN_FILE).read_text()
    (run_dir / RUN_FILE).write_text(json.dumps({"run_id": "0" * 32}))
    with pytest.raises(ckpt.CheckpointError, match="belongs to run"):
        run(cfg, resume=True, progress=False)
    (run_dir / RUN_FILE).unlink()
    with pytest.raises(ckpt.CheckpointError, match="identity file .* is missing or corrupt"):
        run(cfg, resume=True, progress=False)
    (run_dir / RUN_FILE).write_text(ident)

    # The manifest's digests removed: a local reference without digests is not trusted.
    del edited["resumable"]["sha256"]
    edited["resumable"]["provider_path"] = good["resumable"]["provider_path"]
    path.write_text(json.dumps(edited))
    with pytest.raises(ckpt.CheckpointError, match="no file digests recorded"):
        run(cfg, resume=True, progress=False)
    path.write_text(json.dumps(good))
    assert run(cfg, resume=True, progress=False).metrics[-1]["step"] == 7


def test_a_corrupted_kl_reference_fails_closed(tmp_path):
    from runner.train import REFERENCE_FILE, run

    base = [f'run.output_dir="{tmp_path}"', "rl.kl_coef=0.1", "checkpoint.interval=1"]
    run(load_config(TINY, [*base, "rl.steps=2"]), progress=False)
    run_dir = tmp_path / "tiny"
    m = ckpt.read_manifest(run_dir / "checkpoints", 5)
    assert m["run_state"]["reference"]["sha256"] == {REFERENCE_FILE: ANY_SHA}
    ref = run_dir / REFERENCE_FILE
    pristine = ref.read_bytes()
    _flip(ref, ref.stat().st_size - 16, 4)
    cfg = load_config(TINY, [*base, "rl.steps=3"])
    with pytest.raises(ckpt.CheckpointError, match=f"KL reference: file {ref} is corrupted"):
        run(cfg, resume=True, progress=False)
    ref.write_bytes(pristine)
    assert run(cfg, resume=True, progress=False).metrics[-1]["step"] == 6


def test_fail_closed_states_end_in_one_error_line(tmp_path, uninterrupted, capsys):
    """Issue #12 row 15: these were Python tracebacks (AttributeError, PermissionError, ...)."""
    import shutil

    from runner import __main__ as cli

    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path), "--no-progress"]
    args += ["--resume", "--rl-steps", "4"]
    run_dir = _copy_run(uninterrupted[0], tmp_path / "tiny")
    root = run_dir / "checkpoints"
    m = ckpt.read_manifest(root, 6)

    def one_line(match: str) -> None:
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert match in err[0], err[0]

    state = run_dir / m["resumable"]["provider_path"]
    shutil.move(state, tmp_path / "aside")  # the state directory missing
    one_line(f"resumable state {m['resumable']['provider_path']}: file")
    shutil.move(tmp_path / "aside", state)

    manifest = ckpt.step_dir(root, 6) / "manifest.json"
    text = manifest.read_text()
    manifest.write_text("[1, 2]")  # a JSON list
    one_line("is not a JSON object (got list)")
    manifest.write_text(text)

    (root / "latest").rename(tmp_path / "latest")
    (root / "latest").mkdir()  # `latest` a directory
    one_line(f"{root / 'latest'} is unreadable")
    (root / "latest").rmdir()
    (tmp_path / "latest").rename(root / "latest")

    if os.geteuid() != 0:  # root ignores permissions
        fresh = ["train", "--config", str(TINY), "--output-dir", str(tmp_path / "ro")]
        (tmp_path / "ro").mkdir(mode=0o555)
        assert cli.main([*fresh, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Permission denied" in err[0] and str(tmp_path / "ro") in err[0]


def test_sigint_stops_cleanly_naming_the_checkpoint_to_resume(tmp_path):
    proc = subprocess.Popen(
        _cmd(tmp_path), env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    marker = tmp_path / "tiny" / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline and not (marker.exists() and marker.read_text().strip()):
        if proc.poll() is not None:
            pytest.fail(f"run ended before SIGINT: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    first = int(marker.read_text())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    lines = err.strip().splitlines()
    # SIGINT after step 1 of 6: the run stops after the step it is in, never later, whatever
    # the main thread was doing (it once became an ImportError traceback, or was lost).
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert lines[0] == "interrupt: stopping after the current step (Ctrl-C again to stop at once)"
    assert len(lines) == 2, err[-2000:]
    step = ckpt.latest_step(tmp_path / "tiny" / "checkpoints")
    assert first <= step <= first + 1
    assert lines[1].startswith("error: interrupted; --resume continues from the checkpoint of ")
    assert f"step {step} " in lines[1]


def test_a_first_sigint_stops_at_the_next_step_a_second_at_once(capfd):
    from runner.__main__ import _StopAfterStep

    before = signal.getsignal(signal.SIGINT)
    with _StopAfterStep() as stop:
        stop.check()  # nothing requested yet
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in the main thread between bytecodes
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            stop.check()
        with pytest.raises(KeyboardInterrupt):  # the second one does not wait
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before
    assert capfd.readouterr().err == _StopAfterStep.NOTICE.decode()


def test_the_identity_hashes_only_non_default_settings_so_a_new_key_keeps_runs_resumable():
    from runner.config import Config, identity_of

    cfg = load_config(TINY, [])
    settings = cfg.to_dict()
    defaults = Config().to_dict()
    base = identity_of(settings, defaults)
    # a key added in a later release, at its default in the run's settings and in the defaults
    grown = {s: dict(v) for s, v in settings.items()}
    grown_defaults = {s: dict(v) for s, v in defaults.items()}
    grown["rl"]["a_new_knob"] = grown_defaults["rl"]["a_new_knob"] = 0.5
    grown["new_section"] = grown_defaults["new_section"] = {"x": 1}
    assert identity_of(grown, grown_defaults) == base
    # the same key at another value is another run
    grown["rl"]["a_new_knob"] = 0.25
    assert identity_of(grown, grown_defaults) != base
    # every setting that differs from its default counts, including a default-valued one moved
    assert cfg.identity() != Config().identity()  # tiny.toml is not the default config
    assert cfg.identity() == load_config(TINY, [f"rl.kl_coef={Config().rl.kl_coef}"]).identity()
    assert cfg.identity() != load_config(TINY, ["rl.kl_coef=0.125"]).identity()


def test_another_steps_state_does_not_resume(tmp_path, uninterrupted):
    """Issue #23 item 1: step 4's ``resumable`` block copied into step 6's manifest resumed on
    step 4's weights; meta.json's step set to 99 with its digest updated resumed at step 100."""
    from runner._digests import file_digest
    from runner.train import run

    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', "rl.steps=4"])
    run_dir = _copy_run(uninterrupted[0], tmp_path / "tiny")
    root = run_dir / "checkpoints"
    path = ckpt.step_dir(root, 6) / "manifest.json"
    good = json.loads(path.read_text())
    edited = json.loads(path.read_text())
    edited["resumable"] = json.loads((ckpt.step_dir(root, 4) / "manifest.json").read_text())[
        "resumable"
    ]
    path.write_text(json.dumps(edited))
    with pytest.raises(ckpt.CheckpointError, match=r"-step-4', not the state saved as '.*-6'"):
        run(cfg, resume=True, progress=False)
    path.write_text(json.dumps(good))

    # The state's own step edited, with the manifest's digest updated to match.
    meta = next((run_dir / good["resumable"]["provider_path"]).glob("v-*/meta.json"))
    original = meta.read_text()
    meta.write_text(original.replace('"step": 6', '"step": 99'))
    assert meta.read_text() != original
    edited = json.loads(path.read_text())
    edited["resumable"]["sha256"][meta.relative_to(run_dir).as_posix()] = file_digest(meta)
    path.write_text(json.dumps(edited))
    with pytest.raises(ckpt.CheckpointError, match="records step 99 but its optimizer state has"):
        run(cfg, resume=True, progress=False)
    # ... and the state of step 4 copied over step 6's, all digests updated: its own name says so.
    meta.write_text(original)
    path.write_text(json.dumps(good))
    import shutil

    state6 = run_dir / good["resumable"]["provider_path"]
    older = json.loads((ckpt.step_dir(root, 4) / "manifest.json").read_text())
    state4 = run_dir / older["resumable"]["provider_path"]
    shutil.rmtree(state6)
    shutil.copytree(state4, state6)
    edited = json.loads(path.read_text())
    edited["resumable"]["sha256"] = {
        f.relative_to(run_dir).as_posix(): file_digest(f)
        for f in sorted(state6.rglob("*"))
        if f.is_file()
    }
    path.write_text(json.dumps(edited))
    with pytest.raises(ckpt.CheckpointError, match=r"records the state saved as '.*-step-4'"):
        run(cfg, resume=True, progress=False)


@pytest.mark.parametrize(
    "override, step",
    [("optim.eps=0", 1), ("sft.learning_rate=1e30", 1)],
)
def test_a_non_finite_step_stops_the_run_before_its_update_and_checkpoint(tmp_path, override, step):
    """Issue #23 item 4: NaN weights were trained and checkpointed, the run dying only at the
    first RL step blaming ``sampling_logprobs``."""
    from runner import NonFiniteUpdateError
    from runner.train import run

    cfg = load_config(TINY, [f'run.output_dir="{tmp_path}"', "checkpoint.interval=1", override])
    key = override.split("=")[0]
    with pytest.raises(NonFiniteUpdateError, match=rf"^step {step} \(sft\): .* not finite.*"):
        run(cfg, progress=False)
    with pytest.raises(NonFiniteUpdateError, match=rf"Likely cause: .*{key.split('.')[1]}"):
        run(load_config(TINY, [f'run.output_dir="{tmp_path}/b"', override]), progress=False)
    assert ckpt.latest_step(tmp_path / "tiny" / "checkpoints") is None
    log = (tmp_path / "tiny" / "metrics.jsonl").read_text()
    records = [json.loads(x) for x in log.splitlines()]
    assert [r["step"] for r in records] == list(range(step))  # the failing step is not logged
