"""One step of each phase of the main job, and its evaluations.

* `sft_step` — a batch of rendered records through the SFT translation path (collate →
  translate → the trainer's ``cross_entropy``), loss on assistant tokens, per-token mean;
* `eval_nll` — the per-token NLL of assistant tokens on ``[sft].eval_data`` (forward only);
* `rl_step` — the task's problems → ``group_size`` episodes each (`runner.tasks.rollout`) → group
  advantages → one planned step of the RL loss (`runner.StepRunner`);
* `evaluate` — mean reward on the task's held-out problems.

Every random choice of step ``k`` is drawn from ``(seed, k)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import losses
from runner._step import StepRunner
from runner._types import AdamParams, Seq, make_seq
from runner.data import Example, as_sft_examples
from runner.sft import collate_sft, translate_sft_batch
from runner.tasks import LoadedTask, episode_to_seq, rollout, rollout_metrics

#: Held-out problems of `evaluate` when the task has no ``eval_problems()``.
EVAL_PROBLEMS = 64


def step_rng(cfg: Any, *key: int) -> np.random.Generator:
    return np.random.default_rng([cfg.run.seed, *key])


def adam(cfg: Any, lr: float) -> AdamParams:
    o = cfg.optim
    return AdamParams(
        learning_rate=lr,
        beta1=o.beta1,
        beta2=o.beta2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        grad_clip_norm=o.grad_clip_norm,
    )


def sft_step(cfg: Any, trainer: Any, examples: Sequence[Example], pad_id: int) -> dict[str, float]:
    """One SFT step on ``examples`` (weights: their assistant masks, normalized over the batch)."""
    sequences, attention, loss_mask = collate_sft(as_sft_examples(examples), pad_id=pad_id)
    seqs = translate_sft_batch(sequences, attention, loss_mask, max_seq_len=cfg.model.max_seq_len)
    result = trainer.forward_backward(seqs, "cross_entropy")
    opt = trainer.optim_step(adam(cfg, cfg.sft.learning_rate), "none")
    tokens = sum(s.num_targets for s in seqs)
    return {
        **sft_nll(seqs, result),
        "tokens": float(tokens),
        "passes/forwards": 1.0,
        "passes/backwards": 1.0,
        **{f"optim/{k}": float(v) for k, v in opt.items()},
    }


def sft_nll(seqs: Sequence[Seq], result: Any) -> dict[str, float]:
    """The SFT batch's per-token mean NLL (its weights sum to 1) and where it came from.

    The server's ``loss:sum`` where it reports one (``sft/nll_from_logprobs = 0``), else
    ``Σ −w·logp`` of the logprobs it returned (``= 1``; a server may omit ``loss:sum``, e.g.
    SkyRL tx), else no ``sft/nll`` (a server that returns neither).
    """
    if "loss:sum" in result.metrics:
        return {"sft/nll": float(result.metrics["loss:sum"]), "sft/nll_from_logprobs": 0.0}
    if result.logprobs and len(result.logprobs) == len(seqs):
        total = sum(
            -float(np.dot(np.asarray(s.inputs["weights"], np.float64), np.asarray(lp, np.float64)))
            for s, lp in zip(seqs, result.logprobs, strict=True)
        )
        return {"sft/nll": total, "sft/nll_from_logprobs": 1.0}
    return {}


def eval_nll(trainer: Any, examples: Sequence[Example], batch_size: int) -> float:
    """Per-token NLL of the assistant tokens of ``examples`` at the current weights."""
    total, count = 0.0, 0.0
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo : lo + batch_size]
        lps = trainer.forward([make_seq(e.tokens, i) for i, e in enumerate(chunk)])
        for e, lp in zip(chunk, lps, strict=True):
            w = e.weights[1:]
            total -= float(np.dot(w, np.asarray(lp, np.float64)))
            count += float(w.sum())
    return total / max(count, 1.0)


def rl_seqs(cfg: Any, groups) -> tuple[list[Seq], np.ndarray]:
    """Episodes → `Seq`s with per-token advantages on action tokens; and the rewards."""
    rewards = np.array([e.reward for g in groups for e in g], dtype=np.float64)
    if all(len(g) == cfg.rl.group_size for g in groups):
        adv = np.asarray(
            losses.group_advantages(
                rewards, group_size=cfg.rl.group_size, estimator=cfg.rl.advantage_estimator
            )
        )
    else:  # groups that lost episodes ([rl].min_group_size): each with its own size
        adv = np.concatenate(
            [
                np.asarray(
                    losses.group_advantages(
                        np.array([e.reward for e in g], dtype=np.float64),
                        group_size=len(g),
                        estimator=cfg.rl.advantage_estimator,
                    )
                )
                for g in groups
            ]
        )
    seqs = []
    for a, episode in zip(adv, (e for g in groups for e in g), strict=True):
        s = episode_to_seq(episode)
        inputs = dict(s.inputs)
        inputs["advantages"] = float(a) * inputs["action_mask"]
        seqs.append(Seq(s.tokens, inputs))
    return seqs, rewards


def chunk_sizes(cfg: Any) -> list[int]:
    """Groups per pipeline chunk: ``[rl].problems_per_step`` cut into ``[rl].pipeline_chunks``
    balanced parts (the larger ones first)."""
    return [
        sl.stop - sl.start
        for sl in losses.row_slices(cfg.rl.problems_per_step, cfg.rl.pipeline_chunks)
    ]


class ChunkForwards:
    """The forwards of an RL step that need only its tokens, issued chunk by chunk.

    Called with each chunk's groups as soon as the chunk is complete (with the concurrent
    rollout: while the step's later groups still sample): the KL reference's forward when there
    is a reference, and with ``[rl].anchor = "old_policy"`` the trainer's forward at the weights
    about to be updated (the anchor ``old_logprobs``; on the client path it is also the step's
    own forward, so the anchor costs no pass there).

    Attributes:
      ref, old: per-row logprobs, in row order (empty when not computed).
      rows: rows per chunk.
      passes: forwards issued; ``streamed``: those issued before the step's last chunk.
    """

    def __init__(self, trainer: Any, reference: Any, *, anchor: str, chunks: int):
        self.trainer, self.reference, self.chunks = trainer, reference, chunks
        self.old_policy = anchor == "old_policy"
        self.ref: list[np.ndarray] = []
        self.old: list[np.ndarray] = []
        self.rows: list[int] = []
        self.passes = self.streamed = 0

    def __call__(self, groups: Sequence[Sequence[Any]]) -> None:
        seqs = [episode_to_seq(e).with_inputs() for g in groups for e in g]
        last = len(self.rows) == self.chunks - 1
        self.rows.append(len(seqs))
        for wanted, trainer, out in (
            (self.reference is not None, self.reference, self.ref),
            (self.old_policy, self.trainer, self.old),
        ):
            if wanted:
                out.extend(np.asarray(lp) for lp in trainer.forward(seqs))
                self.passes += 1
                self.streamed += not last

    def slices(self) -> list[slice] | None:
        """The chunks as row slices of the step's batch (``None``: one chunk)."""
        if len(self.rows) == 1:
            return None
        ends = np.cumsum([0, *self.rows])
        return [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:], strict=True)]

    def attach(self, seqs: Sequence[Seq]) -> list[Seq]:
        """``seqs`` with ``ref_logprobs`` and ``old_logprobs`` (on action tokens) added."""
        out = []
        for i, s in enumerate(seqs):
            inputs = dict(s.inputs)
            mask = inputs["action_mask"]
            if self.ref:
                inputs["ref_logprobs"] = np.asarray(self.ref[i], np.float64) * mask
            if self.old:
                inputs["old_logprobs"] = np.asarray(self.old[i], np.float64) * mask
            out.append(Seq(s.tokens, inputs))
        return out


def rl_step(
    cfg: Any,
    trainer: Any,
    task: LoadedTask,
    step: int,
    runner: StepRunner,
    reference: Any = None,
    rollouts: Any = None,
) -> dict[str, Any]:
    """Sample groups → rewards → group advantages → one planned step of the RL loss.

    ``rollouts``: a `runner._pipeline.RolloutService` (``[rl].rollout = "concurrent"``) that
    hands over the step's groups chunk by chunk (``[rl].pipeline_chunks``); ``None``: the
    lock-step rollout, here. Each chunk is one micro-batch of the step: its token-only forwards
    (`ChunkForwards`) run as soon as it is complete, its gradient passes once the step's last
    group is in (the normalizers span the whole step, so the gradient does not depend on the
    number of chunks).
    """
    sizes = chunk_sizes(cfg)
    forwards = ChunkForwards(trainer, reference, anchor=cfg.rl.anchor, chunks=len(sizes))
    if rollouts is not None:
        collected = rollouts.collect(step, chunk_sizes=sizes, on_chunk=forwards)
        groups = collected.groups
    else:
        rng = step_rng(cfg, 2, step)
        problems = task.problems(rng, cfg.rl.problems_per_step)
        groups = rollout(
            trainer,
            task,
            problems,
            group_size=cfg.rl.group_size,
            temperature=cfg.rl.temperature,
            seed=int(rng.integers(2**31)),
            max_seq_len=cfg.model.max_seq_len,
        )
        start = 0
        for size in sizes:
            forwards(groups[start : start + size])
            start += size
    seqs, rewards = rl_seqs(cfg, groups)
    seqs = forwards.attach(seqs)
    started = time.perf_counter()
    metrics = runner.step(
        trainer,
        seqs,
        adam(cfg, cfg.rl.learning_rate),
        num_microbatches=cfg.rl.num_microbatches,
        slices=forwards.slices(),
        forward=forwards.old or None,
    )
    # the trainer's share of the step: its gradient passes and optimizer step (not sampling,
    # rewards or the chunks' streamed forwards)
    metrics["time/train_s"] = time.perf_counter() - started
    metrics["passes/forwards"] += forwards.passes
    if rollouts is not None:
        metrics.update(rollouts.published(collected))
        metrics["async/streamed_forwards"] = float(forwards.streamed)
    episodes = [e for g in groups for e in g]
    metrics.update(
        {
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "turns": float(np.mean([e.num_turns for e in episodes])),
            "tokens": float(sum(s.num_targets for s in seqs)),
            **rollout_metrics(episodes),
        }
    )
    if metrics.get("echo_env/num_obs_tokens", 0.0) > 0:  # NLL per observation token, if any
        metrics["env_nll"] = float(metrics["echo_env/nll"])
    return metrics


def eval_problems(cfg: Any, task: LoadedTask) -> list[Any]:
    """The task's ``eval_problems()``, else `EVAL_PROBLEMS` problems drawn with ``rng(seed, 3)``
    (the same at every evaluation)."""
    if task.has_eval_problems:
        return task.eval_problems()
    return task.problems(step_rng(cfg, 3), EVAL_PROBLEMS)


def evaluate(cfg: Any, trainer: Any, task: LoadedTask, problems: Sequence[Any]) -> float:
    """Mean reward on ``problems``, one episode each, sampled at the RL temperature with a fixed
    seed (the same problems and seeds at every evaluation, so evaluations are comparable). A
    concurrent run (``[rl].rollout = "concurrent"``) evaluates with concurrent episodes too
    (`runner.tasks._async.concurrent_rollout`: other seeds, so not the lock-step numbers)."""
    run = rollout
    if cfg.rl.rollout == "concurrent":
        import functools

        from runner.tasks._async import concurrent_rollout

        run = functools.partial(
            concurrent_rollout,
            env_workers=cfg.rl.env_workers,
            sample_batch_ms=cfg.rl.sample_batch_ms,
        )
    groups = run(
        trainer,
        task,
        problems,
        group_size=1,
        temperature=cfg.rl.temperature,
        seed=cfg.run.seed + 12345,
        max_seq_len=cfg.model.max_seq_len,
    )
    return float(np.mean([g[0].reward for g in groups]))
