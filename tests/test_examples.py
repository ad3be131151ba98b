"""The README's main command for the losses package: examples/quickstart.py runs."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_prints_each_term():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    assert "fold(grpo, echo_env) loss" in out
    for line in ("grpo/clip_frac_high", "echo_env/nll", "gradient norm"):
        assert line in out
