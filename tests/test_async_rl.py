"""Asynchronous RL (`runner.tasks._async`, `runner._admission`, `runner._pipeline`): concurrent
episodes whose samples do not depend on arrival order, bounded staleness by admission, the
lock-step default untouched."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner._admission import AdmissionController
from runner._pipeline import RolloutService
from runner.config import Config, identity_of, load_config
from runner.job import build_task, build_tokenizer
from runner.tasks import rollout
from runner.tasks._async import stream_key

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
CONCURRENT = ['rl.rollout="concurrent"', "rl.problems_per_step=3"]


@pytest.fixture(scope="module")
def tiny():
    """The tiny config (concurrent rollouts, 3 problems a step), its task and a local trainer."""
    from runner.local import LocalTrainer, local_trainer_config

    cfg = load_config(TINY, CONCURRENT)
    tokenizer = build_tokenizer(cfg)
    trainer = LocalTrainer(
        local_trainer_config(
            cfg.model, vocab_size=tokenizer.vocab_size, seed=0, checkpoint_dir=None
        )
    )
    return cfg, build_task(cfg, tokenizer), trainer


class _Jitter:
    """An environment that sleeps a random time (a shared RNG) before each call."""

    def __init__(self, env, rng, lock):
        self.env, self.rng, self.lock = env, rng, lock

    def _nap(self, scale):
        with self.lock:
            seconds = self.rng.random() * scale
        time.sleep(seconds)

    def initial_observation(self):
        self._nap(0.01)
        return self.env.initial_observation()

    def step(self, action):
        self._nap(0.02)
        return self.env.step(action)


class _AsyncJitter(_Jitter):
    async def initial_observation(self):
        await asyncio.sleep(0.005)
        return self.env.initial_observation()

    async def step(self, action):
        with self.lock:
            seconds = self.rng.random() * 0.02
        await asyncio.sleep(seconds)
        return self.env.step(action)


class _JitterTask:
    def __init__(self, task, seed, env_class=_Jitter):
        self.task, self.rng, self.lock, self.env_class = (
            task,
            random.Random(seed),
            threading.Lock(),
            env_class,
        )

    def __getattr__(self, name):
        return getattr(self.task, name)

    def make_env(self, problem):
        return self.env_class(self.task.make_env(problem), self.rng, self.lock)


def _collect(cfg, task, trainer, step):
    service = RolloutService(cfg, trainer, task, first_step=step)
    try:
        return service.collect(step), service.batcher.calls
    finally:
        service.close()


def _same_episodes(a, b):
    assert len(a) == len(b)
    for ga, gb in zip(a, b, strict=True):
        for ea, eb in zip(ga, gb, strict=True):
            assert [s.kind for s in ea.segments] == [s.kind for s in eb.segments]
            for sa, sb in zip(ea.segments, eb.segments, strict=True):
                np.testing.assert_array_equal(sa.tokens, sb.tokens)
                np.testing.assert_array_equal(sa.targets, sb.targets)
                # float32 rounding differs between batch shapes (1 ulp), never the tokens
                np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)
            assert (ea.reward, ea.stop, ea.num_turns) == (eb.reward, eb.stop, eb.num_turns)


def test_concurrent_samples_do_not_depend_on_arrival_order(tiny):
    """The same step under random environment latencies (threads, then coroutines) samples the
    same tokens as without: seeds come from (step, problem, sample, turn), not from batching."""
    cfg, task, trainer = tiny
    step = cfg.sft.steps + 1
    plain, calls = _collect(cfg, task, trainer, step)
    assert calls < sum(e.num_turns for g in plain.groups for e in g)  # requests were batched
    for env_class, seed in ((_Jitter, 0), (_AsyncJitter, 1)):
        jittered = dataclasses.replace(task, task=_JitterTask(task.task, seed, env_class))
        other, _ = _collect(cfg, jittered, trainer, step)
        _same_episodes(plain.groups, other.groups)
    # the problems are the lock-step run's problems of that step
    from runner.steps import step_rng

    expected = task.problems(step_rng(cfg, 2, step), cfg.rl.problems_per_step)
    assert [g[0].problem for g in plain.groups] == expected
    assert plain.problem_ids == [f"{step}:{i}" for i in range(cfg.rl.problems_per_step)]
    assert all(e.versions == [0] * e.num_turns for g in plain.groups for e in g)


def test_async_env_under_lockstep_equals_the_sync_env(tiny):
    """``async def`` environment methods work in the lock-step rollout too (awaited in place)."""
    cfg, task, trainer = tiny
    problems = task.problems(np.random.default_rng(3), 2)
    kwargs = dict(group_size=2, seed=5, max_seq_len=cfg.model.max_seq_len)
    a = rollout(trainer, task, problems, **kwargs)
    wrapped = dataclasses.replace(task, task=_JitterTask(task.task, 0, _AsyncJitter))
    b = rollout(trainer, wrapped, problems, **kwargs)
    _same_episodes(a, b)


def test_stream_keys_are_distinct_per_turn_problem_and_sample():
    keys = {
        stream_key(7, problem=p, sample=s, turn=t, problems=3, group_size=4)
        for p in range(3)
        for s in range(4)
        for t in range(5)
    }
    assert len(keys) == 3 * 4 * 5 and {seed for seed, _ in keys} == {7}
    with pytest.raises(ValueError, match="outside"):
        stream_key(7, problem=3, sample=0, turn=0, problems=3, group_size=4)


def test_a_bounded_env_call_never_loses_a_cancel():
    """`bounded` (every time limit of the rollout service) keeps a cancel that races the call's
    completion; ``asyncio.wait_for`` on Python 3.11 loses about 4 in 10 of these, and the episode
    that swallowed its cancel left a stopped service waiting forever."""
    import concurrent.futures

    from runner.tasks._async import bounded

    pool = concurrent.futures.ThreadPoolExecutor(2)

    async def episode():
        loop = asyncio.get_running_loop()
        await bounded(loop.run_in_executor(pool, time.sleep, 0.001), 1.0)
        await asyncio.Event().wait()  # as a cancelled batcher's future: never set

    async def main():
        alive = 0
        for i in range(300):
            task = asyncio.get_running_loop().create_task(episode())
            await asyncio.sleep(0.0005 * (i % 4))  # the cancel lands before, at or after the end
            task.cancel()
            await asyncio.wait([task], timeout=0.05)
            alive += not task.done()
            task.cancel()
        return alive

    try:
        assert asyncio.run(main()) == 0
    finally:
        pool.shutdown()


# -- bounded staleness -----------------------------------------------------------------------------


def _simulate(P, G, O, C, turns, latencies, train_time):
    """A toy event simulation of the service: groups admitted by the controller, each episode's
    turns sampled at the version current when the turn starts, the trainer taking the next ``P``
    finished groups in admission order. Returns per step the trained turns' version offsets."""
    ctl = AdmissionController(
        batch_episodes=P * G, group_size=G, max_off_policy_steps=O, max_concurrent=C
    )
    rng = random.Random(latencies)
    clock, events, seq = 0.0, [], 0
    steps, total_steps = [], 4
    next_slot, end_slot = 0, total_steps * P
    done, groups = {}, {}
    next_order, training_until = 0, None

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    while len(steps) < total_steps:
        while next_slot < end_slot and ctl.can_admit():
            ticket = ctl.admit()
            next_slot += 1
            eps = [{"versions": [], "left": turns} for _ in range(G)]
            groups[ticket.order] = (ticket, eps)
            for k in range(G):
                push(clock, "turn", (ticket.order, k))
        assert ctl.in_flight <= C
        want = range(next_order, next_order + P)
        if training_until is None and all(o in done for o in want):
            version = ctl.version
            offsets = [version - v for o in want for e in groups[o][1] for v in e["versions"]]
            steps.append(offsets)
            next_order += P
            training_until = clock + train_time
            push(training_until, "trained", None)
        t, _, kind, payload = heapq.heappop(events)
        clock = t
        if kind == "trained":
            ctl.train(P * G)
            ctl.publish()
            training_until = None
            continue
        order, k = payload
        ticket, eps = groups[order]
        episode = eps[k]
        if kind == "turn":  # a turn starts sampling at the current version
            episode["versions"].append(ctl.version)
            push(clock + rng.expovariate(1.0), "answered", payload)
        else:
            episode["left"] -= 1
            if episode["left"]:
                push(clock, "turn", payload)
            elif all(e["left"] == 0 for e in eps):
                ctl.finish(ticket, kept=True)
                done[order] = True
    return steps


@settings(max_examples=60, deadline=None)
@given(
    P=st.integers(1, 4),
    G=st.integers(1, 3),
    O=st.integers(0, 3),
    extra=st.integers(0, 12),
    turns=st.integers(1, 4),
    latencies=st.integers(0, 2**16),
    train_time=st.floats(0.0, 3.0),
)
def test_the_staleness_bound_is_never_exceeded(P, G, O, extra, turns, latencies, train_time):
    C = G + extra
    steps = _simulate(P, G, O, C, turns, latencies, train_time)
    assert len(steps) == 4
    for offsets in steps:
        assert offsets and min(offsets) >= 0 and max(offsets) <= O


def test_admission_controller_arguments_are_checked():
    with pytest.raises(ValueError, match="max_concurrent"):
        AdmissionController(
            batch_episodes=8, group_size=4, max_off_policy_steps=0, max_concurrent=3
        )
    with pytest.raises(ValueError, match="multiple"):
        AdmissionController(
            batch_episodes=6, group_size=4, max_off_policy_steps=0, max_concurrent=8
        )


# -- the main job ----------------------------------------------------------------------------------


def test_the_default_rollout_is_lockstep_and_the_default_identity_is_unchanged():
    """The new ``[rl]`` keys default to today's run (lock-step, on-policy), so a default run and
    a run saved before them have the same identity (resume stays possible)."""
    cfg = Config()
    assert cfg.rl.rollout == "lockstep"
    assert cfg.rl.max_off_policy_steps == 0
    assert cfg.identity() == identity_of({}, {})


@pytest.mark.parametrize(
    "override, message",
    [
        ('rl.rollout="eager"', r"\[rl\].rollout must be one of"),
        (
            "rl.max_off_policy_steps=1",
            r'\[rl\].max_off_policy_steps needs \[rl\].rollout = "concurrent"',
        ),
        ("rl.env_workers=0", r"\[rl\].env_workers must be >= 1"),
        ("rl.sample_batch_ms=-1", r"\[rl\].sample_batch_ms must be in"),
        ("task.kwargs.latency_ms=-5", r"\[task.kwargs\].latency_ms"),
        ("rl.pipeline_chunks=0", r"\[rl\].pipeline_chunks must be in \[1, "),
        (
            "rl.pipeline_chunks=3",
            r"\[rl\].pipeline_chunks must be in \[1, \[rl\].problems_per_step = 2",
        ),
        ('rl.anchor="behaviour"', r"\[rl\].anchor must be one of"),
        (
            "rl.num_microbatches=2 rl.pipeline_chunks=2",
            r"\[rl\].num_microbatches and \[rl\].pipeline_chunks cannot both",
        ),
    ],
)
def test_async_config_errors_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(TINY, override.split())


def test_off_policy_run_keeps_the_bound_and_trains_each_steps_problems(tmp_path):
    """A concurrent run with ``O = 1`` and an emulated tool latency on the local backend: every
    trained token is at most one version old, some are older than the trained policy (the next
    step sampled while the trainer trained), and each step trains the lock-step schedule's
    problems exactly once."""
    import runner.train as train_mod

    cfg = load_config(
        TINY,
        [
            *CONCURRENT,
            f'run.output_dir="{tmp_path}"',
            "sft.steps=0",
            "rl.steps=4",
            "rl.max_off_policy_steps=1",
            "task.kwargs.latency_ms=20",
            "checkpoint.interval=0",
        ],
    )
    result = train_mod.run(cfg, progress=False)
    rl = [r for r in result.metrics if r.get("phase") == "rl"]
    assert len(rl) == 4
    assert all(0 <= r["async/version_offset_max"] <= 1 for r in rl)
    assert any(r["async/version_offset_max"] == 1 for r in rl[1:])
    assert rl[0]["async/version_offset_max"] == 0  # nothing is older than the first policy
    for r in rl:
        assert r["data/problems"] == [f"{r['step']}:{i}" for i in range(3)]
        assert 0 <= r["async/trainer_idle_frac"] <= 1
    logged = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r.get("data/problems") for r in logged if r.get("phase") == "rl"] == [
        r["data/problems"] for r in rl
    ]


# -- failures, group hooks, dynamic filtering ------------------------------------------------------


class _Flaky:
    """Fails in ``step`` with ``error`` (or sleeps ``nap`` s) when ``fail`` is true."""

    def __init__(self, env, fail, error, nap=0.0):
        self.env, self.fail, self.error, self.nap = env, fail, error, nap

    def initial_observation(self):
        return self.env.initial_observation()

    def step(self, action):
        if self.fail:
            if self.nap:
                time.sleep(self.nap)
            else:
                raise self.error
        return self.env.step(action)


class _FlakyTask:
    """The environments numbered in ``fails`` (in creation order, from 1; ``"all"``: every one)
    fail; group rewards optional."""

    def __init__(self, task, fails, error, nap=0.0, group_rewards=None):
        self.task, self.fails, self.error, self.nap, self.made = task, fails, error, nap, 0
        if group_rewards is not None:
            self.group_rewards = group_rewards

    def __getattr__(self, name):
        return getattr(self.task, name)

    def make_env(self, problem):
        self.made += 1
        fail = self.fails == "all" or self.made in self.fails
        return _Flaky(self.task.make_env(problem), fail, self.error, self.nap)


def _flaky(task, *args, **kwargs):
    from runner.tasks import check_task

    return check_task(task.name, _FlakyTask(task.task, *args, **kwargs), task.vocab_size)


def _service(cfg, task, trainer, *overrides):
    cfg = load_config(TINY, [*CONCURRENT, *overrides])
    return RolloutService(cfg, trainer, task, first_step=cfg.sft.steps + 1), cfg


def test_recoverable_failures_drop_episodes_and_groups_keep_min_group_size(tiny):
    """One episode of each of the step's 3 groups raises `RecoverableError`: with
    ``min_group_size = 3`` its group (4 episodes) goes on with 3; with the whole group required
    (a `ConnectionError`) the groups are rejected and the next problems are admitted; a slow
    environment past ``env_timeout_s`` is dropped the same way."""
    from runner.tasks import RecoverableError

    cfg, task, trainer = tiny
    step = cfg.sft.steps + 1
    for overrides, error, nap, kept_sizes, rejected in (
        (["rl.min_group_size=3"], RecoverableError("flaky tool"), 0.0, {3}, 0),
        ([], ConnectionError("reset"), 0.0, {4}, 3),
        (["rl.min_group_size=3", "rl.env_timeout_s=0.05"], None, 0.3, {3}, 0),
    ):
        flaky = _flaky(task, {4, 8, 12}, error, nap)
        service, _ = _service(cfg, flaky, trainer, *overrides)
        try:
            got = service.collect(step)
            metrics = service.published(got)
        finally:
            service.close()
        assert {len(g) for g in got.groups} == kept_sizes
        assert len(got.groups) == cfg.rl.problems_per_step
        assert metrics["rollout/rejected_groups"] == rejected
        assert metrics["rollout/dropped"] == 3
        if rejected:  # the replacements are the next problems of the schedule
            assert got.problem_ids == [f"{step + 1}:{i}" for i in range(3)]


def test_persistent_failures_trip_the_circuit_breaker(tiny):
    from runner.tasks import RecoverableError
    from runner.tasks._async import RolloutError

    cfg, task, trainer = tiny
    service, _ = _service(cfg, _flaky(task, "all", RecoverableError("down")), trainer)
    try:
        with pytest.raises(RolloutError, match="rollouts keep failing") as info:
            service.collect(cfg.sft.steps + 1)
    finally:
        service.close()
    assert "\n" not in str(info.value) and "down" in str(info.value)


def test_other_exceptions_are_fatal_in_one_line_naming_task_problem_and_turn(tiny):
    from runner.tasks._async import RolloutError

    cfg, task, trainer = tiny
    service, _ = _service(cfg, _flaky(task, "all", KeyError("boom")), trainer)
    try:
        with pytest.raises(RolloutError) as info:
            service.collect(cfg.sft.steps + 1)
    finally:
        service.close()
    text = str(info.value)
    assert "\n" not in text
    assert (
        text.startswith(f"task {task.name}: problem ")
        and ", turn 0: env.step raised KeyError" in text
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), max_size=60))
def test_circuit_breaker_trips_exactly_by_its_rule(outcomes):
    from runner.tasks._async import CircuitBreaker, RolloutError

    breaker, streak = CircuitBreaker(), 0
    for n, failed in enumerate(outcomes):
        streak = streak + 1 if failed else 0
        window = outcomes[max(0, n - 19) : n + 1]
        trips = streak >= 5 or (len(window) >= 10 and sum(window) / len(window) >= 0.5)
        if trips:
            with pytest.raises(RolloutError):
                breaker.observe(failed)
            return
        breaker.observe(failed)


def test_uniform_groups_are_replaced_at_most_max_fill_rounds_times(tiny):
    """``group_rewards`` makes every group's rewards equal: each problem position is replaced once
    (``max_fill_rounds = 1``), then the replacement is kept; the hook's rewards are the trained
    ones."""
    cfg, task, trainer = tiny
    step = cfg.sft.steps + 1
    hooked = _flaky(task, (), None, group_rewards=lambda problem, episodes: [0.25] * len(episodes))
    service, _ = _service(cfg, hooked, trainer, "rl.drop_uniform_groups=true")
    try:
        got = service.collect(step)
        metrics = service.published(got)
    finally:
        service.close()
    assert metrics["rollout/uniform_groups"] == cfg.rl.problems_per_step
    assert got.problem_ids == [f"{step + 1}:{i}" for i in range(3)]
    assert {e.reward for g in got.groups for e in g} == {0.25}


# -- durability ------------------------------------------------------------------------------------


def _resume_cfg(tmp_path, name, *extra):
    return load_config(
        TINY,
        [
            *CONCURRENT,
            f'run.output_dir="{tmp_path}"',
            f'run.name="{name}"',
            "sft.steps=0",
            "checkpoint.interval=1",
            "checkpoint.save_promotable=true",
            *extra,
        ],
    )


def test_an_on_policy_concurrent_run_resumes_bit_exactly(tmp_path):
    """``O = 0``: a run stopped after 2 RL steps and resumed to 4 equals the 4-step run, reward
    for reward and bit for bit in its final weights (the samples are order-independent)."""
    from safetensors.numpy import load_file

    import runner.train as train_mod
    from runner import checkpoints as ckpt

    full = train_mod.run(_resume_cfg(tmp_path, "full", "rl.steps=4"), progress=False)
    train_mod.run(_resume_cfg(tmp_path, "cut", "rl.steps=2"), progress=False)
    manifest = ckpt.read_manifest(tmp_path / "cut" / "checkpoints", 2)
    assert manifest["run_state"]["rollouts"] == {"next_slot": 2 * 3}
    resumed = train_mod.run(_resume_cfg(tmp_path, "cut", "rl.steps=4"), resume=True, progress=False)
    a = [r for r in full.metrics if r.get("phase") == "rl"]
    b = [r for r in resumed.metrics if r.get("phase") == "rl"]
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert [r["data/problems"] for r in a] == [r["data/problems"] for r in b]

    def weights(run_dir):
        m = ckpt.read_manifest(run_dir / "checkpoints", 4)
        return load_file(run_dir / m["promotable"]["snapshot_path"])

    wa, wb = weights(full.run_dir), weights(resumed.run_dir)
    for key in wa:
        np.testing.assert_array_equal(wa[key], wb[key], err_msg=key)


def test_sigkill_and_resume_trains_every_problem_exactly_once(tmp_path):
    """``O = 2`` and ``K = 2`` chunks with an emulated tool latency, SIGKILLed at a random
    checkpoint while later steps sample, then resumed: the steps' ``data/problems`` are the
    schedule, each problem once (in-flight work is sampled again)."""
    import os
    import signal
    import subprocess
    import sys

    from runner import checkpoints as ckpt

    steps = 5
    cmd = [
        sys.executable,
        "-m",
        "runner",
        "train",
        "--config",
        str(TINY),
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        "--checkpoint-interval",
        "1",
        *(
            a
            for s in (
                *CONCURRENT,
                "sft.steps=0",
                f"rl.steps={steps}",
                "rl.max_off_policy_steps=2",
                "rl.pipeline_chunks=2",
                "task.kwargs.latency_ms=20",
            )
            for a in ("--set", s)
        ),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = tmp_path / "tiny" / "checkpoints" / "latest"
    kill_at = random.Random().randint(1, 3)
    deadline = time.time() + 600
    while time.time() < deadline:
        if marker.exists() and marker.read_text().strip() and int(marker.read_text()) >= kill_at:
            break
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = ckpt.latest_step(tmp_path / "tiny" / "checkpoints")
    assert killed_at < steps, "the run finished before the kill"
    manifest = ckpt.read_manifest(tmp_path / "tiny" / "checkpoints", killed_at)
    assert manifest["run_state"]["rollouts"] == {"next_slot": killed_at * 3}
    resumed = subprocess.run(
        [*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, log) if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, steps + 1))
    trained = [p for r in rl for p in r["data/problems"]]
    assert trained == [f"{s}:{i}" for s in range(1, steps + 1) for i in range(3)]
    assert all(r["async/version_offset_max"] <= 2 for r in rl)
    assert all(r["passes/backwards"] == 2 for r in rl)  # two chunks, one pass each


# -- pipeline chunks and the anchor ----------------------------------------------------------------


#: A task whose untrained policy's group rewards already differ (so GRPO has a gradient).
GRADED = "tests.test_hosted_tasks:make_graded_task"


def _one_step(tmp_path, name, *extra):
    """One RL step of the tiny config on `GRADED` (4 problems a step): its record and its
    final weights."""
    from safetensors.numpy import load_file

    import runner.train as train_mod
    from runner import checkpoints as ckpt

    cfg = load_config(
        TINY,
        [
            f'run.output_dir="{tmp_path}"',
            f'run.name="{name}"',
            "sft.steps=0",
            "rl.steps=1",
            "rl.problems_per_step=4",
            f'task.factory="{GRADED}"',
            "task.kwargs={}",
            "checkpoint.interval=1",
            "checkpoint.save_promotable=true",
            *extra,
        ],
    )
    result = train_mod.run(cfg, progress=False)
    (record,) = [r for r in result.metrics if r.get("phase") == "rl"]
    manifest = ckpt.read_manifest(result.run_dir / "checkpoints", 1)
    return record, load_file(result.run_dir / manifest["promotable"]["snapshot_path"])


def _assert_close_weights(a, b, atol):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=atol, err_msg=key)


@pytest.mark.parametrize(
    "setting, path",
    [
        (['rl.rollout="lockstep"'], "client"),
        (['rl.rollout="concurrent"'], "client"),
        (['rl.rollout="concurrent"', "rl.env_coef=0"], "builtin"),
    ],
)
def test_the_gradient_does_not_depend_on_the_number_of_pipeline_chunks(tmp_path, setting, path):
    """The same samples trained in ``K = 1`` and ``K = 4`` chunks: the same rewards and
    problems, ``K`` times the per-chunk passes, and the same weights to float32 rounding (the
    normalizers span the whole step)."""
    one, w1 = _one_step(tmp_path, "k1", *setting, "rl.pipeline_chunks=1")
    four, w4 = _one_step(tmp_path, "k4", *setting, "rl.pipeline_chunks=4")
    assert one[f"plan/{path}"] == four[f"plan/{path}"] == 1.0
    assert one["reward"] == four["reward"]
    assert one.get("data/problems") == four.get("data/problems")
    for kind in ("forwards", "backwards"):
        assert four[f"passes/{kind}"] == 4 * one[f"passes/{kind}"]
    _assert_close_weights(w1, w4, atol=2e-6)
    assert one["reward_std"] > 0  # the policy term has a gradient: the comparison is not vacuous


@pytest.mark.parametrize(
    "setting, path, extra_forwards",
    [
        (["rl.pipeline_chunks=2"], "client", 0),
        (["rl.env_coef=0", "rl.pipeline_chunks=2"], "builtin", 2),
    ],
)
def test_the_old_policy_anchor_is_one_forward_per_chunk(tmp_path, setting, path, extra_forwards):
    """``anchor = "old_policy"`` on-policy (``O = 0``): the anchor is the trainer's forward at
    the weights the step updates, which are the sampler's, so the step equals the sampler-anchored
    one to float32 rounding; it costs one forward per chunk on the builtin path and none on the
    client path (the anchor's forward is the client's own)."""
    concurrent = ['rl.rollout="concurrent"', *setting]
    sampler, ws = _one_step(tmp_path, "sampler", *concurrent)
    old, wo = _one_step(tmp_path, "old", *concurrent, 'rl.anchor="old_policy"')
    assert sampler[f"plan/{path}"] == old[f"plan/{path}"] == 1.0
    assert old["passes/forwards"] == sampler["passes/forwards"] + extra_forwards
    assert old["passes/backwards"] == sampler["passes/backwards"]
    assert old["async/streamed_forwards"] == 1  # the first chunk's, before the last was in
    assert sampler["async/streamed_forwards"] == 0
    assert old["reward"] == sampler["reward"] and sampler["reward_std"] > 0
    # the ratio to the anchor is 1: exactly where the anchor is the client's own forward
    if path == "client":
        assert old["grpo/ratio_mean"] == old["grpo/ratio_max"] == 1.0
    else:
        assert abs(old["grpo/ratio_max"] - 1.0) < 1e-5
    _assert_close_weights(ws, wo, atol=2e-5)


def test_the_old_policy_anchor_removes_the_staleness_from_the_ratio(tmp_path):
    """Off-policy (``O = 1``, a tool latency so the next step samples while the trainer
    trains): with the sampler as anchor the stale tokens' ratios differ from 1; with
    ``old_policy`` every ratio is exactly 1 (the anchor is the trained policy before its
    update) and the sampler/old-policy gap is left to the correction terms."""
    base = [
        'rl.rollout="concurrent"',
        "rl.max_off_policy_steps=1",
        "task.kwargs.latency_ms=20",
        "rl.steps=3",
        "checkpoint.interval=0",
        "sft.steps=0",
        f'run.output_dir="{tmp_path}"',
    ]
    import runner.train as train_mod

    def run(name, *extra):
        cfg = load_config(TINY, [*base, f'run.name="{name}"', *extra])
        return [r for r in train_mod.run(cfg, progress=False).metrics if r.get("phase") == "rl"]

    sampler = run("sampler")
    old = run("old", 'rl.anchor="old_policy"')
    stale = [r for r in sampler if r["async/version_offset_max"] == 1]
    assert stale, "no step trained stale tokens"
    assert any(r["grpo/ratio_max"] != 1.0 for r in stale)
    assert all(r["grpo/ratio_mean"] == r["grpo/ratio_max"] == 1.0 for r in old)
    assert any(r["async/version_offset_max"] == 1 for r in old)


class _GatedTask:
    """Every episode of the step's problems but the first waits in its environment until the
    gate opens (at most 60 s)."""

    def __init__(self, task):
        self.task, self.gate, self.first, self.timed_out = task, threading.Event(), None, False

    def __getattr__(self, name):
        return getattr(self.task, name)

    def problems(self, rng, n):
        out = self.task.problems(rng, n)
        self.first = out[0]
        return out

    def make_env(self, problem):
        env, gated = self.task.make_env(problem), problem is not self.first
        outer = self

        class Env:
            def initial_observation(self):
                return env.initial_observation()

            def step(self, action):
                if gated and not outer.gate.wait(60):
                    outer.timed_out = True
                return env.step(action)

        return Env()


def test_a_chunk_is_handed_over_while_the_steps_later_groups_still_sample(tiny):
    """``collect`` with chunks calls ``on_chunk`` as each chunk completes: the first chunk (one
    group) arrives while the other groups wait in their environments for a gate that only the
    callback opens; the chunks are the step's groups in order."""
    cfg, task, trainer = tiny
    gated = _GatedTask(task.task)
    service = RolloutService(
        cfg, trainer, dataclasses.replace(task, task=gated), first_step=cfg.sft.steps + 1
    )
    seen = []

    def on_chunk(groups):
        seen.append((len(groups), service.controller.in_flight))
        gated.gate.set()

    try:
        with pytest.raises(ValueError, match=r"chunk_sizes \[1, 1\] must be positive and sum to 3"):
            service.collect(cfg.sft.steps + 1, chunk_sizes=[1, 1])
        got = service.collect(cfg.sft.steps + 1, chunk_sizes=[1, 2], on_chunk=on_chunk)
    finally:
        service.close()
    assert not gated.timed_out
    assert [n for n, _ in seen] == [1, 2]
    assert seen[0][1] >= 2 * cfg.rl.group_size  # the other two groups were still in flight
    assert got.problem_ids == [f"{cfg.sft.steps + 1}:{i}" for i in range(3)]


def test_the_tinker_backend_overlaps_sampling_and_training_against_the_local_server(tmp_path):
    """``--backend tinker`` through the real SDK to an in-process ``runner serve``: concurrent
    rollouts with ``O = 1``, ``K = 2`` chunks and the ``old_policy`` anchor. The hosted sampler
    gets int32-safe seeds (a concurrent step's seed is not one), later steps sample while the
    trainer trains (stale tokens, the trainer almost never idle), each step trains the
    schedule's problems, and a step's passes are two chunks' worth."""
    pytest.importorskip("tinker")
    pytest.importorskip("aiohttp")
    import os
    import uuid

    from runner.serve import ServeConfig, ServerThread, parse_model_flags

    key_env, key = "FOLDLOSS_TEST_ASYNC_TINKER_KEY", f"tml-SENTINEL-{uuid.uuid4().hex}"
    os.environ[key_env] = key
    models = parse_model_flags([f"foldloss/tiny={TINY}"])
    config = ServeConfig(api_key=key, state_dir=str(tmp_path / "state"), long_poll_s=0.5)
    steps = 3
    sets = [
        *_overlapped_sets(steps),
        'rl.anchor="old_policy"',
        "tinker.base_model='foldloss/tiny'",
        f"tinker.api_key_env='{key_env}'",
        "tinker.lora_rank=8",
    ]
    try:
        with ServerThread(config, models) as st:
            _train_hosted(tmp_path / "runs", "tinker", st.url, sets)
    finally:
        del os.environ[key_env]
    rl = _overlapped_rl_steps(tmp_path / "runs" / "tiny", steps, streamed_forwards=1)
    assert all(abs(r["grpo/ratio_max"] - 1.0) < 1e-5 for r in rl)  # the old-policy anchor


def _overlapped_sets(steps: int) -> list[str]:
    """The ``--set`` overrides of a hosted ``O = 1``, ``K = 2`` run of ``steps`` RL steps with a
    20 ms tool (no SFT, no checkpoints)."""
    return [
        *CONCURRENT,
        "sft.steps=0",
        f"rl.steps={steps}",
        "rl.max_off_policy_steps=1",
        "rl.pipeline_chunks=2",
        "task.kwargs.latency_ms=20",
        "checkpoint.interval=0",
    ]


def _train_hosted(out: Path, backend: str, url: str, sets: list[str]) -> None:
    """``python -m runner train`` of examples/tiny.toml in process on a hosted ``backend``
    whose service is at ``url``, with the ``--set`` overrides ``sets``; it must exit 0."""
    from runner import __main__ as cli

    args = ["train", "--config", str(TINY), "--output-dir", str(out), "--no-progress"]
    args += ["--backend", backend]
    for s in [*sets, f"{backend}.base_url='{url}'"]:
        args += ["--set", s]
    assert cli.main(args) == 0


def _overlapped_rl_steps(run_dir: Path, steps: int, *, streamed_forwards: int) -> list[dict]:
    """The RL records of a hosted ``O = 1``, ``K = 2`` run of 3 problems a step, checked: every
    step trains its schedule's problems, no token is staler than 1, later steps sampled while
    the trainer trained, and each step is two chunks of passes (with ``streamed_forwards``
    token-only forwards a step: 1 with the old-policy anchor, 0 on the client path without)."""
    log = (run_dir / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, log) if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, steps + 1))
    assert [p for r in rl for p in r["data/problems"]] == [
        f"{s}:{i}" for s in range(1, steps + 1) for i in range(3)
    ]
    assert all(r["async/version_offset_max"] <= 1 for r in rl)
    assert any(r["async/version_offset_max"] == 1 for r in rl[1:])  # sampled during training
    assert all(r["passes/backwards"] == 2 for r in rl)
    assert all(r["async/streamed_forwards"] == streamed_forwards for r in rl)
    return rl


def test_the_fireworks_backend_overlaps_sampling_and_training_against_the_local_server(
    tmp_path, monkeypatch
):
    """``--backend fireworks`` through the real Fireworks SDK to an in-process ``runner serve``
    (its control plane provisions the trainer and the hot-load deployment): concurrent rollouts
    with ``O = 1`` and ``K = 2`` sample through the deployment while the trainer trains, with
    int32-safe seeds, and train each step's scheduled problems."""
    pytest.importorskip("fireworks")
    pytest.importorskip("aiohttp")
    import uuid

    from runner.serve import ServeConfig, ServerThread, parse_model_flags
    from tests.wire_helpers import no_control_plane_waits

    base = "accounts/fireworks/models/qwen3-8b"
    key_env, key = "FOLDLOSS_TEST_ASYNC_FIREWORKS_KEY", f"fw-SENTINEL-{uuid.uuid4().hex}"
    monkeypatch.setenv(key_env, key)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    no_control_plane_waits(monkeypatch)
    models = parse_model_flags([f"{base}={TINY}"])
    config = ServeConfig(api_key=key, state_dir=str(tmp_path / "state"), long_poll_s=0.5)
    steps = 3
    sets = [
        *_overlapped_sets(steps),
        f"fireworks.base_model='{base}'",
        "fireworks.training_shape_id='accounts/fireworks/trainingShapes/ts-qwen3-8b-policy'",
        f"fireworks.api_key_env='{key_env}'",
    ]
    with ServerThread(config, models) as st:
        _train_hosted(tmp_path / "runs", "fireworks", st.url, sets)
    rl = _overlapped_rl_steps(tmp_path / "runs" / "tiny", steps, streamed_forwards=0)
    assert all(r["passes/forwards"] == 4 for r in rl)  # 2 forwards a chunk (client path)
