"""A user's task, data and loss: one run on ``--backend local``, ``tinker`` and ``fireworks``.

Issue #14: the main job is not only the calculator. A user's job file (written here, as a user
writes theirs) names a task defined in this test module (``[task] factory``, not shipped: the
probe task of tests/test_tasks.py with a graded reward), a JSONL of SFT records in both record
formats (``[sft] data``, ``eval_data``) and a loss of its own (``[rl] loss`` with
``loss_kwargs``, its terms named by the user). The job runs through ``runner.__main__.main`` in
process (``x64`` on, like the in-process regimes of tests/test_tinker_main_job.py and
tests/test_fireworks_main_job.py) on the local backend, then on both hosted backends through the
real, unmodified SDKs against one local server serving that file's ``[model]`` (a server thread,
one key per SDK; the server trains full weights, so like is compared with like).

Each hosted run's per-step metrics (SFT NLL, eval NLL, rewards, the task's own metrics, the
user's loss terms, pass counts) equal the local run's, each SFT step trained on the same file
lines, and the final weights (the Tinker run's sampler weights, the Fireworks run's promoted
model) agree with the local run's within 1e-6. The metrics show the user's pieces were used: the
task's ``env/probes`` and a reward proportional to its ``env/yes_tokens``, the data file's
lines, and the loss's ``policy/`` and ``world/`` terms (no ``grpo/``).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

import losses  # noqa: E402
from runner import __main__ as cli  # noqa: E402
from runner import checkpoints as ckpt  # noqa: E402
from runner.env import tokenizer as tok  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from runner.tasks import StepResult  # noqa: E402
from tests.test_tasks import ProbeEnv, ProbeTask  # noqa: E402
from tests.wire_helpers import (  # noqa: E402
    COUNTED,
    TINY,
    assert_no_key,
    assert_same_metrics,
    assert_weights_close,
    final_weights,
    no_control_plane_waits,
    promoted_weights,
    records,
)

HERE = __name__  # this module, importable as a [task] factory / [rl] loss
BASE = "accounts/fireworks/models/qwen3-8b"  # a Fireworks-style name: both SDKs train on it
SHAPE = "accounts/fireworks/trainingShapes/ts-qwen3-8b-policy"
FW_ENV, TML_ENV = "FOLDLOSS_TEST_HOSTED_FW_KEY", "FOLDLOSS_TEST_HOSTED_TML_KEY"
FW_KEY, TML_KEY = f"fw-SENTINEL-{uuid.uuid4().hex}", f"tml-SENTINEL-{uuid.uuid4().hex}"
COMPARED = (
    "sft/nll",
    "sft/eval_nll",
    "reward",
    "eval_reward",
    "loss",
    "policy/loss",
    "world/nll",
    "env/probes",
    "env/said_yes",
    "env/yes_tokens",
)
SFT_STEPS, RL_STEPS = 3, 2
YES = frozenset(tok.encode("yes\n"))


# -- the user's task and loss ---------------------------------------------------------------------


class GradedProbeEnv(ProbeEnv):
    """The probe episode (``n=<d>`` → anything → ``= ok<d>`` → ``yes``), its last turn rewarded
    ``k / max_tokens_per_turn`` for ``k`` tokens among the characters of ``yes\\n`` (metric
    ``yes_tokens``), so an untrained policy's group rewards already differ."""

    def step(self, action):
        result = super().step(action)
        if not result.done:
            return result
        k = sum(t in YES for t in action)
        reward = k / ProbeTask.max_tokens_per_turn
        return StepResult(reward, True, metrics={**result.metrics, "yes_tokens": float(k)})


class GradedProbeTask(ProbeTask):
    def make_env(self, problem):
        return GradedProbeEnv(problem)


def make_graded_task(*, tokenizer):
    return GradedProbeTask()


def make_named_loss(*, env_coef):
    """GRPO and ECHO under the user's names (metrics ``policy/...`` and ``world/...``)."""
    return losses.fold(
        ("policy", losses.grpo(clip_low=0.2, clip_high=0.28)),
        ("world", losses.echo_env(coef=env_coef)),
    )


def _probe_record(p: int, i: int) -> dict:
    if i % 2:  # the prompt/completion format: the last answer only is trained
        return {"prompt": f"n={p}\ngo\n= ok{p}\n", "completion": "yes\n"}
    return {
        "messages": [
            {"role": "user", "content": f"n={p}\n"},
            {"role": "assistant", "content": "go\n"},
            {"role": "tool", "content": f"= ok{p}\n"},
            {"role": "assistant", "content": "yes\n"},
        ]
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The user's job file, its data beside it."""
    d = tmp_path_factory.mktemp("job")
    train = [json.dumps(_probe_record(p, i)) for i, p in enumerate([3, 1, 4, 1, 5, 9])]
    (d / "train.jsonl").write_text("\n".join(train) + "\n")
    (d / "eval.jsonl").write_text(json.dumps(_probe_record(2, 0)) + "\n")
    model = TINY.read_text().split("[model]", 1)[1].split("[", 1)[0]  # tiny.toml's model
    (d / "job.toml").write_text(
        f"""
[run]
name = "probe"
seed = 1

[model]{model}
[task]
factory = "{HERE}:make_graded_task"

[sft]
data = "{d / "train.jsonl"}"
eval_data = "{d / "eval.jsonl"}"
steps = {SFT_STEPS}
batch_size = 4
learning_rate = 0.01

[rl]
steps = {RL_STEPS}
problems_per_step = 2
group_size = 4
loss = "{HERE}:make_named_loss"
loss_kwargs = {{ env_coef = 0.05 }}

[checkpoint]
interval = 2
save_promotable = true
"""
    )
    return d / "job.toml"


def _train_args(job: Path, out: Path, backend: str, *sets: str) -> list[str]:
    args = ["train", "--config", str(job), "--backend", backend, "--output-dir", str(out)]
    args.append("--no-progress")
    for s in sets:
        args += ["--set", s]
    return args


@pytest.fixture(scope="module")
def local_run(job, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local")
    assert cli.main(_train_args(job, out, "local")) == 0
    run_dir = out / "probe"
    recs = records(run_dir)
    # the user's task: its own metrics, and the reward they make
    rl = [r for r in recs.values() if r.get("phase") == "rl"]
    assert len(rl) == RL_STEPS
    for r in rl:
        assert r["env/probes"] == 1.0 and r["env/said_yes"] <= r["reward"]
        assert r["reward"] == pytest.approx(r["env/yes_tokens"] / ProbeTask.max_tokens_per_turn)
        assert r["plan/client"] == 1.0  # the user's fold has ECHO: one fused client pass
        assert "policy/loss" in r and "world/nll" in r and "grpo/loss" not in r
    assert all(r["reward"] > 0 for r in rl)  # rewards that say something
    # the user's data: the first epoch (steps 1-2) visits every line of the file once
    lines = [recs[s]["data/lines"] for s in range(1, SFT_STEPS + 1)]
    assert sorted(lines[0] + lines[1]) == [1, 2, 3, 4, 5, 6] and len(lines[2]) == 4
    assert "sft/eval_nll" in recs[0] and "sft/eval_nll" in recs[SFT_STEPS]
    return run_dir


@pytest.fixture(scope="module")
def served(job, tmp_path_factory):
    """One server for both SDKs, serving the job file's model under a Fireworks-style name."""
    state = tmp_path_factory.mktemp("state")
    config = ServeConfig(
        api_key=FW_KEY, extra_api_keys=(TML_KEY,), state_dir=str(state), long_poll_s=0.5
    )
    with ServerThread(config, parse_model_flags([f"{BASE}={job}"])) as st:
        yield st, state


@pytest.mark.parametrize("backend", ["tinker", "fireworks"])
def test_the_users_task_data_and_loss_on_a_hosted_backend_equal_the_local_run(
    backend, job, local_run, served, tmp_path, monkeypatch, capsys
):
    st, state = served
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    if backend == "tinker":
        pytest.importorskip("tinker")
        key_env, key = TML_ENV, TML_KEY
        sets = [f"tinker.{k}" for k in ("lora_rank=8", "request_timeout_s=60.0")]
    else:
        pytest.importorskip("fireworks.training.sdk")
        no_control_plane_waits(monkeypatch)  # the control plane answers at once
        key_env, key = FW_ENV, FW_KEY
        sets = [f"fireworks.training_shape_id='{SHAPE}'", "fireworks.output_model_id='probe-final'"]
    monkeypatch.setenv(key_env, key)
    sets += [
        f"{backend}.base_url='{st.url}'",
        f"{backend}.base_model='{BASE}'",
        f"{backend}.api_key_env='{key_env}'",
    ]
    assert cli.main(_train_args(job, tmp_path, backend, *sets)) == 0
    done = capsys.readouterr()
    run_dir = tmp_path / "probe"
    root = run_dir / "checkpoints"
    assert ckpt.read_manifest(root, ckpt.latest_step(root))["backend"] == backend
    assert_same_metrics(run_dir, local_run, COMPARED, COUNTED)
    got, want = records(run_dir), records(local_run)
    for step in range(1, SFT_STEPS + 1):  # the same lines of the user's file
        assert got[step]["data/lines"] == want[step]["data/lines"], step
    if backend == "tinker":  # the sampler weights of the last checkpoint, as the server stored them
        final = final_weights(run_dir, state)
    else:  # the model the run promoted at its end
        final = promoted_weights(run_dir, state)
    assert_weights_close(final, final_weights(local_run))
    assert_no_key(key, done.out, done.err, dirs=(tmp_path,))
