"""One server pass: the main job with ECHO on ``--backend tinker`` against the local server, with
the RL loss as a server-side custom loss (``rl.mode = "auto"``: GRPO + ECHO decompose per datum,
1 forward + 1 backward per RL step) vs the fused client path (``rl.mode = "client"``: 2 forwards +
1 backward and a round trip per RL step).

Side by side in one run, against one ``python -m runner serve`` process: one untimed warm-up run
of each mode (the persistent JAX compilation cache, the server's jit caches), then the timed runs
alternate. Reports the median wall time of each mode and their ratio (target: server ≤ 0.8×
client), the median RL step (``step_time_s``) and its trainer share (``time/train_s``: gradient
passes + optimizer step) of each, the passes per RL step from the metrics, and whether the
per-step rewards of the two modes agree to float32 rounding.

The floor: a server pass is 1 forward + 1 backward, the work of a builtin kernel's
``forward_backward``, so it cannot take less trainer time than the builtin ``ppo`` kernel's step
(a third, ``--env-coef 0`` run in the same loop, GRPO alone on that kernel). With the rest of
the RL step (sampling, rollouts, rewards) as the client path's, the best RL-step ratio a server
pass can reach is ``(client step − client train + builtin train) / client step``.

Run: ``python benchmarks/server_loss.py [--quick] [--out PATH]`` (``--quick``: the tiny config,
one timed run each; otherwise examples/default.toml with 20 SFT + 20 RL steps, two timed runs
each).
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

_common.setup()

import numpy as np  # noqa: E402
import wire_overhead as wire  # noqa: E402

NAME = "server_loss"
ROOT = _common.ROOT
MODES = ("auto", "client")
#: The floor's run: GRPO alone on the builtin ``ppo`` kernel (1 forward + 1 backward a step).
FLOOR = ["--env-coef", "0", "--set", "rl.mode='builtin'"]


def _records(out: Path) -> dict[int, dict]:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _rl(records: dict[int, dict]) -> list[dict]:
    return [r for _, r in sorted(records.items()) if "reward" in r and "passes/forwards" in r]


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None, help="timed runs per mode")
    args = p.parse_args(argv)
    if args.quick:
        config, steps, runs = ROOT / "examples" / "tiny.toml", [], 1
    else:
        config = ROOT / "examples" / "default.toml"
        steps, runs = ["--sft-steps", "20", "--rl-steps", "20"], 2
    runs = args.repeats or runs
    key = f"tml-bench-{uuid.uuid4().hex}"
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    rl: dict[str, list[dict]] = {}
    per_step: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = wire._env(tmp / "jax-cache", key)
        server, url = wire._start_server(config, tmp / "state", env, tmp / "server.log")
        try:
            for i in range(runs + 1):  # run 0: the untimed warm-up of each mode
                for mode in (*MODES, "builtin"):
                    out = tmp / f"runs-{mode}-{i}"
                    out.mkdir()
                    sets = FLOOR if mode == "builtin" else ["--set", f"rl.mode='{mode}'"]
                    wall = wire._train("tinker", config, [*steps, *sets], out, env, url)
                    records = _rl(_records(out))
                    if i:
                        walls.setdefault(mode, []).append(wall)
                        for key in ("step_time_s", "time/train_s"):
                            # the first RL step compiles the step's shapes: not timed
                            per_step.setdefault((mode, key), []).extend(r[key] for r in records[1:])
                    if mode != "builtin":
                        rl[mode] = records
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    server_s, client_s = _common.median(walls["auto"]), _common.median(walls["client"])
    ratio = server_s / client_s
    step = {m: _common.median(per_step[m, "step_time_s"]) for m in (*MODES, "builtin")}
    train = {m: _common.median(per_step[m, "time/train_s"]) for m in (*MODES, "builtin")}
    step_ratio = step["auto"] / step["client"]
    floor = (step["client"] - train["client"] + train["builtin"]) / step["client"]
    rewards = {m: np.array([r["reward"] for r in rl[m]], np.float32) for m in MODES}
    same_rewards = bool(
        rewards["auto"].shape == rewards["client"].shape
        and np.allclose(rewards["auto"], rewards["client"], rtol=1e-6, atol=1e-6)
    )
    max_diff = float(np.max(np.abs(rewards["auto"] - rewards["client"]))) if same_rewards else None
    passes = {
        m: (rl[m][-1].get("passes/forwards"), rl[m][-1].get("passes/backwards")) for m in MODES
    }
    table = _common.table(
        "Main job with ECHO on --backend tinker (local server): server-side loss vs client path "
        "(median seconds, fresh process each, compilation cache warm)",
        ["config", "server pass", "client path", "ratio", "target", "met", "F+B per RL step"],
        [
            [
                f"{config.name} {' '.join(steps)}".strip(),
                server_s,
                client_s,
                ratio,
                "≤ 0.8",
                ratio <= 0.8,
                f"{passes['auto'][0]:.0f}+{passes['auto'][1]:.0f} vs "
                f"{passes['client'][0]:.0f}+{passes['client'][1]:.0f}",
            ]
        ],
    )
    table += "\n\n" + _common.table(
        "Per RL step (median over the timed runs' RL steps after the first, seconds)",
        ["mode", "RL step", "trainer (passes + optim)", "F+B"],
        [
            ["server pass (auto)", step["auto"], train["auto"], "1+1"],
            ["client path", step["client"], train["client"], "2+1"],
            [
                "builtin ppo, --env-coef 0 (the floor's trainer time)",
                step["builtin"],
                train["builtin"],
                "1+1",
            ],
        ],
    )
    notes = (
        f"RL step: server / client {step_ratio:.3f}, trainer time "
        f"{train['auto'] / train['client']:.3f}; the floor of the RL-step ratio (a server pass as "
        f"cheap as the builtin kernel's step) {floor:.3f}.\n"
        f"Per-step rewards over {len(rewards['auto'])} RL steps equal to float32 rounding: "
        f"{same_rewards} (max |diff| {max_diff})"
    )
    print(notes)
    table += "\n\n" + notes
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(quick=args.quick, config=str(config.name), steps=steps, runs=runs),
        result=dict(
            wall_s=walls,
            server_s=server_s,
            client_s=client_s,
            ratio=ratio,
            rl_step_s=step,
            train_s=train,
            rl_step_ratio=step_ratio,
            train_ratio=train["auto"] / train["client"],
            rl_step_floor_ratio=floor,
            target_ratio=0.8,
            met=ratio <= 0.8,
            passes=passes,
            rewards={m: rewards[m].tolist() for m in MODES},
            same_rewards=same_rewards,
        ),
        markdown=table,
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
