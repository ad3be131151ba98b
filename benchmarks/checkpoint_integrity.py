"""What checkpoint integrity costs: sha256 of every file on save and its verification on load.

For two local-trainer sizes — the main job's model (``examples/default.toml``) and a ~100M
parameter one — after one optimizer step (dense Adam moments), saves a resumable checkpoint (params + Adam state, orbax) and promotable weights
(safetensors), then times, side by side in one run:

* ``save_state`` (which now digests the tree files into ``meta.json``) against the digest step
  alone (`runner._digests.tree_digests` over the same files);
* ``load_state`` (which verifies them first) against the verification alone
  (`runner._digests.verify_tree`), and the run-level manifest's second verification of every
  file (`runner.checkpoints.verify_files`);
* ``save_weights_for_sampler`` / ``load_weights`` against their tensor digest.

Run: ``python benchmarks/checkpoint_integrity.py [--quick] [--out PATH]`` (``--quick``: the small
model only).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

_common.setup()

import numpy as np  # noqa: E402

from runner._digests import tree_digests, verify_tree  # noqa: E402
from runner._types import AdamParams, Seq  # noqa: E402
from runner.local import LocalTrainer, LocalTrainerConfig  # noqa: E402
from runner.local import checkpoint as local_ckpt  # noqa: E402

NAME = "checkpoint_integrity"
#: (label, model keywords): the main job's model and a ~100M-parameter one.
SIZES = [
    ("main job (examples/default.toml)", dict(d_model=64, n_layers=2, n_heads=4, d_ff=256)),
    ("~100M parameters", dict(d_model=768, n_layers=14, n_heads=12, d_ff=3072)),
]


def _measure(label: str, model: dict, root: Path, repeats: int) -> dict:
    cfg = LocalTrainerConfig(vocab_size=64, max_seq_len=128, checkpoint_dir=str(root), **model)
    trainer = LocalTrainer(cfg)
    # One optimizer step, so the Adam moments are dense (a fresh state's zeros compress away).
    rng = np.random.default_rng(0)
    seqs = [Seq(rng.integers(0, 64, 33), {"weights": np.ones(32)}) for _ in range(4)]
    trainer.forward_backward(seqs, "cross_entropy")
    trainer.optim_step(AdamParams())
    n_params = sum(int(np.prod(v.shape)) for v in trainer.sampler_tensors().values())
    save = _common.timings(lambda: trainer.save_state("bench"), repeats=repeats)
    version = local_ckpt.resolve_state(root, "bench")
    tree_bytes = sum(p.stat().st_size for p in (version / "tree").rglob("*") if p.is_file())
    digest = _common.timings(lambda: tree_digests(version / "tree", version), repeats=repeats)
    files = local_ckpt.read_meta(version)["files"]
    verify = _common.timings(
        lambda: verify_tree(version, files, what="bench", under="tree"), repeats=repeats
    )
    load = _common.timings(lambda: trainer.load_state("bench"), repeats=repeats)
    path = trainer.save_weights_for_sampler("bench")
    save_w = _common.timings(lambda: trainer.save_weights_for_sampler("bench"), repeats=repeats)
    tensors = trainer.sampler_tensors()
    digest_w = _common.timings(lambda: local_ckpt.tensors_digest(tensors), repeats=repeats)
    load_w = _common.timings(lambda: trainer.load_weights(path), repeats=repeats)
    med = _common.median
    return dict(
        label=label,
        params=n_params,
        state_bytes=tree_bytes,
        save_state_s=med(save),
        state_digest_s=med(digest),
        load_state_s=med(load),
        state_verify_s=med(verify),
        save_weights_s=med(save_w),
        weights_digest_s=med(digest_w),
        load_weights_s=med(load_w),
        sha256_gb_per_s=tree_bytes / med(digest) / 1e9,
    )


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    sizes = SIZES[:1] if args.quick else SIZES
    rows = []
    for label, model in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(_measure(label, model, Path(tmp), args.repeats))
    table = _common.table(
        "Checkpoint integrity cost (median seconds; digest = sha256 of every file)",
        [
            "model",
            "parameters",
            "state on disk",
            "save_state",
            "of which digest",
            "load_state",
            "of which verify",
            "run-level re-verify",
            "sampler save / digest",
            "sampler load (verifies)",
        ],
        [
            [
                r["label"],
                r["params"],
                f"{r['state_bytes'] / 1e6:.1f} MB",
                r["save_state_s"],
                f"{r['state_digest_s']:.3g} ({r['state_digest_s'] / r['save_state_s']:.0%})",
                r["load_state_s"],
                f"{r['state_verify_s']:.3g} ({r['state_verify_s'] / r['load_state_s']:.0%})",
                r["state_verify_s"],
                f"{r['save_weights_s']:.3g} / {r['weights_digest_s']:.3g}",
                r["load_weights_s"],
            ]
            for r in rows
        ],
    )
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(quick=args.quick, repeats=args.repeats, sizes=[m for _, m in sizes]),
        result=dict(rows=rows),
        markdown=table,
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
