"""Compile counts and padding overhead of the client-loss adapter over many random-length steps.

200 steps of ``fold(grpo with KL, echo_env)`` through ``runner.StepRunner.accumulate`` (client
path: forward, jitted loss gradient, linear CE backward) on a small ``LocalTrainer``; each step has a random number of sequences (1-32) with random
lengths (a per-step scale L ~ U[8, 250], lengths ~ U[L/2, L]). Reports

* the client loss's jit compilations (``ClientLoss.compile_count``) against the ``(rows,
  length)`` buckets actually hit; target: no more than (#row buckets hit) × (#length buckets hit)
  — in fact exactly one per distinct bucket pair, and none once every pair has been seen;
* the trainer's own jit traces (model forward / forward+vjp / backward / CE kernel) for context;
* the padding overhead: padded / real target tokens of the client batch (rows and length
  padding) and of the trainer's batch.

Run: ``python benchmarks/compile_count.py [--quick] [--out PATH] [--steps N]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import synthetic  # noqa: E402

_common.setup()

import numpy as np  # noqa: E402

import losses  # noqa: E402
from runner import Seq, StepRunner  # noqa: E402
from runner.local import LocalTrainer, LocalTrainerConfig, length_bucket  # noqa: E402
from runner.local import row_bucket as trainer_row_bucket  # noqa: E402
from runner.local.trainer import TRACE_COUNTS  # noqa: E402

NAME = "compile_count"
VOCAB = 32


def random_step(rng: np.random.Generator, max_rows: int, max_len: int) -> list[Seq]:
    """One step's sequences: prompt, then alternating action / observation turns."""
    n = int(rng.integers(1, max_rows + 1))
    scale = int(rng.integers(8, max_len + 1))
    seqs, _ = synthetic.multi_turn_seqs(
        rng,
        n,
        lengths=(max(scale // 2, 2), scale + 1),
        start=(1, 8),
        action_turn=(2, 12),
        obs_turn=(1, 8),
        ensure_action=True,
        vocab=VOCAB,
        with_ref=True,
        anchors=(1.0, 5.0),
    )
    return seqs


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default 200; quick 20)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--adapter",
        choices=("step", "client"),
        default=None,
        help="step: StepRunner.accumulate on a LocalTrainer (default); client: only "
        "ClientLoss.value_and_grads on synthetic logprobs, no model (default with --quick)",
    )
    args = p.parse_args(argv)
    adapter = args.adapter or ("client" if args.quick else "step")
    steps = args.steps or (20 if args.quick else 200)
    max_rows, max_len = (4, 30) if args.quick else (32, 250)
    cfg = LocalTrainerConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=1,
        n_heads=2,
        d_ff=64,
        max_seq_len=32 if args.quick else 256,
        seed=args.seed,
    )
    trainer = LocalTrainer(cfg)
    term = losses.fold(losses.grpo(clip_high=0.28, kl_coef=0.05), losses.echo_env(coef=0.05))
    runner = StepRunner(term)
    assert runner.plan(trainer).path == "client"
    rng = np.random.default_rng(args.seed)

    traces_before = dict(TRACE_COUNTS)
    shapes: list[tuple[int, int]] = []
    compiles: list[int] = []
    real = client_padded = client_len_padded = trainer_padded = 0
    trainer_shapes = set()
    step_times = []
    t_start = time.perf_counter()
    for _ in range(steps):
        seqs = random_step(rng, max_rows, max_len)
        shape = runner.client.shapes(seqs)
        shapes.append(shape)
        n_real = sum(s.num_targets for s in seqs)
        real += n_real
        client_padded += shape[0] * shape[1]
        client_len_padded += len(seqs) * shape[1]
        width = length_bucket(max(s.num_targets for s in seqs), cfg.max_seq_len)
        rows = trainer_row_bucket(len(seqs), trainer.num_devices, trainer.MIN_ROWS, width)
        trainer_shapes.add((rows, width))
        trainer_padded += rows * width
        t0 = time.perf_counter()
        if adapter == "step":
            runner.accumulate(trainer, seqs)  # forward, client loss, linear CE backward
            trainer.reset_grads()
        else:  # the client loss alone, on logprobs a trainer could have returned
            lps = [-rng.uniform(0.1, 4.0, s.num_targets).astype(np.float32) for s in seqs]
            runner.client.value_and_grads(lps, seqs)
        step_times.append(time.perf_counter() - t0)
        compiles.append(runner.client.compile_count)
    wall = time.perf_counter() - t_start
    traces = {k: TRACE_COUNTS[k] - traces_before.get(k, 0) for k in TRACE_COUNTS}
    traces = {k: v for k, v in traces.items() if v}
    if adapter == "client":
        trainer_shapes.clear()
        trainer_padded = 0

    distinct = sorted(set(shapes))
    row_buckets = sorted({r for r, _ in distinct})
    len_buckets = sorted({t for _, t in distinct})
    bound = len(row_buckets) * len(len_buckets)
    compile_count = runner.client.compile_count
    half = steps // 2
    new_in_second_half = compiles[-1] - compiles[half - 1] if half else compiles[-1]
    shapes_new_in_second_half = len(set(shapes)) - len(set(shapes[:half]))
    result = dict(
        steps=steps,
        compile_count=compile_count,
        distinct_shapes_hit=len(distinct),
        row_buckets_hit=row_buckets,
        length_buckets_hit=len_buckets,
        row_x_length_buckets=bound,
        target_met=compile_count <= bound,
        one_compile_per_shape=compile_count == len(distinct),
        compiles_in_second_half=new_in_second_half,
        new_shapes_in_second_half=shapes_new_in_second_half,
        real_tokens=real,
        client_padded_tokens=client_padded,
        client_padding_overhead=client_padded / real,
        client_length_padding_overhead=client_len_padded / real,
        trainer_padded_tokens=trainer_padded,
        trainer_padding_overhead=trainer_padded / real if adapter == "step" else None,
        trainer_shapes_hit=len(trainer_shapes),
        trainer_traces=traces,
        wall_s=wall,
        step_median_ms=_common.median(step_times) * 1e3,
    )
    md = [
        _common.table(
            f"Client-loss compilations over {steps} random-length steps",
            [
                "compilations",
                "distinct (rows, length) hit",
                "row buckets hit",
                "length buckets hit",
                "rows × lengths",
                "≤ target",
                "compiles in 2nd half",
            ],
            [
                [
                    compile_count,
                    len(distinct),
                    f"{len(row_buckets)} {row_buckets}",
                    f"{len(len_buckets)} {len_buckets}",
                    bound,
                    result["target_met"],
                    new_in_second_half,
                ]
            ],
        ),
        _common.table(
            "Padding overhead (padded / real target tokens)",
            ["batch", "real tokens", "padded tokens", "overhead"],
            [
                ["client loss (rows + length)", real, client_padded, client_padded / real],
                ["client loss (length only)", real, client_len_padded, client_len_padded / real],
            ]
            + (
                [["trainer forward/backward", real, trainer_padded, trainer_padded / real]]
                if adapter == "step"
                else []
            ),
        ),
    ]
    if adapter == "step":
        md.append(
            _common.table(
                "Trainer jit traces (context; buckets: rows ≥ 8, power-of-two lengths)",
                ["function", "traces"],
                [[k, v] for k, v in sorted(traces.items())]
                + [["trainer shapes hit", len(trainer_shapes)]],
            )
        )
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(
            quick=args.quick,
            adapter=adapter,
            steps=steps,
            seed=args.seed,
            max_rows=max_rows,
            max_len=max_len,
            length_buckets=list(runner.client.length_buckets),
            row_buckets="next power of two",
            model=dict(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, d_ff=64),
        ),
        result=dict(result, adapter=adapter),
        markdown="\n\n".join(md),
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    payload = main()
    sys.exit(0 if payload["result"]["target_met"] else 1)
