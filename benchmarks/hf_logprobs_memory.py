"""Peak memory of per-token logprobs + their gradient: chunked (custom VJP) vs materialized logits.

For final hidden states ``h[T, H]``, an unembedding ``W[V, H]`` and targets (B = 1), it compiles
``(logprobs, d/dh, d/dW)`` of `runner.local.models.chunked_token_logprobs` with ``chunk = 0``
(the ``[T, V]`` float32 logits materialized, autodiff keeping them for the backward) and with
several chunk sizes (the backward in blocks of the default number of vocabulary rows, the
"vocab block" column), and reports XLA's compiled memory analysis side by side: the temporary
(transient) bytes — what chunking removes — and the argument and output bytes (``h``, ``W``,
``dh``, ``dW``: the same for every variant). It also compiles the trainer's fused head of a loss
linear in the logprobs (`runner.local.models._logprobs.linear_loss`, the ``cross_entropy``
kernel's path: the logits formed once per chunk, ``dh`` and ``dW`` in the same pass) and reports
its temporaries beside them ("fused head temp MiB"; chunk 0 = one chunk of all T tokens). Without ``--no-run`` it also runs each variant once
in a fresh subprocess (materialized and the default chunk, H = 256) and reports its peak
resident memory above the inputs (``ru_maxrss``) and its time.

Default sizes: T = 4096, V = 151936 (Qwen3's vocabulary), H = 1024 (Qwen3-0.6B) and H = 256.

Run: ``python benchmarks/hf_logprobs_memory.py [--quick] [--no-run] [--out PATH]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

_common.setup()

NAME = "hf_logprobs_memory"
MIB = 2**20


def _build(T: int, V: int, H: int, chunk: int):
    import jax
    import jax.numpy as jnp

    from runner.local.models import chunked_token_logprobs

    def f(h, w, y, g):
        lp, vjp = jax.vjp(lambda h, w: chunked_token_logprobs(h, w, y, chunk=chunk), h, w)
        return lp, vjp(g)

    S = jax.ShapeDtypeStruct
    shapes = (
        S((T, H), jnp.float32),
        S((V, H), jnp.float32),
        S((T,), jnp.int32),
        S((T,), jnp.float32),
    )
    return jax.jit(f), shapes


def _build_fused(T: int, V: int, H: int, chunk: int):
    """The trainer's head for a loss linear in the logprobs (`_logprobs.linear_loss`):
    ``((Σ g·lp, lp), (d/dh, d/dW))`` in one pass, logits formed once per chunk."""
    import jax

    from runner.local.models import _logprobs

    def f(h, w, y, g):
        def loss(h, w):
            return _logprobs.linear_loss(h, w, y, g, chunk=chunk)

        return jax.value_and_grad(loss, (0, 1), has_aux=True)(h, w)

    return jax.jit(f), _build(T, V, H, chunk)[1]


def analyze(T: int, V: int, H: int, chunk: int) -> dict:
    from runner.local.models import _logprobs

    fn, shapes = _build(T, V, H, chunk)
    m = fn.lower(*shapes).compile().memory_analysis()
    fused, _ = _build_fused(T, V, H, chunk)
    mf = fused.lower(*shapes).compile().memory_analysis()
    return dict(
        vocab_block=_logprobs._vocab_block(V, None) if 0 < chunk < T else None,
        temp_mib=m.temp_size_in_bytes / MIB,
        fused_temp_mib=mf.temp_size_in_bytes / MIB,
        argument_mib=m.argument_size_in_bytes / MIB,
        output_mib=m.output_size_in_bytes / MIB,
    )


_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, {bench!r})
import hf_logprobs_memory as b
T, V, H, chunk = {args}
fn, _ = b._build(T, V, H, chunk)
rng = np.random.default_rng(0)
h = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
w = jnp.asarray(rng.normal(size=(V, H)) * 0.02, jnp.float32)
y = jnp.asarray(rng.integers(0, V, T), jnp.int32)
g = jnp.asarray(rng.normal(size=T), jnp.float32)
compiled = fn.lower(h, w, y, g).compile()
jax.block_until_ready((h, w, y, g))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
jax.block_until_ready(compiled(h, w, y, g))
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(dict(peak_above_inputs_mib=(peak - base) / 1024, seconds=dt)))
"""


def run_child(T: int, V: int, H: int, chunk: int) -> dict:
    code = _CHILD.format(
        root=str(_common.ROOT), bench=str(Path(__file__).resolve().parent), args=(T, V, H, chunk)
    )
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, env=env
    )
    if proc.returncode != 0:
        return dict(error=proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--no-run", action="store_true", help="compiled memory analysis only")
    args = p.parse_args(argv)
    if args.quick:
        T, V, widths, chunks, measured = 512, 8192, (64,), (0, 64, 128), {(64, 0), (64, 64)}
    else:
        T, V, widths, chunks = 4096, 151936, (1024, 256), (0, 128, 256, 512, 1024)
        measured = {(256, 0), (256, 256)}  # runs take minutes each on 2 CPU cores
    rows = []
    for H in widths:
        base = None
        for chunk in chunks:
            r = dict(T=T, V=V, H=H, chunk=chunk, **analyze(T, V, H, chunk))
            if chunk == 0:
                base = r
            r["temp_vs_materialized"] = r["temp_mib"] / base["temp_mib"]
            r["fused_temp_vs_materialized"] = r["fused_temp_mib"] / base["temp_mib"]
            total = r["temp_mib"] + r["argument_mib"] + r["output_mib"]
            base_total = base["temp_mib"] + base["argument_mib"] + base["output_mib"]
            r["total_vs_materialized"] = total / base_total
            if not args.no_run and (H, chunk) in measured:
                r.update(run_child(T, V, H, chunk))
                if "peak_above_inputs_mib" in r and chunk and "peak_above_inputs_mib" in base:
                    r["peak_vs_materialized"] = (
                        r["peak_above_inputs_mib"] / base["peak_above_inputs_mib"]
                    )
            rows.append(r)
            print(json.dumps(r), flush=True)
    cols = [
        "H",
        "chunk",
        "vocab block",
        "temp MiB",
        "temp / materialized",
        "fused head temp MiB",
        "args+outputs MiB",
        "measured peak above inputs MiB",
        "peak / materialized",
        "seconds",
    ]
    md = _common.table(
        f"logprobs + gradient, T={T}, V={V}, B=1, float32 (chunk 0 = materialized [T, V] logits)",
        cols,
        [
            [
                r["H"],
                r["chunk"],
                r["vocab_block"],
                r["temp_mib"],
                r["temp_vs_materialized"],
                r["fused_temp_mib"],
                r["argument_mib"] + r["output_mib"],
                r.get("peak_above_inputs_mib"),
                r.get("peak_vs_materialized"),
                r.get("seconds"),
            ]
            for r in rows
        ],
    )
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(quick=args.quick, T=T, V=V, widths=list(widths), chunks=list(chunks)),
        rows=rows,
        markdown=md,
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
