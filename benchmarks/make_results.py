"""Writes benchmarks/RESULTS.md from the JSON that the four benchmarks wrote.

Run the benchmarks first (default arguments), then ``python benchmarks/make_results.py``:

    python benchmarks/grad_equivalence.py
    python benchmarks/loss_speed.py
    python benchmarks/compile_count.py
    python benchmarks/checkpoint_integrity.py
    python benchmarks/make_results.py [--results bench_results] [--out benchmarks/RESULTS.md]

Tables come from each JSON's ``markdown`` field; the machine block from ``machine``. Any
commentary already in RESULTS.md between ``<!-- notes -->`` and ``<!-- /notes -->`` is kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("grad_equivalence", "loss_speed", "compile_count", "checkpoint_integrity")
TITLES = {
    "grad_equivalence": "Gradient equivalence (local model, calculator-env trajectories)",
    "loss_speed": "Loss-kernel speed (client side: ragged logprobs in, -grad weights out)",
    "compile_count": "Compile counts and padding overhead",
    "checkpoint_integrity": "Checkpoint integrity (sha256 of every file, verified before a load)",
}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python benchmarks/make_results.py", description=__doc__)
    p.add_argument("--results", type=Path, default=ROOT / "bench_results")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = p.parse_args(argv)
    runs = {}
    for name in ORDER:
        path = args.results / f"{name}.json"
        if not path.is_file():
            sys.exit(f"missing {path}: run python benchmarks/{name}.py first")
        runs[name] = json.loads(path.read_text())
    notes = ""
    if args.out.is_file():
        m = re.search(r"<!-- notes -->(.*?)<!-- /notes -->", args.out.read_text(), re.S)
        notes = m.group(1).strip() if m else ""
    m0 = runs["loss_speed"]["machine"]
    lines = [
        "## Benchmark results",
        "",
        f"Machine: {m0['cpu']}, {m0['nproc']} CPU cores (`nproc`), {m0['platform']}; "
        f"Python {m0['python']}, jax {m0['jax']} ({m0['jax_backend']}), numpy {m0['numpy']}. "
        "The machine is shared with other jobs, so absolute times are indicative; compare the "
        "ratios, which are measured side by side in one run.",
        "",
        "<!-- notes -->",
        notes,
        "<!-- /notes -->",
    ]
    for name in ORDER:
        run = runs[name]
        mach = run["machine"]
        lines += [
            "",
            f"### {TITLES[name]}",
            "",
            f"`{run['command']}` — {mach['date_utc']} UTC, 1-minute load average at start "
            f"{mach.get('loadavg_1m_at_start', 'n/a')}"
            + (
                f"; torch baseline: {run['config']['torch']}, "
                f"{run['config'].get('torch_threads')} thread(s)"
                if "torch" in run.get("config", {})
                else ""
            ),
            "",
            run["markdown"],
        ]
    args.out.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
