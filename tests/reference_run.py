"""examples/tiny.toml's reference run: one ``python -m runner train`` child per test session.

The resume tests (tests/test_main_job.py) and the hosted-backend tests that compare with a local
run in a child process (tests/test_tinker_main_job.py) read the same run: conftest's
``tiny_reference_run`` fixture makes it once, under a file lock, in a directory every xdist
worker of the session sees; the other workers wait for it. Tests copy it before changing it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"


def tiny_reference_args(out: Path, *extra: str) -> list[str]:
    """The arguments after ``python -m runner``: examples/tiny.toml into ``out/tiny``, with a
    checkpoint after every step and a promotable snapshot in each (and, its stderr being no
    terminal, a progress line per step on stdout)."""
    return [
        "train",
        "--config",
        str(TINY),
        "--output-dir",
        str(out),
        "--checkpoint-interval",
        "1",
        "--set",
        "checkpoint.save_promotable=true",
        *extra,
    ]


def tiny_reference_run(root: Path) -> tuple[Path, str]:
    """``(root/tiny, stdout)`` of the reference run, run in ``root`` unless already done there
    (a ``done`` marker, written after a successful run; the lock file serializes the workers)."""
    root.mkdir(parents=True, exist_ok=True)
    run_dir, stdout, done = root / "tiny", root / "stdout.txt", root / "done"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            cmd = [sys.executable, "-m", "runner", *tiny_reference_args(root)]
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            stdout.write_text(proc.stdout)
            done.touch()
    return run_dir, stdout.read_text()
