"""Asynchronous RL: per-step wall time of the lock-step and the concurrent rollout.

The main job's sizes (``examples/default.toml``: 8 problems × 8 samples a step, the calculator
task) on the local backend, with an emulated tool latency per environment step
(``[task.kwargs].latency_ms``), side by side in one process:

* ``lockstep`` — today's rollout (turn by turn, environments one after another);
* ``concurrent`` with ``O = [rl].max_off_policy_steps`` in {0, 1, 2}.

Each setting runs ``--sft-steps`` SFT steps (so the policy calls its tool), then ``--rl-steps``
RL steps; the per-step time is the median over the RL steps after the first. Every setting runs
once untimed first (``--warmup``, latency 0), so that the sampling shapes are compiled before
any step is timed.
Also reported: ``async/trainer_idle_frac``, ``async/version_offset_max`` and the held-out reward
at the end (mean over ``--seeds`` seeds).

Run: ``python benchmarks/async_rl.py [--quick] [--out PATH]`` (``--quick``: the tiny config,
latency 0 and 20 ms, two RL steps; the tests run it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

_common.setup()

import numpy as np  # noqa: E402

NAME = "async_rl"
#: (label, [rl] overrides): the rollouts compared.
SETTINGS = [
    ("lockstep", ['rl.rollout="lockstep"']),
    ("concurrent O=0", ['rl.rollout="concurrent"', "rl.max_off_policy_steps=0"]),
    ("concurrent O=1", ['rl.rollout="concurrent"', "rl.max_off_policy_steps=1"]),
    ("concurrent O=2", ['rl.rollout="concurrent"', "rl.max_off_policy_steps=2"]),
]


def _run(config: Path, overrides: list[str], out: Path, name: str) -> dict:
    from runner.config import load_config
    from runner.train import run

    cfg = load_config(
        config,
        [*overrides, f'run.output_dir="{out}"', f'run.name="{name}"', "checkpoint.interval=0"],
    )
    records = run(cfg, progress=False).metrics
    rl = [r for r in records if r.get("phase") == "rl"]
    times = [r["step_time_s"] for r in rl[1:]] or [rl[0]["step_time_s"]]
    return dict(
        step_time_s=_common.median(times),
        step_times_s=[r["step_time_s"] for r in rl],
        idle_frac=float(np.mean([r.get("async/trainer_idle_frac", np.nan) for r in rl[1:]]))
        if len(rl) > 1
        else None,
        version_offset_max=max((r.get("async/version_offset_max", 0.0) for r in rl), default=0),
        eval_reward=records[-1].get("eval_reward"),
        reward=[r["reward"] for r in rl],
    )


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--latencies", default=None, help="comma-separated latency_ms values")
    p.add_argument("--settings", default=None, help="comma-separated setting indices (0-3)")
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--rl-steps", type=int, default=None)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every setting once untimed first, so compiles are not timed (default: on, off "
        "with --quick)",
    )
    args = p.parse_args(argv)
    root = _common.ROOT / "examples"
    config = root / ("tiny.toml" if args.quick else "default.toml")
    latencies = [
        float(x) for x in (args.latencies or ("0,20" if args.quick else "0,50")).split(",")
    ]
    picked = (
        [SETTINGS[int(i)] for i in args.settings.split(",")]
        if args.settings
        else SETTINGS[:3]
        if args.quick
        else SETTINGS
    )
    sft = args.sft_steps if args.sft_steps is not None else (3 if args.quick else 20)
    rl = args.rl_steps if args.rl_steps is not None else (2 if args.quick else 4)
    rows = []
    warmup = not args.quick if args.warmup is None else args.warmup
    with tempfile.TemporaryDirectory() as tmp:
        if warmup:  # compile every sampling shape once (jit caches persist in this process)
            for label, overrides in picked:
                name = f"warmup_{label.replace(' ', '_').replace('=', '')}"
                _run(config, [*overrides, f"sft.steps={sft}", f"rl.steps={rl}"], Path(tmp), name)
        for latency in latencies:
            for label, overrides in picked:
                per_seed = []
                for seed in range(args.seeds):
                    name = f"{label.replace(' ', '_').replace('=', '')}_{int(latency)}_{seed}"
                    per_seed.append(
                        _run(
                            config,
                            [
                                *overrides,
                                f"task.kwargs.latency_ms={latency}",
                                f"sft.steps={sft}",
                                f"rl.steps={rl}",
                                f"run.seed={seed}",
                            ],
                            Path(tmp),
                            name,
                        )
                    )
                rewards = [r["eval_reward"] for r in per_seed if r["eval_reward"] is not None]
                rows.append(
                    dict(
                        setting=label,
                        latency_ms=latency,
                        step_time_s=_common.median([r["step_time_s"] for r in per_seed]),
                        idle_frac=per_seed[0]["idle_frac"],
                        version_offset_max=max(r["version_offset_max"] for r in per_seed),
                        eval_reward=float(np.mean(rewards)) if rewards else None,
                        runs=per_seed,
                    )
                )
    base = {(r["latency_ms"], r["setting"]): r["step_time_s"] for r in rows}
    for r in rows:
        ref = base.get((r["latency_ms"], "lockstep"))
        o0 = base.get((r["latency_ms"], "concurrent O=0"))
        r["vs_lockstep"] = ref / r["step_time_s"] if ref else None
        r["vs_O0"] = r["step_time_s"] / o0 if o0 else None
    table = _common.table(
        "Asynchronous RL: seconds per RL step (median after the first)",
        [
            "latency ms",
            "rollout",
            "s / step",
            "speed-up vs lockstep",
            "time vs O=0",
            "trainer idle",
            "max offset",
            "eval reward",
        ],
        [
            [
                r["latency_ms"],
                r["setting"],
                r["step_time_s"],
                r["vs_lockstep"],
                r["vs_O0"],
                r["idle_frac"],
                r["version_offset_max"],
                r["eval_reward"],
            ]
            for r in rows
        ],
    )
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(
            quick=args.quick,
            config=config.name,
            latencies=latencies,
            sft_steps=sft,
            rl_steps=rl,
            seeds=args.seeds,
        ),
        result=dict(rows=rows),
        markdown=table,
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
