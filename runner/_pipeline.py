"""The concurrent RL rollout service: admission, concurrent episodes, bounded staleness.

``[rl].rollout = "concurrent"`` (docs/async.md) replaces the lock-step rollout of each RL step
by a `RolloutService` that lives for the whole RL phase. An event loop in a background thread
admits problem groups (`runner._admission.AdmissionController`: at most ``O =
[rl].max_off_policy_steps`` steps ahead of the trainer, at most ``C =
[rl].max_concurrent_rollouts`` episodes in flight), runs their episodes concurrently
(`runner.tasks._async`) and queues each finished group. The trainer's step takes the next
``[rl].problems_per_step`` groups in admission order (`RolloutService.collect`), trains them,
and publishes the new version (`RolloutService.published`), which opens the admission of more
groups. With ``O > 0`` the groups of the next steps sample while the trainer trains.

The problems are the lock-step run's: the ``n``-th admitted group is problem ``n mod P`` of RL
step ``n // P``, drawn with that step's generator (``(seed, 2, step)``), and its seeds come from
that step's seed (`runner.tasks._async.stream_key`). So with ``O = 0`` each step trains exactly
the problems the lock-step run would, and a resumed run re-samples from the first problem after
its checkpoint: nothing is trained twice or skipped. Every action carries the version that
sampled it (`Episode.versions`); the metrics report how stale the trained tokens were.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runner._admission import AdmissionController, Ticket
from runner.tasks._async import (
    Activity,
    CircuitBreaker,
    EnvCalls,
    EpisodeFailed,
    SampleBatcher,
    run_episode,
)
from runner.tasks._load import LoadedTask
from runner.tasks._rollout import Episode, set_group_rewards, task_error

#: ``[rl].rollout`` values.
ROLLOUTS = ("lockstep", "concurrent")
#: `RolloutService.close` waits this long for the event loop's thread (the sample call in
#: flight, which cannot be interrupted, is the usual wait).
CLOSE_TIMEOUT_S = 120.0

log = logging.getLogger("runner.rollouts")


#: ``[rl].anchor``: the PPO/GRPO anchor ``old_logprobs`` of the trained tokens. ``sampler``: the
#: sampler's logprobs (the anchor is the behaviour policy); ``old_policy``: one trainer forward
#: per chunk at the weights about to be updated (the importance corrections of `losses` then
#: weight by sampler vs old policy).
ANCHORS = ("sampler", "old_policy")


def validate_async(cfg: Any) -> None:
    """The ``[rl]`` knobs of asynchronous RL (``ValueError`` naming the field)."""
    rl = cfg.rl
    if rl.rollout not in ROLLOUTS:
        raise ValueError(f"config [rl].rollout must be one of {ROLLOUTS}, got {rl.rollout!r}")
    if rl.env_workers < 1:
        raise ValueError(f"config [rl].env_workers must be >= 1, got {rl.env_workers}")
    if not 0 <= rl.sample_batch_ms <= 10_000:
        raise ValueError(
            f"config [rl].sample_batch_ms must be in [0, 10000], got {rl.sample_batch_ms}"
        )
    if rl.max_off_policy_steps < 0:
        raise ValueError(
            f"config [rl].max_off_policy_steps must be >= 0, got {rl.max_off_policy_steps}"
        )
    c = rl.max_concurrent_rollouts
    if c and c < rl.group_size:
        raise ValueError(
            f"config [rl].max_concurrent_rollouts = {c} is below [rl].group_size = "
            f"{rl.group_size} (a whole group is admitted at once); 0 = one step's episodes"
        )
    if rl.env_timeout_s < 0:
        raise ValueError(f"config [rl].env_timeout_s must be >= 0, got {rl.env_timeout_s}")
    if rl.min_group_size and not 2 <= rl.min_group_size <= rl.group_size:
        raise ValueError(
            f"config [rl].min_group_size must be 0 (the whole group) or in [2, [rl].group_size = "
            f"{rl.group_size}], got {rl.min_group_size}"
        )
    if rl.max_fill_rounds < 0:
        raise ValueError(f"config [rl].max_fill_rounds must be >= 0, got {rl.max_fill_rounds}")
    if not 1 <= rl.pipeline_chunks <= rl.problems_per_step:
        raise ValueError(
            f"config [rl].pipeline_chunks must be in [1, [rl].problems_per_step = "
            f"{rl.problems_per_step}] (a chunk holds whole groups), got {rl.pipeline_chunks}"
        )
    if rl.num_microbatches > 1 and rl.pipeline_chunks > 1:
        raise ValueError(
            "config [rl].num_microbatches and [rl].pipeline_chunks cannot both exceed 1 (each "
            "chunk is one micro-batch of the step; set one of them)"
        )
    if rl.anchor not in ANCHORS:
        raise ValueError(f"config [rl].anchor must be one of {ANCHORS}, got {rl.anchor!r}")
    if rl.rollout == "lockstep":
        for key in (
            "max_off_policy_steps",
            "max_concurrent_rollouts",
            "env_timeout_s",
            "min_group_size",
            "drop_uniform_groups",
        ):
            if getattr(rl, key):
                raise ValueError(
                    f'config [rl].{key} needs [rl].rollout = "concurrent" (the lock-step rollout '
                    "samples one step at a time)"
                )


def start_rollouts(
    cfg: Any, sampler: Any, task: LoadedTask, step: int, manifest: dict[str, Any] | None
) -> RolloutService:
    """The service for a run whose next step is RL step ``step``, continuing from the
    checkpoint ``manifest`` of step ``step - 1`` when it recorded one (a resumed run)."""
    saved = (manifest or {}).get("run_state", {})
    state = saved.get("rollouts") if saved.get("step") == step - 1 else None
    return RolloutService(cfg, sampler, task, first_step=step, state=state)


@dataclasses.dataclass
class Collected:
    """One step's groups as `RolloutService.collect` hands them to the trainer."""

    groups: list[list[Episode]]
    problem_ids: list[str]
    version: int  # the policy version being trained (RL steps published before this one)
    started: float  # perf_counter when collect was called
    waited_s: float  # how long the trainer waited for the groups
    in_flight: int  # episodes in flight (of later steps) when the groups were handed over
    dropped: int = 0  # episodes lost to recoverable failures (kept and rejected groups)
    rejected: int = 0  # groups rejected for failures (fewer than [rl].min_group_size left)
    uniform: int = 0  # groups dropped for equal rewards ([rl].drop_uniform_groups)


class RolloutService:
    """Concurrent rollouts for the RL phase (module docstring).

    Args:
      cfg: the run's `runner.config.Config`.
      sampler: the trainer (its ``sample``).
      task: the loaded task.
      first_step: the global step number of the next RL step (a resumed run's first).
    """

    def __init__(
        self,
        cfg: Any,
        sampler: Any,
        task: LoadedTask,
        *,
        first_step: int,
        state: dict[str, Any] | None = None,
    ):
        rl = cfg.rl
        self.cfg, self.task = cfg, task
        self.problems, self.group = rl.problems_per_step, rl.group_size
        batch = self.problems * self.group
        self.first_rl = cfg.sft.steps + 1  # the global step of RL index 0
        start = first_step - self.first_rl
        self.controller = AdmissionController(
            batch_episodes=batch,
            group_size=self.group,
            max_off_policy_steps=rl.max_off_policy_steps,
            max_concurrent=rl.max_concurrent_rollouts or batch,
        )
        self.controller.start_at(start)
        # the next problem slot to admit: after the last one a checkpointed step consumed
        self.next_slot = int((state or {}).get("next_slot", start * self.problems))
        self.durable_slot = self.next_slot
        self.total_episodes = rl.steps * batch  # no admission beyond the run's last step
        self.next_order = 0  # the next admitted group the trainer takes
        self.min_group = rl.min_group_size or self.group
        self.drop_uniform, self.fill_rounds = rl.drop_uniform_groups, rl.max_fill_rounds
        self._credits: list[int] = []  # fill rounds owed to replacements of uniform groups
        self._rounds: dict[int, int] = {}  # order -> its fill round
        self.breaker = CircuitBreaker()
        self._schedule: dict[int, tuple[list[Any], int]] = {}
        # order -> (slot, episodes, outcome, dropped): outcome "kept", "rejected" or "uniform"
        self._done: dict[int, tuple[int, list[Episode], str, int]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.activity = Activity()
        self.envs = EnvCalls(workers=rl.env_workers, timeout_s=rl.env_timeout_s)
        self.batcher = SampleBatcher(
            sampler,
            max_tokens=task.max_tokens_per_turn,
            temperature=rl.temperature,
            stop_token_ids=task.stop_token_ids,
            batch_ms=rl.sample_batch_ms,
            expected=self.activity.waiting,
            version=lambda: self.controller.version,
        )
        self.loop = asyncio.new_event_loop()
        self._admit: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="rollouts", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()

    # -- the event loop's side -------------------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._admit = asyncio.Event()
        self._stop = asyncio.Event()
        self.batcher.start()
        admitting = asyncio.get_running_loop().create_task(self._admission())
        self._ready.set()
        await self._stop.wait()
        admitting.cancel()
        # Cancelled until done: a task can outlive one cancel (a library that catches it, or
        # ``asyncio.wait_for`` on Python 3.11, which loses a cancel racing its inner future).
        while pending := asyncio.all_tasks() - {asyncio.current_task()}:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.5)
        await self.batcher.close()

    def step_problems(self, index: int) -> tuple[list[Any], int]:
        """RL step ``index``'s problems and seed, drawn as the lock-step `runner.steps.rl_step`
        draws them."""
        if index not in self._schedule:
            from runner.steps import step_rng

            rng = step_rng(self.cfg, 2, self.first_rl + index)
            problems = self.task.problems(rng, self.problems)
            self._schedule[index] = (problems, int(rng.integers(2**31)))
        return self._schedule[index]

    async def _admission(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ctl = self.controller
            while ctl.can_admit() and ctl.trained + ctl.reserved < self.total_episodes:
                ticket = ctl.admit()
                slot, self.next_slot = self.next_slot, self.next_slot + 1
                self._rounds[ticket.order] = self._credits.pop(0) if self._credits else 0
                loop.create_task(self._run_group(ticket, slot))
            self._admit.clear()
            await self._admit.wait()

    async def _run_group(self, ticket: Ticket, slot: int) -> None:
        index, i = divmod(slot, self.problems)
        try:
            problems, seed = self.step_problems(index)
            episodes = [
                Episode(self.task, problems[i], i, self.cfg.model.max_seq_len, start=False)
                for _ in range(self.group)
            ]
            self.activity.live += self.group
            runs = [
                run_episode(
                    e,
                    step_seed=seed,
                    sample=k,
                    problems=self.problems,
                    group_size=self.group,
                    envs=self.envs,
                    batcher=self.batcher,
                    activity=self.activity,
                )
                for k, e in enumerate(episodes)
            ]
            results = await asyncio.gather(*runs, return_exceptions=True)
            fatal = [r for r in results if isinstance(r, BaseException)]
            fatal = [r for r in fatal if not isinstance(r, EpisodeFailed)]
            if fatal:
                raise fatal[0]
            kept = []
            for r in results:
                failed = isinstance(r, EpisodeFailed)
                self.breaker.observe(failed, str(r) if failed else "")
                if not failed:
                    kept.append(r)
            outcome = "kept" if len(kept) >= self.min_group else "rejected"
            if outcome == "kept" and self.task.has_group_rewards:
                try:
                    values = await self.envs.call(self.task.task.group_rewards, problems[i], kept)
                except Exception as exc:
                    raise task_error(kept[0].where, "group_rewards", exc) from exc
                set_group_rewards(kept, values)
            round_ = self._rounds.pop(ticket.order, 0)
            if outcome == "kept" and self.drop_uniform and round_ < self.fill_rounds:
                if len({e.reward for e in kept}) == 1:
                    outcome = "uniform"
                    self._credits.append(round_ + 1)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            with self._cond:
                if self._error is None:
                    self._error = exc
                self._cond.notify_all()
            return
        self.controller.finish(ticket, kept=outcome == "kept")
        with self._cond:
            self._done[ticket.order] = (slot, kept, outcome, self.group - len(kept))
            self._cond.notify_all()
        self._admit.set()

    def _on_publish(self, episodes: int) -> None:
        self.controller.train(episodes)
        self.controller.publish()
        self._admit.set()

    # -- the trainer's side ------------------------------------------------------------------------

    def collect(
        self,
        step: int,
        *,
        chunk_sizes: Sequence[int] | None = None,
        on_chunk: Callable[[list[list[Episode]]], None] | None = None,
    ) -> Collected:
        """Waits for step ``step``'s groups: the next ``problems_per_step`` kept groups in
        admission order (rejected and uniform groups on the way are counted and skipped).

        Args:
          chunk_sizes: groups per chunk (summing to ``problems_per_step``; default one chunk).
          on_chunk: called with each chunk's groups, in order, as soon as the chunk is complete
            (on the calling thread, while later groups still sample: `runner.steps` streams
            the trainer's forwards this way). Its time does not count as waiting.
        """
        sizes = list(chunk_sizes or [self.problems])
        if sum(sizes) != self.problems or min(sizes) < 1:
            raise ValueError(
                f"chunk_sizes {sizes} must be positive and sum to {self.problems} groups"
            )
        started = time.perf_counter()
        version = step - self.first_rl
        taken: list[tuple[int, list[Episode]]] = []
        counts = {"dropped": 0, "rejected": 0, "uniform": 0}
        waited = 0.0
        for size in sizes:
            wait_from = time.perf_counter()
            chunk = self._take(size, counts)
            waited += time.perf_counter() - wait_from
            taken.extend(chunk)
            if on_chunk is not None:
                on_chunk([episodes for _, episodes in chunk])
        if version != self.controller.version:
            raise RuntimeError(
                f"RolloutService.collect: step {step} trains version {version}, but version "
                f"{self.controller.version} is published"
            )
        return Collected(
            groups=[episodes for _, episodes in taken],
            problem_ids=[self.problem_id(slot) for slot, _ in taken],
            version=version,
            started=started,
            waited_s=waited,
            in_flight=self.controller.in_flight,
            **counts,
        )

    def _take(self, n: int, counts: dict[str, int]) -> list[tuple[int, list[Episode]]]:
        """The next ``n`` kept groups in admission order, waiting for them."""
        taken: list[tuple[int, list[Episode]]] = []
        with self._cond:
            while len(taken) < n:
                while self._error is None and self.next_order not in self._done:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
                slot, episodes, outcome, dropped = self._done.pop(self.next_order)
                self.next_order += 1
                self.durable_slot = slot + 1
                counts["dropped"] += dropped
                if outcome == "kept":
                    taken.append((slot, episodes))
                else:
                    counts[outcome] += 1
        return taken

    def durable_state(self) -> dict[str, Any]:
        """What a checkpoint after the last collected step records: the first problem slot not
        consumed by a trained step (in-flight work after it is re-sampled on resume)."""
        return {"next_slot": self.durable_slot}

    def problem_id(self, slot: int) -> str:
        """``"<global step>:<index>"``: the lock-step step and position that define a problem."""
        index, i = divmod(slot, self.problems)
        return f"{self.first_rl + index}:{i}"

    def published(self, collected: Collected) -> dict[str, Any]:
        """The trained step's optimizer step is done: publishes the next version; returns the
        step's ``async/*`` metrics and its ``data/problems``."""
        episodes = self.problems * self.group  # the step's budget, whatever was dropped
        done = threading.Event()

        def publish() -> None:
            self._on_publish(episodes)
            done.set()

        self.loop.call_soon_threadsafe(publish)
        done.wait()
        offsets = np.concatenate(
            [
                np.repeat(
                    collected.version - np.asarray(e.versions, np.int64),
                    [len(s.tokens) for s in e.segments if s.kind == "action"],
                )
                for g in collected.groups
                for e in g
                if e.versions
            ]
            or [np.zeros(0, np.int64)]
        )
        total = max(time.perf_counter() - collected.started, 1e-9)
        return {
            "async/version_offset_mean": float(offsets.mean()) if offsets.size else 0.0,
            "async/version_offset_max": float(offsets.max()) if offsets.size else 0.0,
            "async/in_flight": float(collected.in_flight),
            "async/trainer_idle_frac": collected.waited_s / total,
            "rollout/dropped": float(collected.dropped),
            "rollout/rejected_groups": float(collected.rejected),
            "rollout/uniform_groups": float(collected.uniform),
            "data/problems": collected.problem_ids,
        }

    def close(self) -> None:
        """Stops the loop (in-flight episodes are abandoned) and the worker threads."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():  # a sampler call that does not return: left behind
                log.warning(
                    "the rollout service did not stop within %g s (a sample call still "
                    "running); its daemon thread is left behind",
                    CLOSE_TIMEOUT_S,
                )
                self.envs.close()
                return
        self.loop.close()
        self.envs.close()
