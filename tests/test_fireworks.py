"""runner.fireworks over the real SDK and the local server: datums and wire form, both step
paths, normalization, sampling, bad input, config validation, and import hygiene.

The trainer talks to the local server's Fireworks flavour (`runner.serve`) over loopback, through
the unmodified ``fireworks-ai`` SDK; the server computes with `runner.local.LocalTrainer`, so every
Fireworks result is compared with a local trainer doing the same thing in process (bit-for-bit:
both see the same float32 inputs). The wire bodies are the ones the server received
(`tests.test_serve_fireworks.Wire`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import threading
import typing
from pathlib import Path
from types import SimpleNamespace as types_ns

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from fireworks.training.sdk import types  # noqa: E402
from fireworks.training.sdk.client import (  # noqa: E402
    FiretitanTrainingClient,
    GradAccNormalization,
    _grad_accumulation_normalization_value,
)
from fireworks.training.sdk.trainer import TrainerJobManager  # noqa: E402

import losses  # noqa: E402
import runner  # noqa: E402
import runner._types as runner_types  # noqa: E402
from benchmarks.synthetic import multi_turn_seqs  # noqa: E402
from runner import AdamParams, Seq, StepRunner, make_seq  # noqa: E402
from runner._kernels import KERNELS  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.fireworks import (  # noqa: E402
    BUILTIN_LOSSES,
    LOSS_CONFIG_KEYS,
    OPT_IN_LOSSES,
    FireworksTrainer,
    api_key_from_env,
    builtin_config,
    is_vision_model,
    to_datums,
)
from runner.local import LocalTrainer  # noqa: E402
from tests.test_serve_fireworks import (  # noqa: E402
    ADAM,
    BASE,
    CFG,
    VOCAB,
    Wire,
    assert_params_equal,
    connect,
    fireworks_server,
    served_model,
)

ROOT = Path(__file__).resolve().parents[1]


class World:
    """What a test sees of the server behind one trainer: the requests it received (in order),
    their counts, the trained parameters, and a fault knob."""

    def __init__(self, st, wire: Wire, trainer: FireworksTrainer) -> None:
        self.st, self.wire, self.trainer = st, wire, trainer

    @property
    def requests(self) -> list[tuple[str, dict]]:
        return self.wire.of(self.trainer.client.model_id)

    @property
    def counters(self) -> dict[str, int]:
        return self.wire.counts(self.trainer.client.model_id)

    def params(self):
        return served_model(self.st, self.trainer).trainer.params

    @property
    def ce_backward_logprobs(self) -> bool:
        return not self.wire.strip_outputs

    @ce_backward_logprobs.setter
    def ce_backward_logprobs(self, value: bool) -> None:
        self.wire.strip_outputs = not value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    wire = Wire()
    st = fireworks_server(tmp_path_factory.mktemp("fw"), wire=wire)
    yield st, wire
    st.stop()


@pytest.fixture
def make_fw(server):
    """``make_fw(**trainer_kw) -> (world, trainer)``: a new trainer job on the server."""
    st, wire = server
    wire.reset()
    made: list[FireworksTrainer] = []

    def make(**kw):
        kw.setdefault("identity_timeout_s", 0.5)
        trainer = connect(st, **kw)
        made.append(trainer)
        return World(st, wire, trainer), trainer

    yield make
    wire.reset()
    for t in made:
        t.close()


class ClientSide(collections.Counter):
    """`runner._types.VALIDATIONS` counting the client's validations only (not the in-process
    server's, whose blocking work runs on its ``serve_*`` threads)."""

    def __setitem__(self, key, value):
        if not threading.current_thread().name.startswith("serve"):
            super().__setitem__(key, value)


def rl_seqs(seed: int = 0, n: int = 6) -> list[Seq]:
    """Prompt / action / observation turns with sampling logprobs near the initial policy."""
    seqs, _ = multi_turn_seqs(
        np.random.default_rng(seed),
        n,
        lengths=(12, 30),
        obs_turn=(1, 4),
        gap=1,  # one wrapper token after each observation
        vocab=VOCAB,
        trainer=LocalTrainer(CFG),
    )
    return seqs


def test_builtin_losses_are_sdk_loss_types_and_twins_translate():
    sdk = set(typing.get_args(types.LossFnType))
    assert set(BUILTIN_LOSSES) <= sdk and "reinforce" not in BUILTIN_LOSSES
    assert set(BUILTIN_LOSSES) == sdk - {"reinforce"}
    assert set(OPT_IN_LOSSES) == {"reinforce"}  # capability-gated: used only when asked for
    assert set(LOSS_CONFIG_KEYS) == set(BUILTIN_LOSSES) | set(OPT_IN_LOSSES) == sdk
    terms = [
        losses.grpo(clip_low=0.2, clip_high=0.28),
        losses.grpo(dual_clip=3.0),
        losses.ppo(),
        losses.cispo(),
        losses.importance_sampling(),
        losses.dro(beta=0.1, reduction="token_sum"),
        losses.dapo(eps_clip_c=3.0),
        losses.gspo(),
        losses.dppo(),
    ]
    for term in terms:
        name, cfg = losses.builtin_twin(term)
        assert name in BUILTIN_LOSSES
        assert builtin_config(name, cfg) == cfg  # the twin's keys are the documented §4 keys


# -- datums and the wire --------------------------------------------------------------------


def test_seq_to_datum_dtypes_alignment_and_zero_copy():
    tokens = np.array([5, 6, 7, 8, 9], np.int64)
    seq = make_seq(tokens, weights=[0.0, 0.5, 1.0, 2.0])
    (d,) = to_datums([seq], ("weights",))
    assert d.model_input.to_ints() == [5, 6, 7, 8]
    tt, w = d.loss_fn_inputs["target_tokens"], d.loss_fn_inputs["weights"]
    assert (tt.dtype, w.dtype) == ("int64", "float32")
    assert tt.to_numpy().tolist() == [6, 7, 8, 9] and w.to_numpy().dtype == np.float32
    assert np.shares_memory(tt.to_numpy(), seq.tokens)  # zero-copy target view
    assert w.to_numpy().tolist() == [0.0, 0.5, 1.0, 2.0]


def test_jax_bfloat16_unsigned_and_float16_inputs_become_int64_and_float32():
    import jax.numpy as jnp

    seqs = [
        Seq(jnp.array([1, 2, 3, 4]), {"weights": jnp.ones(3, jnp.bfloat16)}),
        Seq(np.array([1, 2, 3], np.uint8), {"weights": np.ones(2, np.float16)}),
        Seq(np.array([4, 5], np.int32), {"weights": jnp.full((1,), 0.5)}),
    ]
    for d in to_datums(seqs, ("weights",)):
        tt, w = d.loss_fn_inputs["target_tokens"], d.loss_fn_inputs["weights"]
        assert (tt.dtype, w.dtype) == ("int64", "float32")
        assert type(tt.to_numpy()) is np.ndarray and tt.to_numpy().dtype == np.int64
        assert w.to_numpy().dtype == np.float32
    assert to_datums(seqs, ("weights",))[0].loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]


def test_forward_logprobs_are_the_sdk_buffers(make_fw):
    world, trainer = make_fw()
    outputs = []
    forward = trainer.client.forward

    def spy(*args, **kwargs):
        future = forward(*args, **kwargs)
        outputs.append(future.result())
        return future

    trainer.client.forward = spy
    (lp,) = trainer.forward([make_seq([1, 2, 3, 4])])
    assert lp.dtype == np.float32
    assert np.shares_memory(lp, outputs[0].loss_fn_outputs[0]["logprobs"].to_numpy())  # zero-copy


def test_wire_form_of_a_builtin_ppo_request_matches_the_reference(make_fw):
    world, trainer = make_fw()
    seq = make_seq([1, 2, 3, 4], logprobs=[0.0, -0.5, -0.7], advantages=[0.0, 1.0, 1.0])
    trainer.forward_backward([seq], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    kind, body = world.requests[-1]
    expected = json.loads(
        '{"data":[{"loss_fn_inputs":{"target_tokens":{"data":[2,3,4],"dtype":"int64","shape":[3]},'
        '"logprobs":{"data":[0.0,-0.5,-0.699999988079071],"dtype":"float32","shape":[3]},'
        '"advantages":{"data":[0.0,1.0,1.0],"dtype":"float32","shape":[3]}},'
        '"model_input":{"chunks":[{"tokens":[1,2,3],"type":"encoded_text"}]}}],'
        '"loss_fn":"ppo","loss_fn_config":{"clip_low_threshold":0.8,"clip_high_threshold":1.2}}'
    )
    assert kind == "forward_backward" and body["forward_backward_input"] == expected


def test_wire_form_of_the_linear_cross_entropy_pass(make_fw):
    world, trainer = make_fw()
    seqs = rl_seqs(n=3)
    term = losses.fold(losses.grpo(), losses.echo_env(coef=0.1))
    client = runner.ClientLoss(term)
    lps = trainer.forward([s.with_inputs() for s in seqs])
    _, _, grads = client.value_and_grads(lps, seqs)
    StepRunner(term, mode="client").accumulate(trainer, seqs)
    (fkind, fwd), (bkind, bwd) = world.requests[-2:]
    assert (fkind, bkind) == ("forward", "forward_backward")
    fb = bwd["forward_backward_input"]
    assert fb["loss_fn"] == "cross_entropy" and "loss_fn_config" not in fb
    for i, (d_fwd, d_bwd) in enumerate(zip(fwd["forward_input"]["data"], fb["data"], strict=True)):
        assert d_bwd["model_input"] == d_fwd["model_input"]
        assert set(d_bwd["loss_fn_inputs"]) == {"target_tokens", "weights"}
        w = d_bwd["loss_fn_inputs"]["weights"]
        assert w["dtype"] == "float32" and w["shape"] == [seqs[i].num_targets]
        np.testing.assert_array_equal(np.float32(w["data"]), np.float32(-grads[i]))
        assert set(d_fwd["loss_fn_inputs"]) == {"target_tokens", "weights"}  # zeros, as the SDK
        assert not any(d_fwd["loss_fn_inputs"]["weights"]["data"])


def test_model_input_is_the_same_object_in_forward_and_linear_backward(make_fw):
    world, trainer = make_fw()
    seen = {"forward": [], "forward_backward": []}
    for name in seen:
        method = getattr(trainer.client, name)

        def spy(data, *args, _m=method, _n=name, **kw):
            seen[_n].append([d.model_input for d in data])
            return _m(data, *args, **kw)

        setattr(trainer.client, name, spy)
    seqs = rl_seqs(n=4)
    StepRunner(losses.fold(losses.grpo(), losses.echo_env(coef=0.1))).accumulate(trainer, seqs)
    (fwd,), (bwd,) = seen["forward"], seen["forward_backward"]
    assert all(a is b for a, b in zip(fwd, bwd, strict=True))


# -- both step paths on Fireworks equal the local trainer -----------------------------------


@pytest.mark.parametrize(
    "term, mode, plan, passes",
    [
        (lambda: losses.grpo(), "auto", "builtin", (2, 2)),
        (lambda: losses.cispo(), "auto", "builtin", (2, 2)),
        (lambda: losses.fold(losses.grpo(), losses.echo_env(coef=0.1)), "auto", "client", (4, 2)),
        (lambda: losses.grpo(kl_coef=0.0, dual_clip=3.0), "client", "client", (4, 2)),
        (
            lambda: losses.fold(losses.grpo(), losses.echo_env(coef=0.1)),
            "two_pass",
            "two_pass",
            (4, 4),
        ),
    ],
)
def test_step_paths_match_the_local_trainer(make_fw, monkeypatch, term, mode, plan, passes):
    world, trainer = make_fw()
    local = LocalTrainer(CFG)
    seqs = rl_seqs(seed=1)
    t = term()
    validations = ClientSide()
    monkeypatch.setattr(runner_types, "VALIDATIONS", validations)
    for _ in range(2):
        before = validations["validate_seqs"]
        m_fw = StepRunner(t, mode=mode).step(trainer, seqs, ADAM, num_microbatches=2)
        # Once per step on the client side of this backend too (the server validates each
        # request it receives, on its own threads).
        assert validations["validate_seqs"] - before == 1
        m_local = StepRunner(t, mode=mode).step(local, seqs, ADAM, num_microbatches=2)
    assert m_fw[f"plan/{plan}"] == 1.0
    assert (m_fw["passes/forwards"], m_fw["passes/backwards"]) == passes
    assert m_fw["loss"] == pytest.approx(m_local["loss"], rel=1e-6)
    if plan == "client":  # the term's loss, never the surrogate loss:sum
        assert m_fw["loss"] != pytest.approx(m_fw["surrogate_loss"])
    assert_params_equal(world.params(), local.params)
    assert world.counters["forward_backward"] == 2 * passes[1]  # two steps
    assert world.counters["optim_step"] == 2


def test_precomputed_forward_saves_a_pass(make_fw):
    world, trainer = make_fw()
    local = LocalTrainer(CFG)
    seqs = rl_seqs(seed=2)
    term = losses.fold(losses.grpo(), losses.echo_env(coef=0.1))
    fwd = trainer.forward([s.with_inputs() for s in seqs])
    m = StepRunner(term).step(trainer, seqs, ADAM, forward=fwd)
    StepRunner(term).step(local, seqs, ADAM, forward=local.forward(seqs))
    assert (m["passes/forwards"], m["passes/backwards"]) == (1, 1)
    assert world.counters["forward"] == 1 and world.counters["forward_backward"] == 1
    assert_params_equal(world.params(), local.params)


def test_sft_cross_entropy_on_fireworks(make_fw):
    world, trainer = make_fw()
    local = LocalTrainer(CFG)
    examples = [([1, 2, 3], [4, 5, 6]), ([7, 8], [9, 10, 11, 12]), ([3], [2, 1])]
    sequences, attention, loss_mask = runner.collate_sft(examples)
    seqs = runner.translate_sft_batch(sequences, attention, loss_mask, max_seq_len=64)
    r_fw = trainer.forward_backward(seqs, "cross_entropy")
    r_local = local.forward_backward(seqs, "cross_entropy")
    assert r_fw.metrics["loss:sum"] == pytest.approx(r_local.metrics["loss:sum"], rel=1e-6)
    assert r_fw.metrics["response_tokens"] == 9.0  # the SDK's client-side count
    assert "loss" not in r_fw.metrics  # loss:sum stays under its own key
    for a, b in zip(r_fw.logprobs, r_local.logprobs, strict=True):
        assert a.dtype == np.float32 and np.array_equal(a, b)
    trainer.optim_step(ADAM, "none")
    local.optim_step(ADAM, "none")
    assert_params_equal(world.params(), local.params)


def test_cross_entropy_backward_without_logprobs(make_fw):
    world, trainer = make_fw()
    world.ce_backward_logprobs = False
    seqs = [make_seq([1, 2, 3, 4], weights=[0.0, 1.0, 1.0])]
    result = trainer.forward_backward(seqs, "cross_entropy")
    assert result.logprobs == [] and np.isfinite(result.metrics["loss:sum"])


def test_optim_step_sends_explicit_none_and_maps_adam(make_fw):
    world, trainer = make_fw()
    seqs = [make_seq([1, 2, 3, 4], weights=[0.0, 1.0, 1.0])]
    adam = AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    for normalization, wire in [
        ("none", "none"),
        (None, "none"),
        ("num_loss_tokens", "num_loss_tokens"),
        ("num_sequences", "num_sequences"),
    ]:
        trainer.forward_backward(seqs, "cross_entropy")
        trainer.optim_step(adam, normalization)
        kind, body = world.requests[-1]
        assert kind == "optim_step" and body["grad_accumulation_normalization"] == wire
        assert body["adam_params"] == {
            "learning_rate": 3e-3,
            "beta1": 0.8,
            "beta2": 0.9,
            "eps": 1e-8,
            "weight_decay": 0.1,
            "grad_clip_norm": 0.0,
        }
    # The SDK omits the field for None (the server's default then applies): we never send None.
    assert _grad_accumulation_normalization_value(None) is None
    assert _grad_accumulation_normalization_value(GradAccNormalization.NONE) == "none"
    with pytest.raises(ValueError, match="unknown normalization"):
        trainer.optim_step(adam, "mean")
    with pytest.raises(ValueError, match="runner.AdamParams"):
        trainer.optim_step(types.AdamParams(), "none")


# -- sampling -------------------------------------------------------------------------------


def test_sampling_matches_local_and_hot_loads_once_per_weights_version(make_fw):
    world, trainer = make_fw()
    local = LocalTrainer(CFG)
    prompts = [[1, 2, 3], [4, 5], [6]]
    kw = dict(num_samples=3, max_tokens=6, temperature=1.0, seed=11, stop_token_ids=[0, 1])
    for _ in range(2):
        a, b = trainer.sample(prompts, **kw), local.sample(prompts, **kw)
        for sa, sb in zip(sum(a, []), sum(b, []), strict=True):
            assert np.array_equal(sa.tokens, sb.tokens) and sa.stop_reason == sb.stop_reason
            # The SDK keeps at most 8 completions in flight at first: the 9 requests reach the
            # server as two sampling calls, whose batch shapes differ from the one local call
            # (a logprob may differ in its last bit; the tokens do not).
            assert sa.logprobs.dtype == np.float32
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=0, atol=1e-6)
    assert trainer.counters["sampler_sync"] == 1 and trainer.counters["sample"] == 18
    seqs = [make_seq([1, 2, 3, 4], weights=[0.0, 1.0, 1.0])]
    trainer.forward_backward(seqs, "cross_entropy")
    trainer.optim_step(ADAM)
    local.forward_backward(seqs, "cross_entropy")
    local.optim_step(ADAM)
    greedy = dict(num_samples=1, max_tokens=5, temperature=0.0, seed=0)
    a, b = trainer.sample(prompts, **greedy), local.sample(prompts, **greedy)
    assert [s.tokens.tolist() for s in sum(a, [])] == [s.tokens.tolist() for s in sum(b, [])]
    assert trainer.counters["sampler_sync"] == 2


# -- bad input ------------------------------------------------------------------------------


def _ppo_seq(**override):
    inputs = dict(logprobs=[0.0, -0.5, -0.7], advantages=[0.0, 1.0, 1.0])
    inputs.update(override)
    return Seq(np.array([1, 2, 3, 4]), {k: np.asarray(v) for k, v in inputs.items()})


@pytest.mark.parametrize(
    "seqs, loss, match",
    [
        ([_ppo_seq(), Seq(np.array([1, 2, 3]), {"logprobs": np.zeros(2)})], "ppo",
         r"sequence 1: missing required field 'advantages'"),
        ([_ppo_seq(action_mask=[0.0, 1.0, 1.0])], "ppo",
         r"sequence 0: field 'action_mask' is not an input of kernel 'ppo'"),
        ([_ppo_seq(advantages=[0.0, np.nan, 1.0])], "ppo",
         r"sequence 0: field 'advantages' has a non-finite value nan at target 1"),
        ([_ppo_seq(advantages=[0.0, 1e39, 1.0])], "ppo",
         r"sequence 0: field 'advantages' value 1e\+39 at target 1 overflows float32"),
        ([_ppo_seq(advantages=[0.0, 1.0])], "ppo",
         r"sequence 0: field 'advantages' has shape \(2,\), expected \(3,\)"),
        ([_ppo_seq(advantages=np.array([False, True, True]))], "ppo",
         r"sequence 0: field 'advantages' must be numeric"),
        ([_ppo_seq(logprobs=[0.0, 0.5, -0.7])], "ppo",
         r"sequence 0: field 'logprobs' has a positive logprob 0.5 at target 1"),
        ([_ppo_seq(target_tokens=[2, 3, 5])], "ppo",
         r"sequence 0: field 'target_tokens' must equal tokens\[1:\]"),
        ([Seq(np.array([1, -2, 3]), {"weights": np.ones(2)})], "cross_entropy",
         r"sequence 0: token -2 at position 1 is < 0"),
        ([Seq(np.arange(70) % VOCAB, {"weights": np.ones(69)})], "cross_entropy",
         r"sequence 0: model-input length 69 exceeds max_seq_len=64"),
        ([Seq(np.array([1.0, 2.0]), {"weights": np.ones(1)})], "cross_entropy",
         r"sequence 0: tokens must be integers"),
        ([], "cross_entropy", r"empty batch"),
        ([_ppo_seq()], "reinforce", r"unknown loss 'reinforce'; expected one of"),
        ([_ppo_seq()], "grpo", r"unknown loss 'grpo'"),
    ],
)  # fmt: skip
def test_bad_input_names_the_sequence_and_field(make_fw, seqs, loss, match):
    world, trainer = make_fw()
    with pytest.raises(ValueError, match=match):
        trainer.forward_backward(seqs, loss)
    assert not world.requests  # nothing reached the trainer


@pytest.mark.parametrize(
    "loss, config, match",
    [
        ("ppo", {"beta": 0.1}, r"ppo: unknown loss_fn_config key 'beta'; allowed keys"),
        ("ppo", {"ratio_log_cap": 20.0}, r"unknown loss_fn_config key 'ratio_log_cap'"),
        ("ppo", {"clip_low_threshold": float("inf")}, r"'clip_low_threshold' must be finite"),
        ("ppo", {"clip_low_threshold": True}, r"'clip_low_threshold' must be a number"),
        ("dppo", {"divergence": "kl"}, r"'divergence' must be one of"),
        ("cross_entropy", {"target_logprob_support": "all"}, r"target_logprob_support"),
    ],
)
def test_bad_loss_config(make_fw, loss, config, match):
    world, trainer = make_fw()
    with pytest.raises(ValueError, match=match):
        trainer.forward_backward([_ppo_seq()], loss, config)


def test_a_capability_gated_value_is_refused(make_fw):
    world, trainer = make_fw()
    seqs = [make_seq([1, 2, 3, 4], weights=[0.0, 1.0, 1.0])]
    # a valid value the trainer does not advertise (the SDK's own inline check)
    with pytest.raises(ValueError, match="sampling_support"):
        trainer.forward_backward(
            seqs, "cross_entropy", {"target_logprob_support": "sampling_support"}
        )


def test_bad_sample_arguments(make_fw):
    world, trainer = make_fw()
    with pytest.raises(ValueError, match="empty batch"):
        trainer.sample([], num_samples=1, max_tokens=2)
    with pytest.raises(ValueError, match="prompt 1: tokens must be non-negative integers"):
        trainer.sample([[1], [-1]], num_samples=1, max_tokens=2)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        trainer.sample([[1] * 60], num_samples=1, max_tokens=8)
    with pytest.raises(ValueError, match="seed must be in \\[0, 2\\*\\*19\\) on a hosted backend"):
        trainer.sample([[1]], num_samples=1, max_tokens=2, seed=2**19)
    with pytest.raises(ValueError, match="at most 4096 completions"):
        trainer.sample([[1]] * 2049, num_samples=2, max_tokens=2)
    with pytest.raises(ValueError, match="temperature must be finite"):
        trainer.sample([[1]], num_samples=1, max_tokens=2, temperature=-1.0)


# -- configuration --------------------------------------------------------------------------

FW_SET = [
    "run.backend='fireworks'",
    "fireworks.base_model='accounts/fireworks/models/qwen3-8b'",
    "fireworks.training_shape_id='ts-qwen3-8b-policy'",
]


def _cfg(*extra: str):
    return load_config(ROOT / "examples" / "tiny.toml", [*FW_SET, *extra])


def test_valid_fireworks_config_and_defaults():
    cfg = _cfg()
    f = cfg.fireworks
    assert (f.trainer_job_id, f.deployment_id, f.modality) == ("", "", "auto")
    assert f.delete_trainer_after_promotion is True and f.identity_timeout_s == 90.0
    assert cfg.identity() == _cfg("fireworks.output_model_id='final-model'").identity()


@pytest.mark.parametrize(
    "extra, match",
    [
        (["fireworks.base_model=''"], r"\[fireworks\]\.base_model is required"),
        (["fireworks.training_shape_id=''"], r"\[fireworks\]\.training_shape_id is required"),
        (["fireworks.base_model='accounts/fireworks/models/qwen2p5-vl-32b-instruct'"],
         r"vision-language model \(by its name\).*modality = \"text\""),
        (["fireworks.modality='vision'"], r"vision-language model \(declared by"),
        (["fireworks.modality='audio'"], r"modality must be one of"),
        (["fireworks.output_model_id='My_Model'"],
         r"output_model_id is invalid: .*Must be lowercase a-z, 0-9, or hyphen"),
        ([f"fireworks.output_model_id='{'a' * 64}'"], r"too long \(64 chars\)"),
        (["run.output_dir=''"], r"checkpointing needs a path"),
        (["fireworks.max_seq_len=32"], r"\[model\]\.max_seq_len \(64\) exceeds"),
        (["rl.kl_coef=0.1"], r"kl_coef > 0 .* local backend only"),
        (["fireworks.api_key_env='MY KEY'"], r"api_key_env must be an environment variable name"),
        (["fireworks.api_key_env='fw_" + "k" * 16 + "'"], r"not the key itself; the value given is not shown$"),
        (["fireworks.base_url='ftp://x'"], r"base_url must be an http\(s\) URL"),
        (["fireworks.request_timeout_s=0"], r"request_timeout_s must be > 0"),
        (["fireworks.identity_timeout_s=-1"], r"identity_timeout_s must be > 0"),
    ],
)  # fmt: skip
def test_config_validation_messages(extra, match):
    with pytest.raises(ValueError, match=match):
        _cfg(*extra)


def test_vision_override_and_local_backend_untouched():
    cfg = _cfg(
        "fireworks.base_model='accounts/fireworks/models/qwen2p5-vl-32b-instruct'",
        "fireworks.modality='text'",
    )
    assert cfg.fireworks.modality == "text"
    # the local backend ignores the [fireworks] section entirely
    load_config(ROOT / "examples" / "tiny.toml", ["fireworks.base_model='llava-13b'"])


def test_missing_api_key_names_the_variable_only():
    with pytest.raises(ValueError, match="set the environment variable FW_TEST_KEY_ABSENT"):
        api_key_from_env("FW_TEST_KEY_ABSENT", {})
    with pytest.raises(ValueError, match="FW_TEST_KEY_BLANK"):
        api_key_from_env("FW_TEST_KEY_BLANK", {"FW_TEST_KEY_BLANK": "  "})
    assert api_key_from_env("K", {"K": " fw_abc "}) == "fw_abc"


@pytest.mark.parametrize(
    "name, vlm",
    [
        ("accounts/fireworks/models/qwen2p5-vl-32b-instruct", True),
        ("accounts/fireworks/models/qwen3-vl-30b-a3b-instruct", True),
        ("accounts/fireworks/models/llama-v3p2-11b-vision-instruct", True),
        ("accounts/fireworks/models/phi-3-vision-128k-instruct", True),
        ("accounts/fireworks/models/llava-yi-34b", True),
        ("accounts/fireworks/models/llama4-maverick-instruct-basic", True),
        ("deepseek-vl2", True),
        ("glm-4v-9b", True),
        ("glm-4p5v", True),
        ("minicpm-v-2_6", True),
        ("accounts/fireworks/models/qwen3-8b", False),
        ("accounts/fireworks/models/llama-v3p1-8b-instruct", False),
        ("accounts/fireworks/models/deepseek-v3", False),
        ("accounts/fireworks/models/mistral-7b-instruct-v0p2", False),
        ("accounts/fireworks/models/gpt-oss-20b", False),
        ("accounts/fireworks/models/kimi-k2-instruct", False),
    ],
)
def test_vision_model_name_rule(name, vlm):
    assert is_vision_model(name) is vlm


def test_trainer_refuses_a_vision_model():
    with pytest.raises(ValueError, match="vision-language model"):
        FireworksTrainer(object(), base_model="accounts/fireworks/models/qwen2-vl-7b")


# -- import hygiene -------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_local_backend_never_imports_the_sdk():
    code = f"""
import sys
import losses, runner, runner.train, runner.__main__, runner.fireworks
from runner.config import load_config
from runner.train import make_trainer
cfg = load_config({str(ROOT / "examples" / "tiny.toml")!r})
make_trainer(cfg, __import__("pathlib").Path("unused"))
bad = sorted(m for m in sys.modules if m.startswith(("fireworks", "torch")))
assert not bad, bad
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_fireworks_backend_runs_without_torch(tmp_path):
    code = f"""
import sys
sys.modules["torch"] = None  # `import torch` now raises ImportError, as without torch
sys.path.insert(0, {str(ROOT)!r})
import numpy as np, losses, runner
from tests.test_serve_fireworks import connect, fireworks_server
st = fireworks_server(__import__("pathlib").Path({str(tmp_path)!r}))
t = connect(st)
m = np.array([0.0, 1.0, 1.0, 1.0])
seq = runner.make_seq([1, 2, 3, 4, 5], action_mask=m, advantages=m, sampling_logprobs=-m,
                      obs_mask=0 * m)
for term in (losses.grpo(), losses.fold(losses.grpo(), losses.echo_env(coef=0.1))):
    runner.StepRunner(term).step(t, [seq, seq], runner.AdamParams())
t.sample([[1, 2]], num_samples=2, max_tokens=3)
t.close()
st.stop()
assert "torch" not in [k for k, v in sys.modules.items() if v is not None]
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_trainer_holds_no_api_key(make_fw):
    world, trainer = make_fw()
    assert "key" not in repr(trainer).lower()
    assert not [k for k in vars(trainer) if "key" in k.lower()]


def test_dataclass_config_fields_are_typed():
    from runner.config import FireworksConfig

    fields = {f.name: f.default for f in dataclasses.fields(FireworksConfig)}
    assert "api_key" not in fields and fields["api_key_env"] == "FIREWORKS_API_KEY"


def test_connect_builds_an_sdk_managed_service_without_network(monkeypatch):
    from fireworks.training.sdk import FiretitanServiceClient

    import runner.fireworks._trainer as fw_trainer

    seen = {}

    def create(self, *args, **kwargs):
        seen["config"] = self._managed_config
        return "client"

    monkeypatch.setattr(FiretitanServiceClient, "create_training_client", create)
    monkeypatch.setattr(FiretitanServiceClient, "trainer_job_id", property(lambda self: "job-7"))
    cfg = _cfg("fireworks.trainer_job_id='job-7'", "fireworks.deployment_id='dep-1'")
    service, client, control, job = fw_trainer._connect(cfg.fireworks, "fw_not_a_real_key")
    mc = seen["config"]
    assert (client, job, type(control)) == ("client", "job-7", TrainerJobManager)
    assert (mc.base_model, mc.training_shape_id) == (BASE, "ts-qwen3-8b-policy")
    assert (mc.trainer_job_id, mc.deployment_id, mc.max_context_length) == ("job-7", "dep-1", 4096)
    assert mc.cleanup_trainer_on_close is False  # checkpoints outlive the process
    service.close()

    closed = []

    def fail(self, *args, **kwargs):
        raise RuntimeError("provisioning failed")

    monkeypatch.setattr(FiretitanServiceClient, "create_training_client", fail)
    monkeypatch.setattr(FiretitanServiceClient, "close", lambda self: closed.append(1))
    with pytest.raises(RuntimeError, match="provisioning failed"):
        fw_trainer._connect(cfg.fireworks, "fw_not_a_real_key")
    assert closed == [1]


def test_fireworks_trainer_is_a_runner_trainer(make_fw):
    world, trainer = make_fw()
    assert isinstance(trainer, runner.Trainer)
    assert set(trainer.builtin_losses) == set(BUILTIN_LOSSES)
    # the capability-gated kernel: used when named and advertised (the server advertises it)
    assert trainer.client.supports_reinforce is True
    opted = FireworksTrainer(trainer.client, base_model=BASE, builtin_losses=("reinforce",))
    assert opted.builtin_losses == ("reinforce",)
    not_advertised = types_ns(supports_reinforce=None)
    with pytest.raises(ValueError, match="unsupported builtin losses"):
        FireworksTrainer(not_advertised, base_model=BASE, builtin_losses=("reinforce",))


def test_every_documented_config_key_passes_the_sdk_client_side_checks():
    from fireworks.training.sdk.client import _target_logprob_support

    values = {
        "divergence": "binary_kl",
        "target_logprob_support": "full_vocabulary",
        "clip_low_threshold": 0.5,
        "score_centering": False,
    }

    class NoCapabilities:  # a trainer that advertises nothing optional
        pass

    for loss in BUILTIN_LOSSES:
        keys = LOSS_CONFIG_KEYS[loss]
        assert set(keys) | {"target_logprob_support"} == set(KERNELS[loss].keys)
        cfg = builtin_config(
            loss, {k: values.get(k, 1.5) for k in (*keys, "target_logprob_support")}
        )
        assert _target_logprob_support(cfg) == "full_vocabulary"
        FiretitanTrainingClient._validate_loss_capabilities(NoCapabilities(), loss, cfg)
        for legacy in ("replay", "logprob_normalization", "importance_sampling"):
            assert legacy not in keys  # keys the SDK rejects outright
    # the opt-in kernel is capability-gated by the SDK itself
    with pytest.raises(ValueError, match="REINFORCE"):
        FiretitanTrainingClient._validate_loss_capabilities(
            NoCapabilities(), "reinforce", builtin_config("reinforce", {})
        )


def test_a_key_pasted_into_api_key_env_is_never_echoed():
    """Issue #12 row 12: the key itself in ``api_key_env`` was printed in the error."""
    key = "fw_" + "k" * 24  # shaped like a Fireworks key (lower case: not a variable name)
    with pytest.raises(ValueError) as info:
        _cfg(f"fireworks.api_key_env='{key}'")
    assert key not in str(info.value)
