"""Forward + backward throughput: the local trainer's JAX Llama vs the same model in transformers.

A ~20M-parameter Llama-shaped model (H=384, 8 layers, SwiGLU 1024, 6 query / 2 key-value
heads, V=16384, tied embeddings) is built with `transformers` (seeded), saved with
``save_pretrained`` and loaded into `runner.local.LocalTrainer.from_pretrained`, so both sides
hold the same weights (checked: per-token logprobs agree). On one batch of B sequences of T+1
tokens it times, interleaved round by round after a warm-up (compilation excluded):

* ``LocalTrainer.forward_backward(seqs, "cross_entropy")`` (weights 1: the summed token NLL,
  the gradient accumulated and waited for) with the layers scanned (default) and unrolled
  (``unroll_layers=True``), logprobs chunked (default 256 tokens). ``cross_entropy`` is linear
  in the logprobs, so this is the trainer's one-call fused path (`runner.local.trainer`: the
  head's logits formed once per chunk, never recomputed), not the generic forward / kernel /
  pullback calls of the other kernels;
* transformers + torch on CPU, float32, sdpa attention, train mode: ``zero_grad``; logits →
  ``log_softmax`` → gather the targets → ``-(sum)``; ``backward()``.

Reports median tokens/s (B·T per second) and the ratio to torch.

Run: ``python benchmarks/hf_throughput.py [--quick] [--rounds N] [--out PATH]``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

_common.setup()

import numpy as np  # noqa: E402

NAME = "hf_throughput"
FULL = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=16384,
    tie_word_embeddings=True,
)
QUICK = dict(FULL, hidden_size=48, intermediate_size=128, num_hidden_layers=2, vocab_size=512)


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; quick 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences (default 8; quick 2)")
    p.add_argument("--seq-len", type=int, default=None, help="T (default 256; quick 32)")
    args = p.parse_args(argv)
    import jax
    import torch
    import transformers

    from runner import Seq
    from runner.local import LocalTrainer, LocalTrainerConfig, models

    arch = QUICK if args.quick else FULL
    rounds = args.rounds or (2 if args.quick else 5)
    B = args.batch or (2 if args.quick else 8)
    T = args.seq_len or (32 if args.quick else 256)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**arch)).train()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, arch["vocab_size"], (B, T + 1))
    seqs = [Seq(t, {"weights": np.ones(T, np.float32)}) for t in tokens]
    ids = torch.tensor(tokens)

    def torch_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(ids[:, :-1]).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])
        (-lp.sum()).backward()

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        trainers = {
            "jax (layers scanned)": LocalTrainer(
                LocalTrainerConfig.from_pretrained(tmp, max_seq_len=T)
            ),
            "jax (layers unrolled)": LocalTrainer(
                LocalTrainerConfig.from_pretrained(tmp, max_seq_len=T, unroll_layers=True)
            ),
        }
    cfg = next(iter(trainers.values())).config
    n_params = models.num_params(cfg.decoder)
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids[:, :-1]).logits.double(), -1)
        ref = ref.gather(-1, ids[:, 1:, None])[..., 0].numpy()
    parity = float(np.max(np.abs(np.stack(trainers["jax (layers scanned)"].forward(seqs)) - ref)))

    def jax_step(t):
        t.forward_backward(seqs, "cross_entropy")
        jax.block_until_ready(t.accumulated_grads())  # the backward runs asynchronously

    steps = {name: (lambda t=t: jax_step(t)) for name, t in trainers.items()}
    steps["transformers + torch"] = torch_step
    compile_s = {}
    for name, fn in steps.items():  # warm-up: compilation (JAX) and allocator (torch)
        t0 = time.perf_counter()
        fn()
        compile_s[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    torch_s = _common.median(times["transformers + torch"])
    rows = []
    for name, ts in times.items():
        s = _common.median(ts)
        rows.append(
            dict(
                implementation=name,
                median_s=s,
                min_s=min(ts),
                tokens_per_s=B * T / s,
                vs_torch=torch_s / s,
                first_call_s=compile_s[name],
            )
        )
    md = _common.table(
        f"forward + backward, Llama {n_params / 1e6:.1f}M params, B={B}, T={T}, float32, "
        f"{rounds} rounds (median); torch threads {torch.get_num_threads()}",
        ["implementation", "median s", "tokens/s", "× torch", "first call s (compile)"],
        [
            [
                r["implementation"],
                r["median_s"],
                r["tokens_per_s"],
                r["vs_torch"],
                r["first_call_s"],
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
            model=arch,
            params=n_params,
            batch=B,
            seq_len=T,
            rounds=rounds,
            logprob_chunk=cfg.chunk,
            torch_threads=torch.get_num_threads(),
            torch=torch.__version__,
            transformers=transformers.__version__,
        ),
        logprob_parity_max_abs=parity,
        rows=rows,
        markdown=md,
    )
    print(f"\nlogprob parity (JAX vs transformers, float32): max abs {parity:.2e}")
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
