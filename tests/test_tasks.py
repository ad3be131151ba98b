"""The task protocol (runner.tasks): loading from [task] factory, the rollout's checks, the
calculator reproducing its own loop exactly, a task defined here training end to end, the shipped
QA and lookup tasks, and [rl].loss."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_calc_env import FakeSampler, expert_policy, random_policy

import losses
import runner.env.calc as legacy
from runner.config import load_config
from runner.env import tokenizer as tok
from runner.job import build_job
from runner.sft import collate_sft, translate_sft_batch
from runner.tasks import StepResult, check_task, episode_to_seq, rollout
from runner.tasks.calc import CalcTask
from runner.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
HERE = __name__  # this module, importable as a [task] factory / [rl] loss


def _calc(**kw):
    return check_task("calc", CalcTask(**kw), tok.VOCAB_SIZE)


# -- a task defined here (not shipped) ------------------------------------------------------------


class ProbeEnv:
    """Turn 1: anything → ``= ok<d>\\n`` (the body ``ok<d>`` is the target); turn 2: ``yes\\n``
    earns 1.0."""

    def __init__(self, problem, bad=None):
        self.problem, self.turn, self.bad = problem, 0, bad

    def initial_observation(self):
        if self.bad == "initial_raises":
            raise RuntimeError("no prompt today")
        if self.bad == "vocab":
            return [tok.BOS_ID, 999]
        return tok.encode(f"n={self.problem}\n", add_bos=True)

    def step(self, action):
        self.turn += 1
        if self.bad == "step_raises":
            return {}["missing"]
        if self.bad == "reward":
            return StepResult(reward=math.nan, done=True)
        if self.bad == "targets":
            return StepResult(0.0, False, tok.encode("= x\n"), [True])
        if self.bad == "type":
            return {"reward": 0.0}
        if self.bad == "obs_vocab":
            return StepResult(0.0, False, [5, -1])
        if self.turn == 1:
            pre, body = tok.encode("= "), tok.encode(f"ok{self.problem}")
            return StepResult(
                0.0,
                False,
                pre + body + tok.encode("\n"),
                [False] * len(pre) + [True] * len(body) + [False],
                metrics={"probes": 1.0},
            )
        r = float(tok.decode(action) == "yes\n")
        return StepResult(r, True, metrics={"said_yes": r})


class ProbeTask:
    stop_token_ids = (tok.NEWLINE_ID, tok.EOS_ID)
    max_turns = 3
    max_tokens_per_turn = 6

    def __init__(self, bad=None):
        self.bad = bad

    def problems(self, rng, n):
        return [int(x) for x in rng.integers(0, 10, size=n)]

    def make_env(self, problem):
        if self.bad == "make_env":
            raise ValueError(f"no environment for {problem}")
        return ProbeEnv(problem, self.bad)

    def demonstrations(self, rng, n):
        return [
            {
                "messages": [
                    {"role": "user", "content": f"n={p}\n"},
                    {"role": "assistant", "content": "go\n"},
                    {"role": "tool", "content": f"= ok{p}\n"},
                    {"role": "assistant", "content": "yes\n"},
                ]
            }
            for p in self.problems(rng, n)
        ]


def make_probe_task(*, tokenizer, bad=None):
    assert isinstance(tokenizer, CharTokenizer)
    return ProbeTask(bad)


def make_not_a_task(*, tokenizer):
    return object()


def make_bad_stops(*, tokenizer):
    t = ProbeTask()
    t.stop_token_ids = (tokenizer.vocab_size,)
    return t


def make_bad_turns(*, tokenizer):
    t = ProbeTask()
    t.max_turns = 0
    return t


def make_failing(*, tokenizer, why):
    raise RuntimeError(why)


NOT_CALLABLE = 3


def _probe_cfg(tmp_path, *extra):
    return load_config(
        TINY,
        [
            f'run.output_dir="{tmp_path}"',
            f'task.factory="{HERE}:make_probe_task"',
            "task.kwargs={}",  # tiny.toml's are the calculator's
            "sft.steps=2",
            "rl.steps=2",
            "checkpoint.interval=0",
            "rl.env_coef=0.05",
            *extra,
        ],
    )


def test_a_task_defined_in_a_test_module_trains_end_to_end(tmp_path):
    from runner.train import run

    cfg = _probe_cfg(tmp_path)
    assert cfg.task.kwargs == {}  # the calculator's knobs stay with the calculator
    result = run(cfg, progress=False)
    recs = result.metrics
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    rl = [r for r in recs if r["phase"] == "rl"]
    for r in rl:
        assert r["plan/client"] == 1.0 and r["echo_env/num_obs_tokens"] >= 0
        assert math.isfinite(r["grpo/loss"]) and 0.0 <= r["reward"] <= 1.0
        assert sum(r[f"stop/{s}"] for s in ("done", "max_turns", "context_limit")) == 1.0
    sft = [r for r in recs if r["phase"] == "sft"]
    assert all(math.isfinite(r["sft/nll"]) for r in sft)
    assert "eval_reward" in recs[0] and "eval_reward" in recs[-1]
    manifest = json.loads(
        (result.run_dir / "checkpoints" / "step_000004" / "manifest.json").read_text()
    )
    assert manifest["run_state"]["data_position"]["source"] == "task"


def test_the_probe_rollout_builds_masks_from_observation_targets():
    task = check_task("probe", ProbeTask(), tok.VOCAB_SIZE)
    sampler = FakeSampler(lambda ctx, rng: "yes\n" if "ok" in ctx else "go\n")
    [[ep]] = rollout(sampler, task, [7], group_size=1)
    assert ep.reward == 1.0 and ep.stop == "done" and ep.num_turns == 2
    assert ep.metrics == {"probes": 1.0, "said_yes": 1.0}
    seq = episode_to_seq(ep)
    text = tok.decode(seq.tokens)
    assert text == "<bos>n=7\ngo\n= ok7\nyes\n"
    targets = seq.tokens[1:]
    assert tok.decode(targets[seq.inputs["obs_mask"] > 0]) == "ok7"
    assert tok.decode(targets[seq.inputs["action_mask"] > 0]) == "go\nyes\n"
    assert not np.any(seq.inputs["action_mask"] * seq.inputs["obs_mask"])


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            "vocab",
            r"task probe: problem 0 \(3\), turn 0: initial_observation\(\) token 999 at position 1 is outside the vocabulary \[0, 53\)",
        ),
        (
            "reward",
            r"task probe: problem 0 \(3\), turn 0: the reward is nan; rewards must be finite",
        ),
        ("targets", r"turn 0: observation_targets has 1 flags for 4 observation tokens"),
        ("type", r"turn 0: env.step returned dict, expected a runner.tasks.StepResult"),
        ("obs_vocab", r"turn 0: the observation token -1 at position 1 is outside the vocabulary"),
    ],
)
def test_what_an_env_returns_is_checked_naming_task_problem_and_turn(bad, message):
    task = check_task("probe", ProbeTask(bad), tok.VOCAB_SIZE)
    with pytest.raises(ValueError, match=message):
        rollout(FakeSampler(lambda ctx, rng: "go\n"), task, [3], group_size=2)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("make_env", r"problem 0 \(3\): make_env raised ValueError: no environment for 3 \(at "),
        (
            "initial_raises",
            r"problem 0 \(3\), turn 0: initial_observation raised RuntimeError: no prompt today",
        ),
        ("step_raises", r"problem 0 \(3\), turn 0: env.step raised KeyError: 'missing' \(at "),
    ],
)
def test_what_a_task_raises_is_one_error_naming_task_problem_turn_and_line(bad, message):
    """An exception of the task's own code (not the protocol checks above) is a `RolloutError`
    naming the task, the problem, the turn, the method and the file:line that raised it."""
    from runner.tasks._rollout import RolloutError

    task = check_task("probe", ProbeTask(bad), tok.VOCAB_SIZE)
    with pytest.raises(RolloutError, match="^task probe: " + message) as info:
        rollout(FakeSampler(lambda ctx, rng: "go\n"), task, [3], group_size=2)
    assert "\n" not in str(info.value) and f"{Path(__file__).name}:" in str(info.value)
    assert info.value.__cause__ is not None  # the task's traceback stays on the chain


def test_a_task_whose_make_env_raises_ends_the_cli_run_in_one_error_line(tmp_path):
    """The real CLI: exit 2, one ``error:`` line naming the task, the problem and the line, no
    traceback."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    args = [f'task.factory="{HERE}:make_probe_task"', 'task.kwargs={bad="make_env"}']
    cmd = [sys.executable, "-m", "runner", "train", "--config", str(TINY), "--no-progress"]
    cmd += ["--output-dir", str(tmp_path), *(a for s in args for a in ("--set", s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: task "), lines
    assert "make_env raised ValueError: no environment for" in lines[0]
    assert "test_tasks.py:" in lines[0]


def test_a_prompt_that_overflows_max_seq_len_is_an_error():
    task = check_task("probe", ProbeTask(), tok.VOCAB_SIZE)
    with pytest.raises(
        ValueError, match=r"problem 0 \(3\), turn 0: the prompt has 5 tokens, .*max_seq_len = 4"
    ):
        rollout(FakeSampler(lambda ctx, rng: "go\n"), task, [3], group_size=2, max_seq_len=4)


@pytest.mark.parametrize(
    "factory, kwargs, message",
    [
        ("nocolon", "", r"\[task\].factory = 'nocolon': expected 'package.module:function'"),
        ("no_such_module_xyz:f", "", r"cannot import module 'no_such_module_xyz'"),
        (f"{HERE}:missing", "", rf"module '{HERE}' has no attribute 'missing'"),
        (f"{HERE}:NOT_CALLABLE", "", r"'NOT_CALLABLE' is not callable"),
        (f"{HERE}:make_failing", 'task.kwargs.why="boom"', r"raised RuntimeError: boom"),
        (
            f"{HERE}:make_probe_task",
            "task.kwargs.nope=1",
            r"raised TypeError: .*unexpected keyword",
        ),
        (f"{HERE}:make_not_a_task", "", r"returned a object without \['stop_token_ids'"),
        (f"{HERE}:make_bad_stops", "", r"stop token 53 is not a token id in \[0, 53\)"),
        (f"{HERE}:make_bad_turns", "", r"max_turns must be an int >= 1, got 0"),
        (
            "runner.tasks.calc:make_task",
            "task.kwargs.max_turns=0",
            r"max_turns must be an integer > 0",
        ),
    ],
)
def test_task_factory_errors_are_config_errors(factory, kwargs, message):
    overrides = [f'task.factory="{factory}"'] + ([kwargs] if kwargs else [])
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_env_section_and_phases_without_data_are_refused():
    with pytest.raises(ValueError, match=r"\[env\] is now \[task.kwargs\]"):
        load_config(None, ["env.max_turns=3"])
    with pytest.raises(ValueError, match=r"\[rl\].steps = 100 needs a task"):
        load_config(None, ['task.factory=""'])
    with pytest.raises(ValueError, match=r"\[sft\].steps = 70 needs SFT data: .*no demonstrations"):
        load_config(None, [f'task.factory="{HERE}:make_no_demos"'])
    cfg = load_config(None, ["task.kwargs.max_turns=3"])
    assert cfg.task.kwargs == {
        "max_operand": 9,
        "num_ops": 1,
        "max_turns": 3,
        "max_tokens_per_turn": 12,
    }


def make_no_demos(*, tokenizer):
    return _WithoutDemos()


class _WithoutDemos:
    stop_token_ids = (tok.NEWLINE_ID,)
    max_turns = 2
    max_tokens_per_turn = 4

    def problems(self, rng, n):
        return list(range(n))

    def make_env(self, problem):
        return ProbeEnv(problem)


# -- the calculator through the protocol reproduces its own loop --------------------------------


@pytest.mark.parametrize(
    "policy, knobs, max_seq_len",
    [
        (random_policy, dict(max_operand=9, num_ops=2, max_turns=4, max_tokens_per_turn=12), None),
        (expert_policy, dict(max_operand=30, num_ops=3, max_turns=5, max_tokens_per_turn=16), None),
        (random_policy, dict(max_operand=9, num_ops=1, max_turns=4, max_tokens_per_turn=12), 40),
        (
            lambda c, r: "calc 2*3\nans 6\n",
            dict(max_operand=5, num_ops=1, max_turns=3, max_tokens_per_turn=7),
            64,
        ),
    ],
)
def test_calc_through_the_protocol_matches_the_calculators_own_rollout(policy, knobs, max_seq_len):
    task = _calc(**knobs)
    problems = task.problems(np.random.default_rng(3), 6)
    a_sampler, b_sampler = FakeSampler(policy), FakeSampler(policy)
    env = legacy.CalcEnv(
        max_operand=knobs["max_operand"], num_ops=knobs["num_ops"], max_turns=knobs["max_turns"]
    )
    old = legacy.rollout(
        a_sampler,
        env,
        problems,
        group_size=3,
        max_tokens_per_turn=knobs["max_tokens_per_turn"],
        temperature=0.7,
        seed=11,
        max_seq_len=max_seq_len,
    )
    new = rollout(
        b_sampler, task, problems, group_size=3, temperature=0.7, seed=11, max_seq_len=max_seq_len
    )
    assert a_sampler.calls == b_sampler.calls
    for go, gn in zip(old, new, strict=True):
        for t, e in zip(go, gn, strict=True):
            assert t.reward == e.reward and t.num_turns == e.num_turns
            s0, s1 = legacy.trajectory_to_seq(t), episode_to_seq(e)
            np.testing.assert_array_equal(s0.tokens, s1.tokens)
            assert s0.inputs.keys() == s1.inputs.keys()
            for k in s0.inputs:
                np.testing.assert_array_equal(s0.inputs[k], s1.inputs[k], err_msg=k)
            if t.outcome == "context_limit":
                assert e.stop == "context_limit"


def test_calc_through_the_protocol_matches_on_the_local_trainer():
    from runner.local import LocalTrainer, LocalTrainerConfig

    trainer = LocalTrainer(
        LocalTrainerConfig(
            vocab_size=tok.VOCAB_SIZE,
            d_model=16,
            n_layers=1,
            n_heads=2,
            d_ff=32,
            max_seq_len=64,
            seed=0,
        )
    )
    task = _calc(max_operand=5, num_ops=1, max_turns=3, max_tokens_per_turn=10)
    problems = task.problems(np.random.default_rng(0), 4)
    old = legacy.rollout(
        trainer,
        task.task.env,
        problems,
        group_size=4,
        max_tokens_per_turn=10,
        seed=5,
        max_seq_len=64,
    )
    new = rollout(trainer, task, problems, group_size=4, seed=5, max_seq_len=64)
    for t, e in zip((t for g in old for t in g), (e for g in new for e in g), strict=True):
        s0, s1 = legacy.trajectory_to_seq(t), episode_to_seq(e)
        np.testing.assert_array_equal(s0.tokens, s1.tokens)
        for k in s0.inputs:
            np.testing.assert_array_equal(s0.inputs[k], s1.inputs[k], err_msg=k)


def test_calc_demonstrations_are_the_expert_sft_examples():
    cfg = load_config(TINY)
    job, cfg = build_job(cfg)
    for step in (1, 2, 3):
        examples, _, metrics = job.sft.batch(step, None)
        rng = np.random.default_rng([cfg.run.seed, 1, step])
        env = job.task.task.env
        ref = [
            legacy.expert_sft_example(env, env.sample_problem(rng))
            for _ in range(cfg.sft.batch_size)
        ]
        got = translate_sft_batch(*collate_sft([e.as_sft() for e in examples]), max_seq_len=64)
        want = translate_sft_batch(*collate_sft(ref), max_seq_len=64)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.inputs["weights"], b.inputs["weights"])
        assert metrics == {"sft/truncated": 0.0, "sft/dropped": 0.0}


def test_the_main_job_matches_the_pre_protocol_loop(tmp_path, monkeypatch):
    """The tiny main job through the protocol equals, metric for metric and bit for bit in its
    final weights, the loop as it was before the protocol (the calculator's own rollout and
    expert examples, reimplemented here from the previous `runner.train`)."""
    import runner.train as train_mod
    from runner import steps

    overrides = [
        f'run.output_dir="{tmp_path}"',
        "sft.steps=40",
        "sft.learning_rate=1e-2",  # enough for rewards > 0 in RL
        "rl.steps=3",
        "checkpoint.interval=0",
        "checkpoint.save_promotable=true",
    ]

    def legacy_rl_step(cfg, trainer, task, step, runner, reference=None):
        env = task.task.env
        rng = steps.step_rng(cfg, 2, step)
        problems = [env.sample_problem(rng) for _ in range(cfg.rl.problems_per_step)]
        groups = legacy.rollout(
            trainer,
            env,
            problems,
            group_size=cfg.rl.group_size,
            max_tokens_per_turn=task.max_tokens_per_turn,
            temperature=cfg.rl.temperature,
            seed=int(rng.integers(2**31)),
            max_seq_len=cfg.model.max_seq_len,
        )
        rewards = np.array([t.reward for g in groups for t in g])
        adv = np.asarray(
            losses.group_advantages(
                rewards, group_size=cfg.rl.group_size, estimator=cfg.rl.advantage_estimator
            )
        )
        seqs = []
        for a, t in zip(adv, (t for g in groups for t in g), strict=True):
            s = legacy.trajectory_to_seq(t)
            seqs.append(
                type(s)(s.tokens, dict(s.inputs, advantages=float(a) * s.inputs["action_mask"]))
            )
        m = runner.step(trainer, seqs, steps.adam(cfg, cfg.rl.learning_rate), num_microbatches=1)
        m.update(reward=float(rewards.mean()), tokens=float(sum(s.num_targets for s in seqs)))
        return m

    def legacy_evaluate(cfg, trainer, task, problems):
        groups = legacy.rollout(
            trainer,
            task.task.env,
            problems,
            group_size=1,
            max_tokens_per_turn=task.max_tokens_per_turn,
            temperature=cfg.rl.temperature,
            seed=cfg.run.seed + 12345,
            max_seq_len=cfg.model.max_seq_len,
        )
        return float(np.mean([g[0].reward for g in groups]))

    def final_weights(result):
        from safetensors.numpy import load_file

        m = json.loads(
            (result.run_dir / "checkpoints" / "step_000043" / "manifest.json").read_text()
        )
        return load_file(result.run_dir / m["promotable"]["snapshot_path"])

    a = train_mod.run(load_config(TINY, [*overrides, 'run.name="protocol"']), progress=False)
    monkeypatch.setattr(train_mod, "rl_step", legacy_rl_step)
    monkeypatch.setattr(train_mod, "evaluate", legacy_evaluate)
    b = train_mod.run(load_config(TINY, [*overrides, 'run.name="legacy"']), progress=False)
    assert any(r.get("reward", 0) > 0 for r in a.metrics)  # the RL steps learn from something
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        for key in (
            "sft/nll",
            "reward",
            "eval_reward",
            "grpo/loss",
            "echo_env/nll",
            "optim/grad_norm",
            "tokens",
        ):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


# -- [rl].loss -------------------------------------------------------------------------------------


def make_default_loss(*, env_coef=0.01):
    return losses.fold(losses.grpo(clip_low=0.2, clip_high=0.28), losses.echo_env(coef=env_coef))


def make_plain_loss():
    term = make_default_loss(env_coef=0.05)
    return lambda logprobs, batch: term(logprobs, batch)


def make_not_a_loss():
    return 42


def make_critic_loss():
    return losses.value_loss()


def make_kl_loss():
    return losses.grpo(kl_coef=0.1)


def test_a_users_loss_reading_ref_logprobs_gets_the_reference_model(tmp_path):
    # The reference model follows what the loss reads, not the [rl].kl_coef knob.
    from runner.config import reference_reason
    from runner.train import run

    sets = [f'run.output_dir="{tmp_path}"', "sft.steps=1", "rl.steps=1", "checkpoint.interval=0"]
    cfg = load_config(TINY, [*sets, f'rl.loss="{HERE}:make_kl_loss"', "rl.kl_coef=0.0"])
    assert reference_reason(cfg) == f"[rl].loss = '{HERE}:make_kl_loss' (reads ref_logprobs)"
    result = run(cfg, progress=False)
    (rl,) = [r for r in result.metrics if r["phase"] == "rl"]
    assert "kl" in rl and math.isfinite(rl["kl"])
    assert (result.run_dir / "reference.safetensors").is_file()
    assert reference_reason(load_config(TINY, ["rl.kl_coef=0.1"])) == "[rl].kl_coef > 0"
    assert reference_reason(load_config(TINY, [f'rl.loss="{HERE}:make_plain_loss"'])) is None
    with pytest.raises(ValueError, match=r"make_kl_loss' \(reads ref_logprobs\) needs a frozen"):
        load_config(
            TINY,
            [
                *sets,
                f'rl.loss="{HERE}:make_kl_loss"',
                "run.backend='tinker'",
                "tinker.base_model='m'",
            ],
        )


def test_rl_loss_is_the_users_term_and_the_planner_treats_it_like_any_other(tmp_path):
    from runner.train import run

    base = [f'run.output_dir="{tmp_path}"', "sft.steps=2", "rl.steps=2", "checkpoint.interval=0"]
    ref = run(load_config(TINY, [*base, 'run.name="knobs"']), progress=False)
    mine = run(
        load_config(
            TINY,
            [
                *base,
                'run.name="mine"',
                f'rl.loss="{HERE}:make_default_loss"',
                "rl.loss_kwargs.env_coef=0.01",
            ],
        ),
        progress=False,
    )
    for r0, r1 in zip(ref.metrics, mine.metrics, strict=True):
        assert r0.get("reward") == r1.get("reward") and r0.get("grpo/loss") == r1.get("grpo/loss")
    plain = run(
        load_config(TINY, [*base, 'run.name="plain"', f'rl.loss="{HERE}:make_plain_loss"']),
        progress=False,
    )
    rl = [r for r in plain.metrics if r["phase"] == "rl"]
    assert all(r["plan/client"] == 1.0 and math.isfinite(r["loss"]) for r in rl)
    builtin = run(
        load_config(
            TINY,
            [
                *base,
                'run.name="builtin"',
                f'rl.loss="{HERE}:make_default_loss"',
                "rl.loss_kwargs.env_coef=0.0",
            ],
        ),
        progress=False,
    )
    assert all(r["plan/builtin"] == 1.0 for r in builtin.metrics if r["phase"] == "rl")
    with pytest.raises(
        ValueError, match=r"\[rl\].loss = '.*make_not_a_loss' returned int, not a loss term"
    ):
        load_config(TINY, [f'rl.loss="{HERE}:make_not_a_loss"'])
    with pytest.raises(ValueError, match=r"make_critic_loss'.*takes values as its first argument"):
        load_config(TINY, [f'rl.loss="{HERE}:make_critic_loss"'])
    with pytest.raises(ValueError, match=r"\[rl\].loss = 'nope:x': cannot import module 'nope'"):
        load_config(TINY, ['rl.loss="nope:x"'])


# -- shipped tasks -------------------------------------------------------------------------------


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_qa_task_rewards_and_record_errors(tmp_path):
    from runner.tasks import qa

    path = _write(
        tmp_path / "qa.jsonl",
        [{"prompt": "q: 2+2\na: ", "answer": "4"}, {"prompt": "q: 3\na: ", "answer": "3"}],
    )
    task = check_task("qa", qa.make_task(tokenizer=CharTokenizer(), path=path), tok.VOCAB_SIZE)
    assert task.has_demonstrations and not task.has_eval_problems and task.max_turns == 1
    q = task.task.questions[0]
    assert tok.decode(q.tokens) == "<bos>q: 2+2\na: "
    sampler = FakeSampler(lambda ctx, rng: " 4\n" if "2+2" in ctx else "5\n")
    groups = rollout(sampler, task, task.task.questions, group_size=2)
    assert [e.reward for g in groups for e in g] == [1.0, 1.0, 0.0, 0.0]
    assert qa._score("numeric", "it is 3.9999999", "4", 1e-6) == 1.0
    assert qa._score("numeric", "about 3.9", "4", 1e-6) == 0.0
    assert qa._score("regex", " yes \n", "y(es)?", 0) == 1.0
    demo = task.demonstrations(np.random.default_rng(0), 1)[0]
    assert demo["messages"][-1]["content"].endswith("\n")
    bad = [
        ([{"prompt": "x"}], r"qa.jsonl:1: answer must be a string, got None"),
        (["{oops"], r"qa.jsonl:1: not valid JSON"),
        (
            [{"prompt": "ok", "answer": "1"}, {"prompt": "", "answer": "1"}],
            r"qa.jsonl:2: prompt must be a non-empty string",
        ),
        ([{"prompt": "X", "answer": "1"}], r"qa.jsonl:1: prompt: cannot encode character 'X'"),
    ]
    for rows, message in bad:
        with pytest.raises(ValueError, match=message):
            qa.make_task(tokenizer=CharTokenizer(), path=_write(tmp_path / "qa.jsonl", rows))
    with pytest.raises(ValueError, match=r"qa.jsonl:1: answer must be a finite number"):
        qa.make_task(
            tokenizer=CharTokenizer(),
            path=_write(tmp_path / "qa.jsonl", [{"prompt": "a", "answer": "x"}]),
            reward="numeric",
        )
    with pytest.raises(ValueError, match=r"qa.jsonl:1: answer is not a valid regular expression"):
        qa.make_task(
            tokenizer=CharTokenizer(),
            path=_write(tmp_path / "qa.jsonl", [{"prompt": "a", "answer": "("}]),
            reward="regex",
        )


def test_qa_task_trains_from_the_config(tmp_path):
    from runner.train import run

    rows = [
        {"prompt": f"q: {a}+{b}\na: ", "answer": str(a + b)} for a in range(4) for b in range(4)
    ]
    path = _write(tmp_path / "qa.jsonl", rows)
    held = _write(tmp_path / "held.jsonl", rows[:4])
    cfg = load_config(
        TINY,
        [
            f'run.output_dir="{tmp_path}"',
            'task.factory="runner.tasks.qa:make_task"',
            "task.kwargs={}",
            f'task.kwargs.path="{path}"',
            f'task.kwargs.eval_path="{held}"',
            "task.kwargs.max_tokens_per_turn=4",
            "sft.steps=3",
            "rl.steps=2",
            "checkpoint.interval=0",
        ],
    )
    result = run(cfg, progress=False)
    rl = [r for r in result.metrics if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["turns"] == 1.0 and "env/correct" in r for r in rl)
    assert all(r["echo_env/num_obs_tokens"] == 0 for r in rl)  # single turn: no observations


def test_lookup_task_expert_and_observation_targets():
    from runner.tasks import lookup

    task = check_task(
        "lookup", lookup.make_task(tokenizer=CharTokenizer(), hops=3, max_turns=4), tok.VOCAB_SIZE
    )
    problems = task.problems(np.random.default_rng(0), 5)

    def expert(ctx, rng):
        table, q = ctx[len("<bos>") :].split("\nQ: ")
        values = dict(kv.split("=") for kv in table.split(","))
        key, answered = q[0], ctx.count("\n= ")
        for _ in range(answered):
            key = values[key]
        return f"get {key}\n" if not key.isdigit() else f"ans {key}\n"

    groups = rollout(FakeSampler(expert), task, problems, group_size=2)
    for g, p in zip(groups, problems, strict=True):
        for e in g:
            assert e.reward == 1.0 and e.num_turns == 4
            seq = episode_to_seq(e)
            bodies = tok.decode(seq.tokens[1:][seq.inputs["obs_mask"] > 0])
            assert bodies == "".join(p.chain[1:]) + p.answer
    # the default budget (max_turns = hops) is one turn short: the last link is read from the table
    short = check_task(
        "lookup", lookup.make_task(tokenizer=CharTokenizer(), hops=2), tok.VOCAB_SIZE
    )
    demo = short.task.demonstrations(np.random.default_rng(1), 1)[0]["messages"]
    assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"]
    [[e]] = rollout(
        FakeSampler(lambda c, r: "get z\n"),
        short,
        short.problems(np.random.default_rng(2), 1),
        group_size=1,
    )
    assert e.stop == "done" and e.reward == 0.0 and e.num_turns == 2
    assert tok.decode(episode_to_seq(e).tokens).count("= ?\n") == 1
    with pytest.raises(ValueError, match=r"hops <= num_keys"):
        lookup.make_task(tokenizer=CharTokenizer(), num_keys=2, hops=3)
