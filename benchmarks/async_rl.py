"""Asynchronous RL: per-step wall time of the lock-step and the concurrent rollout.

The main job's sizes (``examples/default.toml``: 8 problems × 8 samples a step, the calculator
task) on the local backend, with an emulated tool latency per environment step
(``[task.kwargs].latency_ms``), side by side in one process:

* ``lockstep`` — today's rollout (turn by turn, environments one after another);
* ``concurrent`` with ``O = [rl].max_off_policy_steps`` in {0, 1, 2};
* ``concurrent O=1`` with the ``old_policy`` anchor, and with ``K = 2`` pipeline chunks.

``--backend local`` (default) trains in process; ``--backend tinker`` trains through the real
Tinker SDK against an in-process ``python -m runner serve`` on loopback (the model of the same
config), so the hosted path's overlap is measured the same way. ``--plot PATH`` draws the
training reward against cumulative RL wall-clock time, one line per setting, one panel per
latency (mean over seeds).

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
import contextlib
import os
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
    (
        "concurrent O=1 old_policy",
        ['rl.rollout="concurrent"', "rl.max_off_policy_steps=1", 'rl.anchor="old_policy"'],
    ),
    (
        "concurrent O=1 K=2",
        ['rl.rollout="concurrent"', "rl.max_off_policy_steps=1", "rl.pipeline_chunks=2"],
    ),
]
#: ``--task`` → its ``[task]`` overrides. The lookup's in-context second hop needs a longer SFT
#: warm-up than the calculator to leave chance on this model: a reward study passes
#: ``--sft-steps 300`` (as benchmarks/echo_study.py does).
TASKS = {
    "calc": [],
    "lookup": ['task.factory="runner.tasks.lookup:make_task"', "task.kwargs={}"],
}
#: The Tinker backend's model name on the in-process server and the key's variable.
TINKER_MODEL, TINKER_KEY_ENV = "foldloss/bench", "FOLDLOSS_BENCH_TINKER_KEY"


def _run(config: Path, overrides: list[str], out: Path, name: str, backend: list[str]) -> dict:
    from runner.config import load_config
    from runner.train import run

    cfg = load_config(
        config,
        [
            *overrides,
            *backend,
            f'run.output_dir="{out}"',
            f'run.name="{name}"',
            "checkpoint.interval=0",
        ],
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
        wall_s=[float(t) for t in np.cumsum([r["step_time_s"] for r in rl])],
    )


@contextlib.contextmanager
def _backend(name: str, config: Path, tmp: Path):
    """The ``--set`` overrides that select the backend (Tinker: a server for the run)."""
    if name == "local":
        yield []
        return
    import secrets

    from runner.serve import ServeConfig, ServerThread, parse_model_flags

    key = f"tml-{secrets.token_hex(16)}"
    os.environ[TINKER_KEY_ENV] = key
    models = parse_model_flags([f"{TINKER_MODEL}={config}"])
    serve = ServeConfig(api_key=key, state_dir=str(tmp / "serve-state"), long_poll_s=0.5)
    try:
        with ServerThread(serve, models) as st:
            yield [
                'run.backend="tinker"',
                f"tinker.base_url='{st.url}'",
                f"tinker.base_model='{TINKER_MODEL}'",
                f"tinker.api_key_env='{TINKER_KEY_ENV}'",
                "tinker.lora_rank=8",
            ]
    finally:
        os.environ.pop(TINKER_KEY_ENV, None)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """Training reward against cumulative RL wall time: a line per setting (mean over seeds),
    a panel per latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latencies = sorted({r["latency_ms"] for r in rows})
    fig, axes = plt.subplots(1, len(latencies), figsize=(6 * len(latencies), 4), squeeze=False)
    for ax, latency in zip(axes[0], latencies, strict=True):
        for r in (r for r in rows if r["latency_ms"] == latency):
            wall = np.mean([run["wall_s"] for run in r["runs"]], axis=0)
            reward = np.mean([run["reward"] for run in r["runs"]], axis=0)
            ax.plot(wall, reward, marker="o", label=r["setting"])
        ax.set_title(f"{title}, tool latency {latency:g} ms")
        ax.set_xlabel("RL wall-clock time (s)")
        ax.set_ylabel("training reward")
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--latencies", default=None, help="comma-separated latency_ms values")
    p.add_argument(
        "--settings", default=None, help=f"comma-separated setting indices (0-{len(SETTINGS) - 1})"
    )
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--rl-steps", type=int, default=None)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--backend", choices=("local", "tinker"), default="local")
    p.add_argument(
        "--task",
        choices=tuple(TASKS),
        default="calc",
        help="the calculator (default) or the two-hop lookup (its kwargs at their defaults)",
    )
    p.add_argument("--plot", type=Path, default=None, help="reward vs wall-clock PNG")
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
    task = TASKS[args.task]
    picked = [(label, [*task, *overrides]) for label, overrides in picked]
    rows = []
    warmup = not args.quick if args.warmup is None else args.warmup
    with tempfile.TemporaryDirectory() as tmp, _backend(args.backend, config, Path(tmp)) as be:
        if warmup:  # compile every sampling shape once (jit caches persist in this process)
            for label, overrides in picked:
                name = f"warmup_{label.replace(' ', '_').replace('=', '')}"
                _run(
                    config, [*overrides, f"sft.steps={sft}", f"rl.steps={rl}"], Path(tmp), name, be
                )
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
                            be,
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
        f"Asynchronous RL ({args.backend} backend): seconds per RL step (median after the first)",
        [
            "latency ms",
            "rollout",
            "s / step",
            "speed-up vs lockstep",
            "time vs O=0",
            "trainer idle",
            "max offset",
            "eval reward",
            "per seed",
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
                " ".join(
                    "-" if run["eval_reward"] is None else f"{run['eval_reward']:.3f}"
                    for run in r["runs"]
                ),
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
            task=args.task,
            latencies=latencies,
            sft_steps=sft,
            rl_steps=rl,
            seeds=args.seeds,
            backend=args.backend,
        ),
        result=dict(rows=rows),
        markdown=table,
    )
    if args.plot is not None:
        payload["plot"] = str(plot(rows, args.plot, args.backend))
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
