"""Round-2 loss families timed against GRPO on one padded batch (used by ``loss_speed.py``).

Each family's term runs as a jitted ``value_and_grad`` over a padded float32 `losses.Batch` of
the loss-speed benchmark's ragged sequences (``[B, T]``: the same action/observation layout,
advantages, sampling and reference logprobs), with the fields the family reads added as data:
teacher logprobs, value targets, per-row KTO labels and a KL baseline, a batch-mean IS weight,
``[B, T, K]`` top-K logprobs. GRPO (clip 0.2/0.28, k3 KL 0.05, token mean) is timed in the
same repeats, alternating call by call, and each row reports the median per-repeat ratio of
its time over GRPO's (target of issue #16: ≤ 2×). This measures the loss kernels themselves;
the runner's adapter overhead (ragged → padded, the value check) is the GRPO row of the main
table. The two ``floor`` rows are not terms: `TopkFloor` (the bytes any top-K gradient moves)
and `TopkTwoPassFloor` (the same with the per-token statistic every top-K term reads before
its gradient) bound what a top-K row can reach on this backend before any ``exp``/``log``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import losses
from runner import Seq

#: K of the top-K distillation rows.
TOP_K = 8
#: The target: each family within this factor of GRPO's time.
TARGET_OVER_GRPO = 2.0


def padded(seqs: Sequence[Seq], lps: Sequence[np.ndarray], t: int):
    """``(logprobs[B, T], fields)``: the sequences' arrays padded to ``T`` (float32, zeros)."""
    b = len(seqs)
    names = ("action_mask", "obs_mask", "advantages", "sampling_logprobs", "ref_logprobs")
    out = {k: np.zeros((b, t), np.float32) for k in (*names, "logprobs")}
    for i, (s, lp) in enumerate(zip(seqs, lps, strict=True)):
        n = s.num_targets
        out["logprobs"][i, :n] = lp
        for k in names:
            out[k][i, :n] = s.inputs[k]
    return out.pop("logprobs"), out


def _rl(**kw) -> losses.Term:
    return losses.grpo(clip_low=0.2, clip_high=0.28, reduction="token_mean", **kw)


class TopkFloor:
    """Not a loss term: the least work a top-K term's ``value_and_grad`` could do.

    It reads the student and teacher ``[B, T, K]`` logprobs and the action mask ``m`` once,
    writes a ``[B, T, K]`` gradient ``d = m·(s − t)`` and reduces it to a scalar (``Σ d``),
    computed directly (no autodiff, no transcendental): whatever a top-K term computes, its
    gradient depends on both inputs, so it moves at least these bytes: 17 ``[B, T]``-sized reads and
    8 writes against GRPO's 5 and 1 (about 4×). Its row's ratio to GRPO is a floor for the top-K rows' ratios.
    """

    @staticmethod
    def value_and_grad(student_BTK: jax.Array, batch: losses.Batch):
        d = batch.action_mask[..., None] * (student_BTK - batch.teacher_topk_logprobs)
        return jnp.sum(d), d


class TopkTwoPassFloor:
    """Not a loss term: `TopkFloor` with the one dependency every top-K term has.

    A per-token statistic over K must be known before the gradient can be written: the clamp
    ``max(ℓ, 0)`` of the forward KL gates it by ``ℓ``'s sign, the renormalised supports
    subtract per-token log-normalisers, the tail bucket reads ``Σ_k e^{x_k}``. Here the statistic
    is ``d = Σ_k (s_k − t_k)`` (no transcendental) and the gradient ``m·[d > 0]·(s − t)``, the
    value ``Σ m·max(d, 0)``: the data flow of the default ``topk_forward_kl`` with its ``e^t``
    removed, written as the terms write theirs (a chain of K masked slices, which XLA:CPU runs
    faster than ``jnp.sum(axis=-1)``: 2.6× against 3.4× GRPO). XLA:CPU gives the per-token
    statistic a fusion of its own (one output per fusion) and re-reads both inputs for the
    gradient, so this row times the two passes any top-K term pays before its arithmetic.
    """

    @staticmethod
    def value_and_grad(student_BTK: jax.Array, batch: losses.Batch):
        s, t = student_BTK, batch.teacher_topk_logprobs
        valid = batch.action_mask[..., None] > 0
        K = s.shape[-1]
        # pass 1: the per-token statistic
        d = sum(jnp.where(valid, s[..., k : k + 1] - t[..., k : k + 1], 0.0) for k in range(K))
        gate = jnp.where(valid & (d > 0), 1.0, 0.0).astype(s.dtype)
        return jnp.sum(gate * d), gate * (s - t)  # pass 2: the gradient reads it


#: (family, row label, factory of a term (or `TopkFloor`), first-argument kind):
#: ``"logprobs"`` [B, T], ``"values"`` [B, T] (the critic), ``"topk"`` [B, T, K] student logprobs.
FAMILIES: list[tuple[str, str, Callable[[], Callable], str]] = [
    ("baseline", "grpo (k3 KL 0.05)", lambda: _rl(kl_coef=0.05, kl_estimator="k3"), "logprobs"),
    (
        "KL variants",
        "grpo, kl_importance_weight",
        lambda: _rl(kl_coef=0.05, kl_estimator="k3", kl_importance_weight=True),
        "logprobs",
    ),
    (
        "KL variants",
        "kl_loss to the sampler ((log r)²)",
        lambda: losses.kl_loss(coef=1e-3, estimator="sq_log_ratio", target="sampling_logprobs"),
        "logprobs",
    ),
    (
        "filters",
        "grpo + OPSM + seq-mean k3 rejection",
        lambda: _rl(
            correction=losses.correction_chain(
                losses.mismatch_correction(kind="opsm", delta=0.5),
                losses.mismatch_correction(
                    kind="rejection", statistic="k3", level="seq_mean", high=0.01
                ),
            )
        ),
        "logprobs",
    ),
    (
        "filters",
        "grpo + batch-normalised TIS",
        lambda: _rl(correction=losses.mismatch_correction(kind="tis", batch_normalize=True)),
        "logprobs",
    ),
    ("objectives", "clip_cov", lambda: losses.clip_cov(), "logprobs"),
    ("objectives", "kl_cov", lambda: losses.kl_cov(), "logprobs"),
    ("objectives", "vespo", lambda: losses.vespo(), "logprobs"),
    ("objectives", "luspo", lambda: losses.luspo(), "logprobs"),
    ("objectives", "grpo, delta=3", lambda: _rl(delta=3.0), "logprobs"),
    ("objectives", "dppo_tv_kl", lambda: losses.dppo_tv_kl(), "logprobs"),
    ("preference", "dpo (sigmoid)", lambda: losses.dpo(), "logprobs"),
    ("preference", "simpo", lambda: losses.simpo(), "logprobs"),
    ("preference", "orpo", lambda: losses.orpo(), "logprobs"),
    ("preference", "kto", lambda: losses.kto(), "logprobs"),
    ("distillation", "reverse_kl_distillation", losses.reverse_kl_distillation, "logprobs"),
    ("distillation", f"topk_forward_kl (K={TOP_K})", losses.topk_forward_kl, "topk"),
    ("distillation", f"topk_reverse_kl (K={TOP_K})", losses.topk_reverse_kl, "topk"),
    ("distillation", f"topk_jsd (K={TOP_K})", losses.topk_jsd, "topk"),
    ("critic", "value_loss (clip 0.5)", losses.value_loss, "values"),
    (
        "floor",
        f"data floor: read the [B, T, K={TOP_K}] inputs, write their gradient",
        TopkFloor,
        "topk",
    ),
    (
        "floor",
        f"two-pass floor: a per-token sum over K={TOP_K} first, then the gradient",
        TopkTwoPassFloor,
        "topk",
    ),
]


def family_inputs(lp: np.ndarray, fields: dict, seed: int = 0):
    """``(inputs by kind, Batch)``: the first arguments of each kind and the batch with every
    field a family reads (float32)."""
    rng = np.random.default_rng(seed)
    b, t = lp.shape
    act = fields["action_mask"] > 0
    f32 = np.float32
    teacher = np.minimum(fields["ref_logprobs"] - rng.uniform(0, 0.3, (b, t)), 0).astype(f32)
    topk = -np.sort(rng.exponential(1.5, (b, t, TOP_K)), axis=2).astype(f32)
    student_topk = np.minimum(topk + rng.normal(0, 0.2, (b, t, TOP_K)), 0).astype(f32)
    values = rng.normal(0, 1, (b, t)).astype(f32)
    batch = losses.Batch(
        **fields,
        teacher_logprobs=np.where(act, teacher, 0).astype(f32),
        old_values=(values + rng.normal(0, 0.3, (b, t))).astype(f32),
        returns=rng.normal(0, 1, (b, t)).astype(f32),
        labels=(np.arange(b) % 2).astype(f32),
        teacher_topk_logprobs=np.where(act[..., None], topk, 0).astype(f32),
        kl_baseline=np.asarray(0.1, f32),
        is_weight_mean=np.asarray(1.05, f32),
        extra={"rng": np.asarray(7, np.int32)},
    )
    inputs = {"logprobs": lp.astype(f32), "values": values, "topk": student_topk}
    return inputs, batch


def _jitted(term):
    """The jitted ``(value, gradient)`` of a term (or a floor row's own ``value_and_grad``)."""
    direct = getattr(term, "value_and_grad", None)
    grad = jax.jit(direct or jax.value_and_grad(lambda x, b: term(x, b)[0]))

    def run(x, batch):
        return jax.block_until_ready(grad(x, batch))

    return run


def family_rows(lp: np.ndarray, fields: dict, repeats: int) -> list[dict]:
    """One row per family: median ms, compile s, and the median per-repeat ratio over GRPO."""
    inputs, batch = family_inputs(lp, fields)
    batch_dev = jax.device_put(batch)
    args = {k: jnp.asarray(v) for k, v in inputs.items()}
    grpo = _jitted(FAMILIES[0][2]())
    grpo(args["logprobs"], batch_dev)
    rows = []
    for family, label, make, kind in FAMILIES:
        fn = _jitted(make())
        t0 = time.perf_counter()
        value, _ = fn(args[kind], batch_dev)
        first = time.perf_counter() - t0
        ft, gt = [], []
        for _ in range(repeats):  # alternating with GRPO: a load change hits both alike
            t0 = time.perf_counter()
            fn(args[kind], batch_dev)
            ft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            grpo(args["logprobs"], batch_dev)
            gt.append(time.perf_counter() - t0)
        ms = float(np.median(ft)) * 1e3
        ratio = float(np.median([a / g for a, g in zip(ft, gt, strict=True)]))
        rows.append(
            dict(
                family=family,
                term=label,
                input=kind,
                ms=ms,
                grpo_ms=float(np.median(gt)) * 1e3,
                compile_s=max(first - ms / 1e3, 0.0),
                over_grpo=ratio,
                within_target=None if family == "floor" else ratio <= TARGET_OVER_GRPO,
                finite=bool(np.isfinite(float(value))),
            )
        )
    return rows
