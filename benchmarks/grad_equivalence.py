"""Gradient equivalence on a real model: every way of running a fused loss gives the same gradient.

On the local trainer's transformer (fixed seed) and calculator-environment trajectories (prompt,
action and observation tokens), for ``fold(grpo, echo_env)`` and ``fold(grpo with k3 KL,
echo_env)`` it computes the parameter gradient through

  two_pass              the builtin policy kernel plus a separate accumulated cross-entropy pass
                        for the ECHO term (StepRunner mode "two_pass"; impossible with KL: n/a)
  client                one fused client pass (forward, JAX loss gradient, linear CE backward)
  client_precomputed    the fused pass reusing a forward already run at the same weights
  client_microbatched   the fused pass over 3 micro-batches, accumulated
  two_pass_microbatched the two-pass path over 2 micro-batches (no-KL term only)

and compares each with ``jax.grad`` of the term through the model (direct), in float32 and
float64. Differences: ``max_abs = max|g - g_direct|``, ``max_rel = max_abs / max|g_direct|``.
Trainer passes are counted from the trainer's own counters.

It also compares the ECHO observation conventions (docs/echo.md#formulas-per-backend (and #observation-masks)) on the same data:
*paper* (prompt excluded: ``losses.observation_mask(..., include_prompt=False)``), *managed*
(rLLM Tinker/Fireworks: prompt included, ``include_prompt=True``) and the environment's own
observation-body mask (the paper's O′, wrappers excluded): the env loss value, the number of
target tokens and the parameter-gradient difference.

Run: ``python benchmarks/grad_equivalence.py [--quick] [--arch gpt2|llama] [--out PATH]``
(``--arch llama``: the same on a small Llama-architecture decoder, `runner.local.models`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import synthetic  # noqa: E402

_common.setup()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # the float64 half needs it; float32 stays explicit

import numpy as np  # noqa: E402

import losses  # noqa: E402
from runner import Seq, StepRunner  # noqa: E402
from runner._padding import pad_fields, pad_ragged  # noqa: E402
from runner.env import CalcEnv, expert_trajectory, tokenizer, trajectory_to_seq  # noqa: E402
from runner.local import LocalTrainer, LocalTrainerConfig  # noqa: E402

NAME = "grad_equivalence"
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
COEF = 0.05
TERMS = {
    "grpo+echo": losses.fold(losses.grpo(clip_high=0.28), losses.echo_env(coef=COEF)),
    "grpo_kl+echo": losses.fold(
        losses.grpo(clip_high=0.28, kl_coef=0.05, kl_estimator="k3"), losses.echo_env(coef=COEF)
    ),
}
#: (name, StepRunner mode, accumulate kwargs, precompute the forward, also in --quick)
PATHS = (
    ("two_pass", "two_pass", {}, False, True),
    ("client", "client", {}, False, True),
    ("client_precomputed", "client", {}, True, True),
    ("client_microbatched", "client", {"num_microbatches": 3}, False, True),
    ("two_pass_microbatched", "two_pass", {"num_microbatches": 2}, False, False),
)


def model_size(quick: bool) -> dict[str, int]:
    if quick:
        return dict(d_model=32, n_layers=1, n_heads=2, d_ff=64)
    return dict(d_model=64, n_layers=2, n_heads=4, d_ff=256)


#: ``--arch``: the GPT-2-style default, or a small Llama-architecture decoder (GQA, RMSNorm,
#: RoPE, SwiGLU; `runner.local.models`) with the same widths and chunked logprobs.
ARCH = {"name": "gpt2"}


def model_config(quick: bool, dtype: str, max_len: int) -> LocalTrainerConfig:
    if ARCH["name"] == "llama":
        from runner.local.models import DecoderConfig

        size = model_size(quick)
        decoder = DecoderConfig(
            family="llama",
            vocab_size=tokenizer.VOCAB_SIZE,
            hidden_size=size["d_model"],
            intermediate_size=size["d_ff"],
            num_layers=size["n_layers"],
            num_heads=size["n_heads"],
            num_kv_heads=max(size["n_heads"] // 2, 1),
            max_position_embeddings=max_len,
        )
        return LocalTrainerConfig(
            decoder=decoder, max_seq_len=max_len, seed=0, dtype=dtype, logprob_chunk=16
        )
    return LocalTrainerConfig(
        vocab_size=tokenizer.VOCAB_SIZE,
        max_seq_len=max_len,
        seed=0,
        dtype=dtype,
        **model_size(quick),
    )


def trajectories(num: int, seed: int, quick: bool):
    """Finished calculator episodes: prompt, ``calc`` actions, observations, final answer.

    ``quick`` keeps episodes of 34-65 tokens, so that every batch and micro-batch pads to one
    length bucket (fewer compilations).
    """
    env = CalcEnv(seed=seed, max_operand=99, num_ops=(1, 3))
    out, i = [], 0
    while len(out) < num:
        traj = expert_trajectory(env, env.problem(i))
        if not quick or 33 < len(traj.tokens) <= 65:
            out.append(traj)
        i += 1
    return out


def make_seqs(trainer: LocalTrainer, trajs, seed: int) -> list[Seq]:
    """Runner sequences with GRPO inputs near the current policy (so ratios and clips are live).

    ``sampling_logprobs`` = current logprobs + N(0, 0.3) on action tokens, per-sequence
    advantages ~ N(0, 1), ``ref_logprobs`` = current - 0.1; ``obs_mask`` = observation bodies.
    """
    base = [trajectory_to_seq(t) for t in trajs]
    seqs, _ = synthetic.multi_turn_seqs(
        np.random.default_rng(seed),
        layouts=base,
        trainer=trainer,
        sampling_noise=0.3,
        with_ref=True,
        ref_offset=0.1,
    )
    return seqs


FIELDS = ("action_mask", "obs_mask", "advantages", "sampling_logprobs", "ref_logprobs")


def padded(seqs: list[Seq], dtype) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Tokens ``[B, W]``, lengths ``[B]`` and per-target fields ``[B, W-1]`` (zero padded)."""
    rows, width = len(seqs), max(s.tokens.shape[0] for s in seqs)
    tokens = pad_ragged([s.tokens for s in seqs], width, rows, np.int64)
    lengths = np.array([s.tokens.shape[0] for s in seqs])
    columns = [[s.inputs[name] for s in seqs] for name in FIELDS]
    fields = dict(zip(FIELDS, pad_fields(columns, width - 1, rows, dtype), strict=True))
    return tokens, lengths, fields


_DIRECT: dict = {}


def direct_grad(trainer: LocalTrainer, term, seqs: list[Seq], dtype, obs_mask=None):
    """``jax.grad`` of the term through the model (no runner): (loss, metrics, param grads)."""
    tokens, lengths, fields = padded(seqs, dtype)
    if obs_mask is not None:
        fields["obs_mask"] = np.asarray(obs_mask, dtype)
    batch = losses.Batch(**fields)
    key = (id(term), trainer.config)
    if key not in _DIRECT:  # one compilation per (term, model); masks are data

        @jax.jit
        def run(params, tokens, lengths, batch):
            def loss(p):
                return term(trainer.token_logprobs(p, tokens, lengths), batch)

            return jax.value_and_grad(loss, has_aux=True)(params)

        _DIRECT[key] = (run, term)  # keep the term alive so its id stays unique
    run = _DIRECT[key][0]
    (value, metrics), grads = run(trainer.params, tokens, lengths, batch)
    return float(value), {k: float(v) for k, v in metrics.items()}, flat(grads)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def run_path(cfg, runner: StepRunner, seqs, kwargs, precompute):
    """One runner path on a fresh trainer: (loss, flat grads, trainer counters, step metrics)."""
    trainer = LocalTrainer(cfg)
    kw = dict(kwargs)
    if precompute:
        kw["forward"] = trainer.forward([s.with_inputs() for s in seqs])
        trainer.counters.update(forward=0, backward=0)
    metrics = runner.accumulate(trainer, seqs, **kw)
    counts = (trainer.counters["forward"], trainer.counters["backward"])
    return metrics["loss"], flat(trainer.accumulated_grads()), counts, metrics


def equivalence(quick: bool, num_seqs: int, seed: int) -> list[dict]:
    trajs = trajectories(num_seqs, seed, quick)
    max_len = 1 << (max(len(t.tokens) for t in trajs) - 2).bit_length()
    rows = []
    for dtype_name in ("float64", "float32"):
        dtype = np.float64 if dtype_name == "float64" else np.float32
        cfg = model_config(quick, dtype_name, max_len)
        seqs = make_seqs(LocalTrainer(cfg), trajs, seed)
        for term_name, term in TERMS.items():
            v_direct, _, g_direct = direct_grad(LocalTrainer(cfg), term, seqs, dtype)
            scale = float(np.max(np.abs(g_direct)))
            base = dict(dtype=dtype_name, term=term_name, tolerance=TOLERANCE[dtype_name])
            rows.append(
                dict(
                    base,
                    path="direct (jax.grad)",
                    status="reference",
                    loss=v_direct,
                    grad_max_abs=scale,
                    max_abs_diff=0.0,
                    max_rel_diff=0.0,
                    forwards=None,
                    backwards=None,
                    note="jax.grad through the model, no trainer passes",
                )
            )
            # One runner per mode: its jitted client loss compiles once per bucket, not per path.
            runners = {mode: StepRunner(term, mode=mode, dtype=dtype) for _, mode, *_ in PATHS}
            for name, mode, kwargs, precompute, in_quick in PATHS:
                if quick and not in_quick:
                    continue
                try:
                    value, g, (fwd, bwd), metrics = run_path(
                        cfg, runners[mode], seqs, kwargs, precompute
                    )
                except ValueError as exc:
                    rows.append(
                        dict(
                            base,
                            path=name,
                            status="n/a",
                            loss=None,
                            max_abs_diff=None,
                            max_rel_diff=None,
                            forwards=None,
                            backwards=None,
                            note="not possible: no builtin kernel expresses the KL term"
                            if "kl" in term_name
                            else f"error: {exc}",
                        )
                    )
                    continue
                diff = float(np.max(np.abs(g - g_direct)))
                rel = diff / max(scale, 1e-300)
                step_counts = (metrics["passes/forwards"], metrics["passes/backwards"])
                note = "+1 forward already run (reused)" if precompute else ""
                if step_counts != (fwd, bwd):  # the runner's own count must match the trainer's
                    note += f" step reported {step_counts}"
                rows.append(
                    dict(
                        base,
                        path=name,
                        status="ok" if rel <= TOLERANCE[dtype_name] else "FAIL",
                        loss=value,
                        loss_diff=abs(value - v_direct),
                        max_abs_diff=diff,
                        max_rel_diff=rel,
                        forwards=fwd,
                        backwards=bwd,
                        note=note.strip(),
                    )
                )
    return rows


def conventions(quick: bool, num_seqs: int, seed: int) -> dict:
    """Managed vs paper ECHO observation masks on the same float64 batch (direct gradients)."""
    trajs = trajectories(num_seqs, seed, quick)
    max_len = 1 << (max(len(t.tokens) for t in trajs) - 2).bit_length()
    cfg = model_config(quick, "float64", max_len)
    trainer = LocalTrainer(cfg)
    seqs = make_seqs(trainer, trajs, seed)
    _, lengths, fields = padded(seqs, np.float64)
    valid = (np.arange(fields["action_mask"].shape[1])[None, :] < (lengths - 1)[:, None]).astype(
        np.float64
    )
    prompt_lengths = np.array([t.prompt_length for t in trajs])
    masks = {
        "paper (prompt excluded)": losses.observation_mask(
            fields["action_mask"], valid, prompt_lengths=prompt_lengths, include_prompt=False
        ),
        "managed (prompt included)": losses.observation_mask(
            fields["action_mask"], valid, include_prompt=True
        ),
        "env bodies only (paper O')": fields["obs_mask"],
    }
    env_term = losses.echo_env(coef=COEF)
    fold_term = TERMS["grpo+echo"]
    results = {}
    for name, mask in masks.items():
        mask = np.asarray(mask, np.float64)
        v_env, m_env, g_env = direct_grad(trainer, env_term, seqs, np.float64, obs_mask=mask)
        v_fold, _, g_fold = direct_grad(trainer, fold_term, seqs, np.float64, obs_mask=mask)
        results[name] = dict(
            targets=int(mask.sum()),
            env_loss=v_env,
            env_nll=m_env["nll"],
            env_grad=g_env,
            fold_loss=v_fold,
            fold_grad=g_fold,
        )
    paper = results["paper (prompt excluded)"]
    rows = []
    for name, r in results.items():
        d_env = float(np.linalg.norm(r["env_grad"] - paper["env_grad"]))
        d_fold = float(np.linalg.norm(r["fold_grad"] - paper["fold_grad"]))
        rows.append(
            dict(
                convention=name,
                obs_targets=r["targets"],
                extra_targets_vs_paper=r["targets"] - paper["targets"],
                env_loss=r["env_loss"],
                env_nll_per_token=r["env_nll"],
                env_grad_norm=float(np.linalg.norm(r["env_grad"])),
                env_grad_diff_norm=d_env,
                env_grad_diff_rel=d_env / float(np.linalg.norm(paper["env_grad"])),
                fold_loss=r["fold_loss"],
                fold_grad_diff_norm=d_fold,
                fold_grad_diff_rel=d_fold / float(np.linalg.norm(paper["fold_grad"])),
            )
        )
    return dict(
        rows=rows,
        sequences=len(seqs),
        prompt_targets=int(sum(int(p) - 1 for p in prompt_lengths)),
        echo_normalization="seq_mean_token_mean",
        coef=COEF,
    )


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=None, help="trajectories (default 24; quick 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arch",
        choices=("gpt2", "llama"),
        default="gpt2",
        help="the local trainer's model: the GPT-2-style default or a small Llama decoder",
    )
    args = p.parse_args(argv)
    ARCH["name"] = args.arch
    num = args.seqs or (6 if args.quick else 24)
    eq = equivalence(args.quick, num, args.seed)
    conv = conventions(args.quick, num, args.seed)

    cols = [
        "dtype",
        "term",
        "path",
        "max abs diff",
        "max rel diff",
        "loss diff",
        "tol",
        "trainer F",
        "trainer B",
        "status",
    ]
    md = [
        _common.table(
            "Parameter gradient vs direct jax.grad",
            cols,
            [
                [
                    r["dtype"],
                    r["term"],
                    r["path"],
                    r["max_abs_diff"],
                    r["max_rel_diff"],
                    r.get("loss_diff"),
                    r["tolerance"],
                    r["forwards"],
                    r["backwards"],
                    r["status"] + (f" ({r['note']})" if r.get("note") else ""),
                ]
                for r in eq
            ],
        )
    ]
    md.append(
        _common.table(
            f"ECHO observation conventions (float64, {conv['sequences']} sequences, "
            f"echo_env coef={COEF}, {conv['echo_normalization']})",
            [
                "convention",
                "obs targets",
                "extra vs paper",
                "env loss",
                "‖grad env‖",
                "‖Δgrad env‖ (rel)",
                "fold loss",
                "‖Δgrad fold‖ (rel)",
            ],
            [
                [
                    r["convention"],
                    r["obs_targets"],
                    r["extra_targets_vs_paper"],
                    f"{r['env_loss']:.6g}",
                    r["env_grad_norm"],
                    f"{_common.fmt(r['env_grad_diff_norm'])} ({_common.fmt(r['env_grad_diff_rel'])})",
                    f"{r['fold_loss']:.6g}",
                    f"{_common.fmt(r['fold_grad_diff_norm'])} ({_common.fmt(r['fold_grad_diff_rel'])})",
                ]
                for r in conv["rows"]
            ],
        )
    )
    checked = [r for r in eq if r["status"] in ("ok", "FAIL")]
    ok = all(r["status"] == "ok" for r in checked)
    managed = next(r for r in conv["rows"] if r["convention"].startswith("managed"))
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(
            quick=args.quick,
            sequences=num,
            seed=args.seed,
            model=dict(
                model_size(args.quick), arch=args.arch, vocab_size=tokenizer.VOCAB_SIZE, seed=0
            ),
            data="calculator-env expert trajectories (CalcEnv(seed, max_operand=99, "
            "num_ops=(1, 3))); sampling = current logprobs + N(0, 0.3); advantages ~ N(0, 1)",
            terms=list(TERMS),
            tolerance=TOLERANCE,
        ),
        equivalence=eq,
        all_within_tolerance=ok,
        conventions=conv,
        conventions_differ=managed["env_grad_diff_rel"] > 1e-3,
        markdown="\n\n".join(md),
    )
    print(
        f"\nall paths within tolerance: {ok}; managed vs paper env-gradient relative difference "
        f"{managed['env_grad_diff_rel']:.3g} ({managed['extra_targets_vs_paper']} extra targets)"
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    payload = main()
    sys.exit(0 if payload["all_within_tolerance"] else 1)
