"""Server-side custom losses: the real tinker SDK uploads user-written torch losses to the local
server (``create_custom_loss``), which validates each graph against its fixed table of operations
and runs it per datum in one forward + backward; the gradient equals the SDK's own client-side
path (forward, the loss in torch, a linear backward). Bad graphs are a 400 naming the node, and
a fuzz of mutated graphs never gets anything but a validation error while the server keeps
serving.
"""

from __future__ import annotations

import copy
import json
import os
import random
import urllib.error
import urllib.request
import uuid

import jax
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from tinker import types as tt  # noqa: E402
from tinker.lib.public_interfaces.custom_loss import (  # noqa: E402
    encode_graph,
    run_loss_handle,
    trace_loss,
)

import losses  # noqa: E402
from benchmarks.synthetic import multi_turn_seqs  # noqa: E402
from runner import AdamParams, StepRunner  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.local import LocalTrainer  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from runner.serve._graph import MAX_DEPTH, OPS, GraphError, compile_graph  # noqa: E402
from runner.tinker import make_trainer  # noqa: E402
from tests.wire_helpers import TINY  # noqa: E402

MODEL = "foldloss/tiny"
KEY_ENV = "FOLDLOSS_TEST_CUSTOM_KEY"
KEY = f"tml-{uuid.uuid4().hex}"
os.environ.setdefault("TINKER_TELEMETRY", "0")
MAX_NODES = 256


# -- user-written losses (what a Tinker user writes) ------------------------------------------


def nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss.detach()}


def ppo_clip(logprobs, old_logprobs, advantages, mask):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.28)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages) * mask
    return per_token.sum() / mask.sum().clamp(min=1.0), {}


def importance_sampling(logprobs, sampling_logprobs, advantages):
    log_ratio = (logprobs - sampling_logprobs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    loss = -(ratio * advantages).mean()
    metrics = {
        "custom/ratio_max:mean": ratio.detach().amax(),
        "custom/tokens:sum": torch.ones_like(logprobs).sum(),
        "custom/kl:mean": (ratio - 1 - log_ratio).mean().detach(),
    }
    return loss, metrics


LOSSES = [
    (nll, {"logprobs": 1, "weights": 1}),
    (ppo_clip, {"logprobs": 1, "old_logprobs": 1, "advantages": 0, "mask": 1}),
    (importance_sampling, {"logprobs": 1, "sampling_logprobs": 1, "advantages": 0}),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = parse_model_flags([f"{MODEL}=examples/tiny.toml"])
    state = tmp_path_factory.mktemp("custom-state")
    config = ServeConfig(
        api_key=KEY, state_dir=str(state), long_poll_s=0.5, max_loss_nodes=MAX_NODES
    )
    with ServerThread(config, models) as st:
        yield st


@pytest.fixture(scope="module")
def cfg(served):
    os.environ[KEY_ENV] = KEY
    return load_config(
        TINY,
        [
            "run.backend='tinker'",
            f"tinker.base_url='{served.url}'",
            f"tinker.base_model='{MODEL}'",
            f"tinker.api_key_env='{KEY_ENV}'",
            "tinker.lora_rank=8",
            "tinker.request_timeout_s=60.0",
        ],
    )


@pytest.fixture(scope="module")
def trainers(cfg):
    pair = [make_trainer(cfg), make_trainer(cfg)]  # the same initialization
    yield pair
    for t in pair:
        t.close()


def _datums(seed: int, n: int = 5) -> list[tt.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 40, size=int(rng.integers(4, 21))).astype(np.int64)
        t = tokens.shape[0] - 1
        lp = -rng.uniform(0.05, 3.0, t).astype(np.float32)
        inputs = {
            "target_tokens": tokens[1:],
            "weights": rng.uniform(-1, 1, t).astype(np.float32),
            "old_logprobs": lp,
            "sampling_logprobs": lp + rng.normal(0, 0.1, t).astype(np.float32),
            "advantages": np.asarray(rng.normal(), np.float32),
            "mask": (rng.uniform(size=t) < 0.7).astype(np.float32),
        }
        out.append(
            tt.Datum(
                model_input=tt.ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={k: tt.TensorData.from_numpy(v) for k, v in inputs.items()},
            )
        )
    return out


def _only(data, names):
    keep = {"target_tokens", *names}
    return [
        tt.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k in keep},
        )
        for d in data
    ]


def _served(served, trainer):
    return served.server.engine.models[trainer.model_id].trainer


def test_sdk_uploads_of_user_losses_run_in_one_pass_and_equal_the_client_path(served, trainers):
    server_side, client_side = trainers
    flags = server_side.service.holder.get_client_config()
    assert flags.custom_loss_server_side is True
    for i, (fn, ranks) in enumerate(LOSSES):
        handle = server_side.service.create_custom_loss(fn, ranks).result()
        assert handle.loss_id is not None  # uploaded: the server runs it
        data = _only(_datums(seed=i), handle.input_names)
        before = dict(_served(served, server_side).counters)
        one = server_side.client.forward_backward_custom(data, handle).result()
        after = _served(served, server_side).counters
        assert after["forward"] - before.get("forward", 0) == 1
        assert after["backward"] - before.get("backward", 0) == 1

        def client_loss(data, logprobs_list, handle=handle):
            return run_loss_handle(handle, data, logprobs_list)

        two = client_side.client.forward_backward_custom(data, client_loss).result()
        assert one.metrics["loss:sum"] == pytest.approx(two.metrics["loss:sum"], rel=1e-5)
        for key in (k for k in two.metrics if k.startswith("custom/")):
            assert one.metrics[key] == pytest.approx(two.metrics[key], rel=1e-5, abs=1e-6), key
        grads = [_served(served, t).accumulated_grads() for t in trainers]
        for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


# -- validation ------------------------------------------------------------------------------


def _encoded(fn, ranks) -> dict:
    handle = trace_loss(fn, ranks, "test")
    return {
        "name": handle.name,
        "inputs": [i.model_dump() for i in handle.inputs],
        "graph": encode_graph(handle).model_dump(),
    }


SEEDS = [_encoded(fn, ranks) for fn, ranks in LOSSES]


def _compile(req: dict):
    return compile_graph(req["name"], req["inputs"], req["graph"], max_nodes=MAX_NODES)


def test_the_encodings_of_user_losses_validate():
    for req in SEEDS:
        _compile(req)


def _mutant(rng: random.Random, base: dict) -> dict:
    req = copy.deepcopy(base)
    nodes = req["graph"]["nodes"]
    calls = [n for n in nodes if n["op"] in ("call_function", "call_method")]
    names = [n["name"] for n in nodes]
    kind = rng.randrange(14)
    node = rng.choice(calls)
    if kind == 0:
        node["target"] = rng.choice(
            [
                "os.system",
                "eval",
                "__import__",
                "torch.load",
                "exec",
                "subprocess.run",
                "builtins.open",
                "torch.nn.Linear",
            ]
        )
    elif kind == 1:
        node["op"] = rng.choice(["get_attr", "call_module", "exec", "", None])
    elif kind == 2:  # a ref to a later node or a missing one
        idx = nodes.index(node)
        later = names[idx:] + ["nope", "output"]
        node["args"] = [{"ref": rng.choice(later)}] + node["args"][1:]
    elif kind == 3:
        node["args"] = node["args"] + [1.0] * rng.randrange(1, 6)
    elif kind == 4:
        node["args"] = []
    elif kind == 5:
        deep: object = 1
        for _ in range(MAX_DEPTH + rng.randrange(1, 50)):
            deep = {"tuple": [deep]}
        node["args"] = node["args"] + [deep]
    elif kind == 6:
        req["graph"]["nodes"] = nodes + [copy.deepcopy(calls[0]) for _ in range(MAX_NODES)]
    elif kind == 7:
        node["name"] = names[0]  # duplicate
    elif kind == 8:  # a non-scalar loss
        out = nodes[-1]
        first_input = {"ref": names[0]}
        out["args"] = [{"tuple": [first_input, {"dict": {}}]}]
    elif kind == 9:
        node["kwargs"] = {rng.choice(["dim", "foo", "alpha", "out"]): rng.choice([0, 5, "x"])}
    elif kind == 10:
        rng.shuffle(nodes)
    elif kind == 11:
        node["target"] = rng.choice([k for _, k in OPS])
    elif kind == 12:
        node["args"] = [
            rng.choice(
                [
                    {"eval": "1"},
                    {"ref": 3},
                    {"float": "1e999"},
                    {"slice": 1},
                    {"dtype": "complex128"},
                    "x" * 100,
                    2**40,
                    [[[[]]]],
                ]
            )
        ]
    else:
        req["inputs"] = req["inputs"][: rng.randrange(len(req["inputs"]))] or [
            {"name": "Logprobs", "rank": 3}
        ]
    return req


def test_fuzzed_graphs_are_rejected_by_validation_alone():
    """1200 mutations: each is a GraphError or a valid program, and never compiles (only
    abstract tracing): the run takes seconds."""
    rng = random.Random(0)
    outcomes = {"rejected": 0, "valid": 0}
    for i in range(1200):
        req = _mutant(rng, SEEDS[i % len(SEEDS)])
        try:
            _compile(req)
        except GraphError as exc:
            assert "node" in str(exc) or "graph" in str(exc) or "inputs" in str(exc), str(exc)
            outcomes["rejected"] += 1
        else:
            outcomes["valid"] += 1
    assert outcomes["rejected"] > 900, outcomes


def _post(served, path, body) -> tuple[int, dict]:
    req = urllib.request.Request(
        served.url + path,
        data=json.dumps(body).encode(),
        headers={
            "X-API-Key": KEY,
            "Content-Type": "application/json",
            "User-Agent": "AsyncTinker/Python 0.38.0",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_bad_graphs_over_http_are_400_naming_the_node_and_the_server_keeps_serving(
    served, trainers
):
    session = trainers[0].service.holder.get_session_id()
    rng = random.Random(1)
    statuses = []
    for seq in range(100):
        req = _mutant(rng, SEEDS[seq % len(SEEDS)])
        status, body = _post(
            served,
            "/api/v1/create_custom_loss",
            {**req, "session_id": session, "custom_loss_seq_id": 10_000 + seq},
        )
        assert status in (200, 400), (status, body)
        if status == 400:
            assert "create_custom_loss" in body["error"]
        statuses.append(status)
    assert statuses.count(400) > 70
    bad = copy.deepcopy(SEEDS[0])
    bad["graph"]["nodes"][2]["target"] = "os.system"
    name = bad["graph"]["nodes"][2]["name"]
    status, body = _post(
        served,
        "/api/v1/create_custom_loss",
        {**bad, "session_id": session, "custom_loss_seq_id": 20_000},
    )
    assert status == 400 and f"node {name!r}" in body["error"] and "os.system" in body["error"]
    status, body = _post(
        served,
        "/api/v1/create_custom_loss",
        {**SEEDS[0], "session_id": session, "custom_loss_seq_id": 20_001},
    )
    assert status == 200 and body["request_id"]


# -- the step planner -------------------------------------------------------------------------

TERM = losses.fold(losses.grpo(clip_high=0.28), losses.echo_env(coef=0.2))
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)


def _rl_seqs(served, seed=0, n=6):
    base = served.server.engine.base_models[MODEL]
    seqs, _ = multi_turn_seqs(
        np.random.default_rng(seed),
        n,
        lengths=(12, 30),
        obs_turn=(1, 4),
        gap=1,
        vocab=base.config.vocab_size,
        trainer=LocalTrainer(base.config),
    )
    return seqs


def test_the_planner_runs_grpo_plus_echo_as_one_server_pass_equal_to_the_client_path(served, cfg):
    server_side, client_side = make_trainer(cfg), make_trainer(cfg)
    try:
        seqs = _rl_seqs(served, seed=3)
        one = StepRunner(TERM).step(server_side, seqs, ADAM)
        two = StepRunner(TERM, mode="client").step(client_side, seqs, ADAM)
        assert one["plan/server"] == 1.0
        assert (one["passes/forwards"], one["passes/backwards"]) == (1.0, 1.0)
        assert two["plan/client"] == 1.0 and two["plan/reason/forced"] == 1.0
        assert (two["passes/forwards"], two["passes/backwards"]) == (2.0, 1.0)
        for key in ("loss", "grpo/loss", "echo_env/loss", "echo_env/nll", "grpo/clip_frac_high"):
            assert one[key] == pytest.approx(two[key], rel=1e-5, abs=1e-7), key
        params = [_served(served, t).params for t in (server_side, client_side)]
        for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)
        # A second session uploading the same loss shares its validated, compiled program.
        StepRunner(TERM).step(client_side, seqs, ADAM)
        programs = {
            id(p) for _, p in served.server.custom_losses.values() if p.name == "foldloss_fold"
        }
        assert len(programs) == 1
        coupled = StepRunner(losses.fold(losses.clip_cov(), losses.echo_env(coef=0.2)))
        three = coupled.step(server_side, seqs, ADAM)
        assert three["plan/client"] == 1.0 and three["plan/reason/not_per_datum"] == 1.0
    finally:
        server_side.close()
        client_side.close()
