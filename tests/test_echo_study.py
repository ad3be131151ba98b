"""benchmarks/echo_study.py --quick: every (task, λ, seed) runs, the JSON holds the table's inputs
and the plot is a PNG."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "echo_study.py"


def test_echo_study_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_echo_study", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "echo_study.json"
    module.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert {(r["task"], r["env_coef"]) for r in runs} == {
        (t, c) for t in ("calculator", "lookup") for c in (0.0, 0.05)
    }
    for r in runs:
        assert 0.0 <= r["heldout_reward"] <= 1.0 and 0.0 <= r["reward_auc"] <= 1.0
        assert math.isfinite(r["env_nll"]) and r["env_nll"] > 0 and len(r["rewards"]) == 3
    # ECHO trains the observation tokens: with λ > 0 their NLL differs from GRPO alone's (the
    # calculator's random early policy already makes tool calls; the lookup's rarely does)
    nll = {r["env_coef"]: r["env_nll"] for r in runs if r["task"] == "calculator"}
    assert nll[0.0] != nll[0.05]
    assert "held-out env-token NLL" in data["markdown"]
    assert (tmp_path / "echo_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
