"""A full disk, for real: the run directory on a small tmpfs (root and ``mount`` needed; skipped
elsewhere). A run that fills it ends with one ``error:`` line naming the path and what a resume
continues from -- not orbax's, asyncio's and tensorstore's thread tracebacks -- and, once there is
room, ``--resume`` finishes the run."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from runner.local import checkpoint as lc

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"


def _mount(path: Path, size: str) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def small_disk(tmp_path):
    """A mounted tmpfs and a function that resizes it (``mount -o remount,size=``)."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        _mount(mnt, "1400k")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")

    def resize(size: str) -> None:
        subprocess.run(
            ["mount", "-o", f"remount,size={size}", str(mnt)], check=True, capture_output=True
        )

    try:
        yield mnt, resize
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "runner", "train", "--config", str(TINY)]
    cmd += ["--output-dir", str(out), "--no-progress", "--checkpoint-interval", "1"]
    cmd += ["--set", "checkpoint.save_promotable=true", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_a_full_disk_is_one_error_line_and_resume_finishes_once_there_is_room(small_disk):
    mnt, resize = small_disk
    out = mnt / "out"
    full = _train(out)
    assert full.returncode == 2, full.stderr[-3000:]
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr[-3000:]
    assert lines[0].startswith(f"error: disk full writing {out}/tiny/"), lines[0]
    assert "No space left on device" in lines[0] and "free" in lines[0]
    hint = re.search(r"--resume continues from the checkpoint of step (\d+)", lines[0])
    assert hint, lines[0]  # 1400k holds the first checkpoints of the tiny run, not all of them

    resize("64m")
    resumed = _train(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = out / "tiny"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == sorted(set(steps)) and steps[0] == 0 and len(steps) == steps[-1] + 1
    state = run_dir / "trainer" / "state"
    # the failed write's temporary directory was swept by a later save of its name
    assert not [p for p in state.rglob("tmp-*") if p.is_dir()]


@pytest.mark.parametrize("writer", ["state", "weights"])
def test_a_disk_that_fills_during_a_write_is_one_oserror(small_disk, monkeypatch, capfd, writer):
    """The space check passed (another process filled the disk meanwhile): orbax's or
    safetensors' own failure becomes one ENOSPC ``OSError`` naming the path, with no library
    log or traceback on stderr."""
    mnt, _ = small_disk
    monkeypatch.setattr(lc, "ensure_space", lambda directory, nbytes: None)
    # 4 MiB on a 1400k disk, incompressible (orbax compresses its chunks)
    big = {"w": np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)}
    with pytest.raises(OSError) as info:
        if writer == "state":
            lc.save_state(mnt, "s", {"params": big, "opt_state": {}}, {"step": 1})
        else:
            lc.save_weights(mnt, "w", big, {"step": 1})
    assert info.value.errno == errno.ENOSPC and str(mnt) in info.value.filename
    assert info.value.__cause__ is None and info.value.__suppress_context__
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ERROR:" not in err, err[-3000:]
    assert not list(mnt.rglob("*.safetensors")) and not list(mnt.rglob("tmp-*"))


def test_the_space_check_refuses_before_writing(small_disk):
    mnt, _ = small_disk
    big = {"w": np.ones((1024, 1024), np.float32)}
    with pytest.raises(OSError, match=r"needs about [\d,]+ bytes, [\d,]+ free") as info:
        lc.save_weights(mnt, "w", big, {"step": 1})
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(mnt / "sampler")


def test_tree_nbytes_counts_each_leaf_without_dtype_inference_warnings():
    """A jax array's dtype read through ``np.result_type`` is deprecated (a warning that a
    caller's ``simplefilter("error")`` turns into a failed save), so the size comes from
    ``nbytes``; Python scalars count as NumPy would store them."""
    import warnings

    import jax.numpy as jnp

    tree = {"w": jnp.ones((3, 5), jnp.float32), "m": np.zeros((2, 2), np.float64), "n": 3, "x": 1.5}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lc.tree_nbytes(tree) == 3 * 5 * 4 + 2 * 2 * 8 + 8 + 8
