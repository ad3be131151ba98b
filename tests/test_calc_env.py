"""The calculator environment: tokenizer, protocol, rewards, masks, expert, multi-turn rollout."""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import losses
from runner import Sample, Seq
from runner.env import (
    STOP_TOKEN_IDS,
    CalcEnv,
    CalcError,
    Problem,
    Trajectory,
    evaluate,
    expert_actions,
    expert_sft_example,
    expert_trajectory,
    rollout,
    tool_output,
    trajectory_to_seq,
)
from runner.env import tokenizer as tok
from runner.sft import collate_sft, translate_sft_batch

# -- tokenizer ------------------------------------------------------------------------------------


def test_vocabulary_layout():
    assert tok.VOCAB_SIZE <= 64
    assert (tok.PAD_ID, tok.BOS_ID, tok.EOS_ID) == (0, 1, 2)
    assert tok.VOCAB_SIZE == len(tok.SPECIALS) + len(set(tok.CHARS))
    for ch in "0123456789+-*= \n:calcnserorbadxpimQ":
        assert len(tok.encode(ch)) == 1
    assert tok.encode("a", add_bos=True, add_eos=True) == [
        tok.BOS_ID,
        tok.encode("a")[0],
        tok.EOS_ID,
    ]
    assert tok.decode([tok.BOS_ID, 3, tok.EOS_ID, tok.PAD_ID]) == "<bos>0<eos><pad>"
    assert tok.decode([tok.BOS_ID, 3, tok.EOS_ID], skip_special=True) == "0"
    assert tok.decode(np.array(tok.encode("calc 1\n"))) == "calc 1\n"
    assert tok.decode([]) == ""


@given(st.text(alphabet=tok.CHARS, max_size=40))
def test_tokenizer_round_trip(text):
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(len(tok.SPECIALS) <= i < tok.VOCAB_SIZE for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True), skip_special=True) == text


@given(
    prefix=st.text(alphabet=tok.CHARS, max_size=10),
    bad=st.characters(blacklist_characters=tok.CHARS),
    suffix=st.text(max_size=5),
)
def test_encode_rejects_unknown_characters(prefix, bad, suffix):
    with pytest.raises(ValueError, match=re.escape(f"character {bad!r} at position {len(prefix)}")):
        tok.encode(prefix + bad + suffix)


def test_decode_errors():
    with pytest.raises(
        ValueError, match=r"token id 53 at position 2: outside the vocabulary \[0, 53\)"
    ):
        tok.decode([3, 4, tok.VOCAB_SIZE])
    with pytest.raises(ValueError, match="token id -1 at position 0"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="integer token ids"):
        tok.decode([1.5])
    with pytest.raises(ValueError, match="encode expects a str"):
        tok.encode(b"12")


# -- calculator -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, value",
    [
        ("48*2", 96),
        ("96+7", 103),
        ("48*2+7", 103),
        ("7+48*2", 103),
        ("2-3-4", -5),
        ("2*3*4-1", 23),
        ("-5*3", -15),
        ("3--5", 8),
        ("007", 7),
        ("999999999999-1", 999999999998),
        ("0", 0),
        ("999999999*999", 998999999001),
    ],
)
def test_evaluate(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, body",
    [
        ("", "error: bad expression"),
        ("4/2", "error: bad expression"),
        ("4 + 2", "error: bad expression"),
        ("4+", "error: bad expression"),
        ("+4", "error: bad expression"),
        ("(4)", "error: bad expression"),
        ("--4", "error: bad expression"),
        ("1234567890123", "error: bad expression"),  # more than 12 digits
        ("__import__", "error: bad expression"),
        ("999999999*999999999", "error: result too large"),
        ("999999999*1001+1", "error: result too large"),
    ],
)
def test_evaluate_errors(expr, body):
    with pytest.raises(CalcError) as info:
        evaluate(expr)
    assert info.value.body == body


@given(
    operands=st.lists(st.integers(0, 99), min_size=1, max_size=5),  # 99**5 < 10**12
    data=st.data(),
)
def test_evaluate_matches_python_arithmetic(operands, data):
    ops = data.draw(
        st.lists(st.sampled_from("+-*"), min_size=len(operands) - 1, max_size=len(operands) - 1)
    )
    expr = Problem(tuple(operands), tuple(ops)).expression
    assert re.fullmatch(r"[0-9+\-*]+", expr)  # digits and operators only: eval is safe here
    assert evaluate(expr) == eval(expr)  # noqa: S307


# -- problems -------------------------------------------------------------------------------------

_env_knobs = st.fixed_dictionaries(
    dict(
        seed=st.integers(0, 2**31 - 1),
        max_operand=st.integers(0, 99),
        num_ops=st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 2), st.integers(2, 4))),
        max_turns=st.one_of(st.none(), st.integers(1, 7)),
        operators=st.sampled_from(["+-*", "+", "*", "-*"]),
    )
)


@given(knobs=_env_knobs, index=st.integers(0, 10**6))
def test_problem_generation(knobs, index):
    env = CalcEnv(**knobs)
    p = env.problem(index)
    lo, hi = env.num_ops
    assert lo <= len(p.ops) <= hi
    assert all(0 <= x <= knobs["max_operand"] for x in p.operands)
    assert set(p.ops) <= set(knobs["operators"])
    assert Problem.parse(p.expression) == p
    assert p.answer == evaluate(p.expression)
    prompt = env.prompt_tokens(p)
    assert prompt[0] == tok.BOS_ID and prompt.dtype == np.int64
    assert tok.decode(prompt[1:]) == f"Q: {p.expression}\n"
    assert len(prompt) <= env.max_prompt_tokens()
    # determinism: problem i is a function of (seed, i)
    assert CalcEnv(**knobs).problem(index) == p
    rng1, rng2 = np.random.default_rng(index), np.random.default_rng(index)
    assert env.sample_problem(rng1) == env.sample_problem(rng2)


def test_expert_succeeds_with_long_products():
    """Intermediate results with more than 9 digits can be fed back to the calculator."""
    env = CalcEnv(seed=0, max_operand=99, num_ops=5, operators="*")
    for p in env.problems(0, 10):
        assert expert_trajectory(env, p).reward == 1.0
    assert CalcEnv(max_operand=10**10, num_ops=3, operators="+").max_operand == 10**10


def test_seeds_give_different_problems():
    a = CalcEnv(seed=0, max_operand=99, num_ops=2).problems(0, 20)
    b = CalcEnv(seed=1, max_operand=99, num_ops=2).problems(0, 20)
    assert a != b
    assert a == CalcEnv(seed=0, max_operand=99, num_ops=2).problems(0, 20)
    assert len({p.expression for p in a}) > 15


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(num_ops=0), "num_ops"),
        (dict(num_ops=(3, 2)), "num_ops"),
        (dict(max_turns=0), "max_turns"),
        (dict(min_operand=5, max_operand=4), "min_operand"),
        (dict(operators="/"), "operators"),
        (dict(max_operand=9999, num_ops=3), "limit"),
    ],
)
def test_env_rejects_bad_knobs(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        CalcEnv(**kwargs)


# -- protocol and rewards -------------------------------------------------------------------------

P = Problem((48, 2, 7), ("*", "+"))  # 48*2+7 = 103


def _play(lines, max_turns=4, problem=P):
    traj = Trajectory(CalcEnv(max_operand=99, num_ops=2, max_turns=max_turns), problem)
    for line in lines:
        traj.add_action(tok.encode(line))
    return traj


@pytest.mark.parametrize(
    "lines, reward, outcome, observations",
    [
        (["ans 103\n"], 1.0, "correct", []),
        (["calc 48*2\n", "calc 96+7\n", "ans 103\n"], 1.0, "correct", ["96", "103"]),
        (["ans 104\n"], 0.0, "wrong_answer", []),
        (["ans -103\n"], 0.0, "wrong_answer", []),
        (["ans 0103\n"], 0.0, "malformed_answer", []),
        (["ans  103\n"], 0.0, "malformed_answer", []),
        (["ans 1o3\n"], 0.0, "malformed_answer", []),
        (["ans\n"], 0.0, "malformed_answer", []),
        (["ans 103"], 0.0, "unterminated", []),  # no newline: the turn hit its token limit
        (["calc 48:2\n", "ans 103\n"], 1.0, "correct", ["error: bad expression"]),
        (["calc\n", "ans 1\n"], 0.0, "wrong_answer", ["error: bad expression"]),
        (["answer 103\n", "ans 103\n"], 1.0, "correct", ["error: unknown command"]),
        (["\n", "ans 103\n"], 1.0, "correct", ["error: unknown command"]),
        (["calc 1+1\n"] * 4, 0.0, "max_turns", ["2"] * 3),
        (
            ["calc 1+1\n"] * 3 + ["ans 103\n"],
            1.0,
            "correct",
            ["2"] * 3,
        ),  # answering on the last turn
    ],
)
def test_rewards(lines, reward, outcome, observations):
    traj = Trajectory(CalcEnv(max_operand=99, num_ops=2, max_turns=4), P)
    for line in lines:
        result = traj.add_action(tok.encode(line))
    assert traj.done and result.done
    assert traj.reward == result.reward == reward
    assert traj.outcome == outcome
    assert traj.observations == observations
    assert traj.num_turns == len(lines)
    with pytest.raises(ValueError, match="episode is over"):
        traj.add_action(tok.encode("ans 103\n"))


def test_eos_ends_the_episode():
    traj = _play([])
    traj.add_action(tok.encode("calc 1") + [tok.EOS_ID])
    assert (traj.done, traj.reward, traj.outcome) == (True, 0.0, "unterminated")


def test_special_tokens_in_an_action_make_it_malformed():
    traj = _play([])
    r = traj.add_action([tok.BOS_ID] + tok.encode("ans 103\n"))
    assert r.outcome == "continue" and r.observation.body == "error: unknown command"
    r = traj.add_action(tok.encode("ans 10") + [tok.PAD_ID] + tok.encode("3\n"))
    assert r.outcome == "malformed_answer"


def test_add_action_rejects_stop_tokens_before_the_end_and_bad_logprobs():
    traj = _play([])
    with pytest.raises(ValueError, match="stop token at position 6 before its end"):
        traj.add_action(tok.encode("calc 1\nans 1\n"))
    with pytest.raises(ValueError, match="logprobs have shape"):
        traj.add_action(tok.encode("ans 1\n"), logprobs=[0.0])
    assert traj.num_turns == 0


_action_text = st.text(alphabet=tok.CHARS.replace("\n", ""), max_size=14).map(lambda s: s + "\n")


@given(
    action=st.one_of(
        _action_text, st.builds("calc {}\n".format, st.text("0123456789+-*", max_size=12))
    ),
    seeds=st.tuples(st.integers(0, 99), st.integers(0, 99)),
    turns=st.tuples(st.integers(0, 2), st.integers(0, 2)),
)
def test_observation_is_a_deterministic_function_of_the_action(action, seeds, turns):
    """Same action → same observation, whatever the problem, the turn or earlier history."""
    env = CalcEnv(max_operand=20, num_ops=2, max_turns=5)
    p1, p2 = env.problem(seeds[0]), env.problem(seeds[1])
    r1, r2 = env.respond(p1, action, turns[0]), env.respond(p2, action, turns[1])
    if action.startswith("ans"):
        assert r1.done and r1.observation is None
        return
    assert not r1.done and not r2.done and r1.reward == 0.0
    assert r1.observation.body == r2.observation.body == tool_output(action[:-1])
    np.testing.assert_array_equal(r1.observation.tokens, r2.observation.tokens)
    assert r1.observation.text == f"= {r1.observation.body}\n"
    assert r1.observation.body_mask.tolist() == [0, 0] + [1] * len(r1.observation.body) + [0]
    # and through a trajectory with a different history
    t = Trajectory(env, p2)
    t.add_action(tok.encode("calc 1+2\n"))
    t.add_action(tok.encode(action))
    assert t.observations[-1] == r1.observation.body


# -- masks ----------------------------------------------------------------------------------------


def _runs(mask):
    """[(start, end)] of the contiguous runs of 1s."""
    edges = np.diff(np.concatenate([[0], (np.asarray(mask) > 0).astype(int), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def check_seq_masks(traj: Trajectory, seq: Seq, logprobs_per_action=None):
    """The target-aligned masks of ``seq`` describe exactly ``traj``'s segments."""
    a, o, lp = seq.inputs["action_mask"], seq.inputs["obs_mask"], seq.inputs["sampling_logprobs"]
    n = len(seq.tokens) - 1
    assert a.shape == o.shape == lp.shape == (n,)
    np.testing.assert_array_equal(seq.tokens, traj.tokens)
    assert set(np.unique(a)) <= {0.0, 1.0} and set(np.unique(o)) <= {0.0, 1.0}
    assert not np.any((a > 0) & (o > 0)), "masks overlap"
    prompt_targets = traj.prompt_length - 1
    assert not a[:prompt_targets].any() and not o[:prompt_targets].any()
    targets = seq.targets
    # obs_mask covers exactly the observation bodies
    assert [tok.decode(targets[s:e]) for s, e in _runs(o)] == [b for b in traj.observations if b]
    # action_mask covers exactly the policy's tokens, turn by turn
    assert tok.decode(targets[a > 0]) == "".join(traj.actions)
    act_segs = [s for s in traj.segments if s.kind == "action"]
    if all(len(s.tokens) for s in act_segs):
        assert [tok.decode(targets[s:e]) for s, e in _runs(a)] == traj.actions
    # sampling logprobs only on actions, equal to the sampler's
    assert not lp[a == 0].any()
    expected = np.concatenate([s.logprobs for s in act_segs]) if act_segs else np.zeros(0)
    np.testing.assert_array_equal(lp[a > 0], expected)
    if logprobs_per_action is not None:
        np.testing.assert_array_equal(lp[a > 0], np.concatenate(logprobs_per_action))
    # everything else is prompt or observation wrapper text
    rest = tok.decode(
        targets[prompt_targets:][(a == 0)[prompt_targets:] & (o == 0)[prompt_targets:]]
    )
    n_obs = sum(s.kind == "observation" for s in traj.segments)
    assert rest == "= \n" * n_obs


def test_example_trajectory_masks():
    traj = _play(["calc 48*2\n", "calc 96+7\n", "ans 103\n"])
    seq = trajectory_to_seq(traj)
    assert tok.decode(seq.tokens) == "<bos>Q: 48*2+7\ncalc 48*2\n= 96\ncalc 96+7\n= 103\nans 103\n"
    picture = "".join(
        "A" if a else "O" if o else "."
        for a, o in zip(seq.inputs["action_mask"], seq.inputs["obs_mask"], strict=True)
    )
    assert (
        picture == "." * 10 + "A" * 10 + ".." + "OO" + "." + "A" * 10 + ".." + "OOO" + "." + "A" * 8
    )
    assert set(seq.inputs) == {"action_mask", "obs_mask", "sampling_logprobs"}
    check_seq_masks(traj, seq)


@given(
    lines=st.lists(
        st.one_of(
            _action_text,
            st.sampled_from(["calc 48*2\n", "calc 2:0\n", "ans 103\n", "ans 7\n", "calc 9"]),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_masks_on_arbitrary_trajectories(lines, seed):
    env = CalcEnv(max_operand=99, num_ops=2, max_turns=4)
    traj = Trajectory(env, P)
    rng = np.random.default_rng(seed)
    given_lps = []
    for line in lines:
        if traj.done:
            break
        ids = tok.encode(line)
        lps = -rng.uniform(0.01, 3.0, size=len(ids))
        given_lps.append(lps)
        traj.add_action(ids, lps)
    check_seq_masks(traj, trajectory_to_seq(traj), given_lps)


def test_echo_observation_mask_contains_wrappers_that_ours_excludes():
    """losses.observation_mask (every non-action, non-prompt target) ⊇ our body-only obs_mask."""
    seq = trajectory_to_seq(_play(["calc 48*2\n", "calc 96+7\n", "ans 103\n"]))
    a, o = seq.inputs["action_mask"][None], seq.inputs["obs_mask"][None]
    implied = np.asarray(losses.observation_mask(a, np.ones_like(a), prompt_lengths=np.array([11])))
    assert np.all(implied >= o)
    assert tok.decode(seq.targets[(implied - o)[0] > 0]) == "= \n= \n"


# -- expert ---------------------------------------------------------------------------------------


def test_expert_actions_known():
    assert expert_actions(P) == ["calc 48*2\n", "calc 96+7\n", "ans 103\n"]
    q = Problem((7, 48, 2, 5), ("-", "*", "-"))  # 7-96-5 = -94
    assert expert_actions(q) == ["calc 48*2\n", "calc 7-96\n", "calc -89-5\n", "ans -94\n"]
    assert expert_actions(q, max_turns=2) == ["calc 7-48*2-5\n", "ans -94\n"]
    assert expert_actions(q, max_turns=1) == ["ans -94\n"]


@given(knobs=_env_knobs, index=st.integers(0, 10**6))
def test_expert_always_succeeds(knobs, index):
    env = CalcEnv(**knobs)
    problem = env.problem(index)
    traj = expert_trajectory(env, problem)
    assert (traj.done, traj.reward, traj.outcome) == (True, 1.0, "correct")
    assert traj.num_turns <= env.max_turns
    assert all(not b.startswith("error") for b in traj.observations)
    seq = trajectory_to_seq(traj)
    check_seq_masks(traj, seq)
    longest_action = max(len(a) for a in traj.actions)
    assert len(seq.tokens) <= env.max_episode_tokens(longest_action)


def test_expert_sft_examples_through_the_sft_path():
    env = CalcEnv(seed=3, max_operand=20, num_ops=2)
    problems = env.problems(0, 4)
    for supervise in ("actions", "actions+obs", "all"):
        examples = [expert_sft_example(env, p, supervise=supervise) for p in problems]
        seqs = translate_sft_batch(*collate_sft(examples), max_seq_len=64)
        assert len(seqs) == 4
        assert sum(s.inputs["weights"].sum() for s in seqs) == pytest.approx(1.0)
        for seq, p in zip(seqs, problems, strict=True):
            ref = trajectory_to_seq(expert_trajectory(env, p))
            np.testing.assert_array_equal(seq.tokens, ref.tokens)
            supervised = seq.inputs["weights"] > 0
            if supervise == "actions":
                np.testing.assert_array_equal(supervised, ref.inputs["action_mask"] > 0)
            elif supervise == "actions+obs":
                np.testing.assert_array_equal(
                    supervised, (ref.inputs["action_mask"] + ref.inputs["obs_mask"]) > 0
                )
            else:
                assert supervised.sum() == len(seq.tokens) - ref_prompt_len(env, p)
    with pytest.raises(ValueError, match="supervise"):
        expert_sft_example(env, problems[0], supervise="obs")


def ref_prompt_len(env, p):
    return len(env.prompt_tokens(p))


# -- rollout --------------------------------------------------------------------------------------


def _fake_logprobs(ids):
    return (-0.05 - 0.01 * np.asarray(ids, dtype=np.float64)).astype(np.float32)


class FakeSampler:
    """A `Trainer.sample` stand-in that replays a scripted policy ``policy(context, rng) -> text``.

    It honours ``max_tokens`` and ``stop_token_ids`` like a real sampler (unless ``ignore_stops``),
    draws with ``np.random.default_rng([seed, prompt, sample])`` and returns fake logprobs.
    """

    def __init__(self, policy, ignore_stops=False):
        self.policy = policy
        self.ignore_stops = ignore_stops
        self.calls = []

    def sample(
        self, prompts, *, num_samples, max_tokens, temperature=1.0, seed=0, stop_token_ids=()
    ):
        self.calls.append(
            dict(
                n=len(prompts),
                num_samples=num_samples,
                max_tokens=max_tokens,
                seed=seed,
                stop=tuple(stop_token_ids),
            )
        )
        out = []
        for i, prompt in enumerate(prompts):
            row = []
            for k in range(num_samples):
                text = self.policy(tok.decode(prompt), np.random.default_rng([seed, i, k]))
                ids = tok.encode(text)
                reason = "length"
                if not self.ignore_stops:
                    for j, t in enumerate(ids):
                        if t in stop_token_ids:
                            ids, reason = ids[: j + 1], "stop"
                            break
                    ids = ids[:max_tokens]
                row.append(Sample(np.array(ids, np.int64), _fake_logprobs(ids), reason))
            out.append(row)
        return out


def expert_policy(context, rng):
    expr = re.match(r"<bos>Q: ([0-9+\-*]+)\n", context).group(1)
    turn = (context.count("\n") - 1) // 2
    return expert_actions(Problem.parse(expr))[turn]


def random_policy(context, rng):
    expr = re.match(r"<bos>Q: ([0-9+\-*]+)\n", context).group(1)
    choices = [
        "calc 1+1\n",
        "ans 3\n",
        f"ans {evaluate(expr)}\n",
        "foo\n",
        "calc 2:3\n",
        "calc 4*5\n",
    ]
    return choices[rng.integers(len(choices))]


def test_rollout_with_the_expert_policy():
    env = CalcEnv(seed=0, max_operand=30, num_ops=(1, 3))
    problems = env.problems(0, 5)
    sampler = FakeSampler(expert_policy)
    groups = rollout(
        sampler, env, problems, group_size=3, max_tokens_per_turn=16, temperature=0.7, seed=5
    )
    assert len(groups) == 5 and all(len(g) == 3 for g in groups)
    for g, p in zip(groups, problems, strict=True):
        for traj in g:
            assert traj.problem == p and traj.reward == 1.0 and traj.outcome == "correct"
            ref = expert_trajectory(env, p)
            seq = trajectory_to_seq(traj)
            np.testing.assert_array_equal(seq.tokens, ref.tokens)
            check_seq_masks(traj, seq, [_fake_logprobs(tok.encode(a)) for a in traj.actions])
    first = sampler.calls[0]
    assert first == dict(n=5, num_samples=3, max_tokens=16, seed=first["seed"], stop=STOP_TOKEN_IDS)
    assert all(c["num_samples"] == 1 and c["stop"] == STOP_TOKEN_IDS for c in sampler.calls[1:])
    assert len(sampler.calls) == max(len(p.ops) for p in problems) + 1
    assert len({c["seed"] for c in sampler.calls}) == len(sampler.calls)


def test_rollout_is_deterministic_given_the_seed():
    env = CalcEnv(seed=1, max_operand=9, num_ops=2, max_turns=4)
    problems = env.problems(10, 6)

    def run(seed):
        groups = rollout(
            FakeSampler(random_policy),
            env,
            problems,
            group_size=4,
            max_tokens_per_turn=12,
            seed=seed,
        )
        return [(t.text, t.reward, t.outcome) for g in groups for t in g]

    a = run(0)
    assert a == run(0)
    assert a != run(1)
    outcomes = {o for _, _, o in a}
    assert {"correct", "wrong_answer"} <= outcomes
    for _text, reward, outcome in a:
        assert reward == (1.0 if outcome == "correct" else 0.0)


def test_rollout_rewards_with_a_random_policy_match_the_env():
    env = CalcEnv(seed=2, max_operand=9, num_ops=1, max_turns=3)
    groups = rollout(
        FakeSampler(random_policy), env, env.problems(0, 8), group_size=2, max_tokens_per_turn=12
    )
    for traj in (t for g in groups for t in g):
        replay = Trajectory(env, traj.problem)
        for a in traj.actions:
            replay.add_action(tok.encode(a))
        assert (replay.reward, replay.outcome, replay.text) == (
            traj.reward,
            traj.outcome,
            traj.text,
        )
        check_seq_masks(traj, trajectory_to_seq(traj))


def test_rollout_cuts_samples_at_the_first_stop_token():
    env = CalcEnv(max_operand=99, num_ops=2)
    sampler = FakeSampler(lambda ctx, rng: "calc 48*2\nans 103\n", ignore_stops=True)
    [[traj]] = rollout(sampler, env, [P], group_size=1, max_tokens_per_turn=32)
    assert traj.actions[0] == "calc 48*2\n" and traj.observations[0] == "96"
    check_seq_masks(traj, trajectory_to_seq(traj))


def test_rollout_turn_token_limit_ends_the_episode():
    env = CalcEnv(max_operand=99, num_ops=2)
    [[traj]] = rollout(
        FakeSampler(lambda ctx, rng: "calc 48*2+7\n"), env, [P], group_size=1, max_tokens_per_turn=6
    )
    assert traj.actions == ["calc 4"] and traj.outcome == "unterminated" and traj.reward == 0.0
    # a sampler that ignores max_tokens is clipped too
    [[traj]] = rollout(
        FakeSampler(lambda ctx, rng: "ans 1033", ignore_stops=True),
        env,
        [P],
        group_size=1,
        max_tokens_per_turn=5,
    )
    assert traj.actions == ["ans 1"]


def test_rollout_context_limit():
    env = CalcEnv(max_operand=99, num_ops=2)
    sampler = FakeSampler(expert_policy)
    # prompt 11 tokens + "calc 48*2\n" (10) + "= 96\n" (5) = 26; the next turn needs 26 + 16 - 1
    [[traj]] = rollout(sampler, env, [P], group_size=1, max_tokens_per_turn=16, max_seq_len=40)
    assert traj.outcome == "context_limit" and traj.reward == 0.0 and traj.done
    assert traj.text == "<bos>Q: 48*2+7\ncalc 48*2\n"  # the trailing observation is dropped
    assert trajectory_to_seq(traj).num_targets <= 40
    [[traj]] = rollout(sampler, env, [P], group_size=1, max_tokens_per_turn=16, max_seq_len=41)
    assert traj.num_turns == 2 and traj.outcome == "context_limit"
    [[a, b]] = rollout(sampler, env, [P], group_size=2, max_tokens_per_turn=16, max_seq_len=25)
    assert a.num_turns == b.num_turns == 0 and a.outcome == "context_limit"
    [[traj]] = rollout(sampler, env, [P], group_size=1, max_tokens_per_turn=16, max_seq_len=99)
    assert traj.outcome == "correct"
    with pytest.raises(ValueError, match="cannot terminate"):
        traj.terminate("context_limit")
    with pytest.raises(ValueError, match="max_seq_len"):
        rollout(sampler, env, [P], group_size=1, max_tokens_per_turn=16, max_seq_len=0)


def test_rollout_argument_and_sampler_errors():
    env = CalcEnv()
    assert rollout(FakeSampler(random_policy), env, [], group_size=2, max_tokens_per_turn=4) == []
    with pytest.raises(ValueError, match="group_size"):
        rollout(FakeSampler(random_policy), env, [P], group_size=0, max_tokens_per_turn=4)
    with pytest.raises(ValueError, match="max_tokens_per_turn"):
        rollout(FakeSampler(random_policy), env, [P], group_size=1, max_tokens_per_turn=0)

    class Short(FakeSampler):
        def sample(self, prompts, **kw):
            return super().sample(prompts, **kw)[:-1]

    with pytest.raises(ValueError, match="sample\\(\\) returned"):
        rollout(Short(random_policy), env, [P, P], group_size=1, max_tokens_per_turn=4)


def test_rollout_smoke_against_the_local_trainer():
    """The real sampler: masks stay exact and sampling logprobs equal forward() at temperature 1."""
    local = pytest.importorskip("runner.local")
    trainer = local.LocalTrainer(
        local.LocalTrainerConfig(
            vocab_size=tok.VOCAB_SIZE, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64
        )
    )
    env = CalcEnv(seed=0, max_operand=9, num_ops=1, max_turns=3)
    kwargs = dict(group_size=3, max_tokens_per_turn=24, temperature=1.0, seed=4, max_seq_len=64)
    groups = rollout(trainer, env, env.problems(0, 2), **kwargs)
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 6 and all(t.done and t.reward in (0.0, 1.0) for t in trajs)
    seqs = [trajectory_to_seq(t) for t in trajs]
    for traj, seq in zip(trajs, seqs, strict=True):
        check_seq_masks(traj, seq)
        assert seq.num_targets <= 64
    for seq, lp in zip(seqs, trainer.forward(seqs), strict=True):
        act = seq.inputs["action_mask"] > 0
        np.testing.assert_allclose(lp[act], seq.inputs["sampling_logprobs"][act], atol=1e-4)
    again = rollout(trainer, env, env.problems(0, 2), **kwargs)
    assert [t.text for g in again for t in g] == [t.text for t in trajs]
