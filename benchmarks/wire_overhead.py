"""What the wire costs: the main job on ``--backend tinker`` against the local server vs ``local``.

Side by side in one run, against one ``python -m runner serve`` process (started first, as a
user's long-running server is):

* **main-job wall time**: ``python -m runner train`` on ``--backend local`` and on
  ``--backend tinker`` (the same config and seed), each a fresh process; one untimed warm-up run
  of each fills the persistent JAX compilation cache, then the timed runs alternate. Target:
  tinker ≤ 1.5× local (issue #13).
* **per-call overhead**: ``forward``, ``forward_backward`` (``cross_entropy``), ``optim_step`` and
  ``sample`` (one call over the main job's prompts) of a `runner.tinker.TinkerTrainer` against
  the server vs the same calls on an in-process `runner.local.LocalTrainer` of the same model and
  batch: the difference is the SDK, HTTP, (de)serialization and the server's queueing.

Run: ``python benchmarks/wire_overhead.py [--quick] [--out PATH]`` (``--quick``: the tiny config,
one timed run each; otherwise examples/default.toml for 20 SFT + 20 RL steps, three timed runs
each).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

_common.setup()

import numpy as np  # noqa: E402

NAME = "wire_overhead"
ROOT = _common.ROOT
KEY_ENV = "FOLDLOSS_BENCH_TINKER_KEY"
MODEL = "foldloss/bench"


def _env(cache: Path, key: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TINKER_TELEMETRY="0")
    env[KEY_ENV] = key
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def _start_server(config: Path, state: Path, env: dict[str, str], log: Path):
    cmd = [sys.executable, "-m", "runner", "serve", "--port", "0", "--api-key-env", KEY_ENV]
    cmd += ["--model", f"{MODEL}={config}", "--state-dir", str(state)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True
    )
    url = proc.stdout.readline().strip()
    if not re.fullmatch(r"http://127\.0\.0\.1:\d+", url):
        proc.kill()
        raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
    return proc, url


def _train(backend: str, config: Path, steps: list[str], out: Path, env, url: str) -> float:
    cmd = [sys.executable, "-m", "runner", "train", "--config", str(config), "--no-progress"]
    cmd += ["--output-dir", str(out), "--name", f"{backend}-{uuid.uuid4().hex[:6]}", *steps]
    if backend == "tinker":
        for s in (
            f"tinker.base_url='{url}'",
            f"tinker.base_model='{MODEL}'",
            f"tinker.api_key_env='{KEY_ENV}'",
        ):
            cmd += ["--set", s]
        cmd += ["--backend", "tinker"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} run failed: {proc.stderr[-3000:]}")
    return wall


def _batch(cfg, n: int, rng: np.random.Generator):
    """``n`` sequences shaped like the main job's (prompt + completion up to max_seq_len)."""
    from runner import Seq

    seqs = []
    for _ in range(n):
        length = int(rng.integers(cfg.model.max_seq_len // 3, cfg.model.max_seq_len))
        toks = rng.integers(3, 40, size=length).astype(np.int64)
        seqs.append(Seq(toks, {"weights": rng.uniform(0, 1, length - 1)}))
    return seqs


def _per_call(config: Path, url: str, key: str, repeats: int) -> list[dict]:
    from runner import AdamParams
    from runner.config import load_config
    from runner.serve import base_model_from_config
    from runner.tinker import make_trainer

    os.environ[KEY_ENV] = key
    cfg = load_config(
        config,
        [
            "run.backend='tinker'",
            f"tinker.base_url='{url}'",
            f"tinker.base_model='{MODEL}'",
            f"tinker.api_key_env='{KEY_ENV}'",
        ],
    )
    from runner.local import LocalTrainer

    local = LocalTrainer(base_model_from_config(MODEL, config).config)
    remote = make_trainer(cfg)
    rng = np.random.default_rng(0)
    group = cfg.rl.group_size
    max_tokens = cfg.task.kwargs.get("max_tokens_per_turn", 12)
    from runner import Seq

    batches = {
        # pure overhead: almost no compute
        "1 seq x 16 tokens, 1 prompt": (
            [Seq(np.arange(3, 19, dtype=np.int64), {"weights": np.ones(15)})],
            [[3, 4, 5]],
            1,
        ),
        # the main job's RL step
        f"{cfg.rl.problems_per_step * group} seqs (RL step), {cfg.rl.problems_per_step} prompts": (
            _batch(cfg, cfg.rl.problems_per_step * group, rng),
            [rng.integers(3, 40, size=12).tolist() for _ in range(cfg.rl.problems_per_step)],
            group,
        ),
    }
    adam = AdamParams(learning_rate=1e-6)

    def seconds(trainer, name: str, seqs, prompts, n) -> float:
        # Both trainers dispatch a forward_backward's backward asynchronously: its cost shows
        # in the next call (the optimizer step), on either side alike.
        if name == "optim_step":  # the step alone: its forward_backward is not timed
            times = []
            for _ in range(repeats + 1):
                trainer.forward_backward(seqs, "cross_entropy")
                t0 = time.perf_counter()
                trainer.optim_step(adam)
                times.append(time.perf_counter() - t0)
            return _common.median(times[1:])
        call = {
            "forward": functools.partial(trainer.forward, seqs),
            "forward_backward": functools.partial(trainer.forward_backward, seqs, "cross_entropy"),
            "sample": functools.partial(
                trainer.sample, prompts, num_samples=n, max_tokens=max_tokens, seed=3
            ),
        }[name]
        return _common.median(_common.timings(call, repeats=repeats))

    out = []
    try:
        for batch, (seqs, prompts, n) in batches.items():
            for name in ("forward", "forward_backward", "optim_step", "sample"):
                local_s = seconds(local, name, seqs, prompts, n)
                tinker_s = seconds(remote, name, seqs, prompts, n)
                out.append(
                    dict(
                        call=name,
                        batch=batch,
                        local_ms=1e3 * local_s,
                        tinker_ms=1e3 * tinker_s,
                        overhead_ms=1e3 * (tinker_s - local_s),
                        ratio=tinker_s / local_s if local_s > 0 else None,
                    )
                )
    finally:
        remote.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None, help="timed main-job runs per backend")
    args = p.parse_args(argv)
    if args.quick:
        config, steps, runs, call_repeats = ROOT / "examples" / "tiny.toml", [], 1, 5
    else:
        config = ROOT / "examples" / "default.toml"
        steps, runs, call_repeats = ["--sft-steps", "20", "--rl-steps", "20"], 3, 10
    runs = args.repeats or runs
    key = f"tml-bench-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = _env(tmp / "jax-cache", key)
        server, url = _start_server(config, tmp / "state", env, tmp / "server.log")
        try:
            walls: dict[str, list[float]] = {"local": [], "tinker": []}
            for backend in walls:  # warm-up: compilation cache, the server's jit caches
                _train(backend, config, steps, tmp / "runs", env, url)
            for _ in range(runs):
                for backend in walls:
                    walls[backend].append(_train(backend, config, steps, tmp / "runs", env, url))
            calls = _per_call(config, url, key, call_repeats)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    local_s, tinker_s = _common.median(walls["local"]), _common.median(walls["tinker"])
    ratio = tinker_s / local_s
    wall_table = _common.table(
        "Main-job wall time (median seconds, fresh process each, compilation cache warm)",
        ["config", "local", "tinker (local server)", "ratio", "target", "met"],
        [
            [
                f"{config.name} {' '.join(steps)}".strip(),
                local_s,
                tinker_s,
                ratio,
                "≤ 1.5",
                ratio <= 1.5,
            ]
        ],
    )
    call_table = _common.table(
        "Per-call wire overhead (median ms; TinkerTrainer over loopback vs in-process LocalTrainer)",
        ["call", "batch", "local", "tinker", "overhead", "ratio"],
        [
            [c["call"], c["batch"], c["local_ms"], c["tinker_ms"], c["overhead_ms"], c["ratio"]]
            for c in calls
        ],
    )
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(quick=args.quick, config=str(config.name), steps=steps, runs=runs),
        result=dict(
            wall_s=walls,
            local_s=local_s,
            tinker_s=tinker_s,
            ratio=ratio,
            target_ratio=1.5,
            met=ratio <= 1.5,
            calls=calls,
        ),
        markdown=wall_table + "\n\n" + call_table,
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
