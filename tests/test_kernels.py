"""runner._kernels: the one kernel table, and every backend agreeing with it.

(a) each backend's kernel set comes from the table, and the table covers the SDK's
``LossFnType``; (b) walking the table, every kernel config (defaults, each key at valid non-default
values, invalid values, keys of other kernels) is accepted or rejected identically by the local
trainer (a real `runner.LocalTrainer` ``forward_backward``) and by the Fireworks conversion plus
the SDK's own client-side checks; (c) the local ``reinforce`` kernel is
``losses.reinforce(ratio_weight=True, reduction="token_sum")``, also through the opt-in Fireworks
path; (d) every table kernel's term builds.
"""

from __future__ import annotations

import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fireworks.training.sdk import types
from fireworks.training.sdk._core._compat import model_dump
from fireworks.training.sdk._core.lib._pydantic_conv import to_pydantic_request
from fireworks.training.sdk.client import FiretitanTrainingClient, _target_logprob_support
from hypothesis import given, settings
from hypothesis import strategies as st

import losses
import runner
from runner import Seq, _kernels
from runner._kernels import KERNEL_NAMES, KERNELS, ConfigKey, resolve_config
from runner.fireworks import (
    BUILTIN_LOSSES as FW_DEFAULT,
)
from runner.fireworks import (
    LOSS_CONFIG_KEYS,
    OPT_IN_LOSSES,
    builtin_config,
)
from runner.fireworks._convert import KERNEL_INPUTS
from runner.local import LocalTrainer, LocalTrainerConfig, model
from runner.local import kernels as local_kernels
from tests.fakes import BigramTrainer

V = 16
CFG = LocalTrainerConfig(
    vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16, seed=1
)
FW_KERNELS = (*FW_DEFAULT, *OPT_IN_LOSSES)
BACKENDS = {"local": LocalTrainer.builtin_losses, "fireworks": FW_KERNELS}
#: Valid table values a backend cannot compute (the backend refuses them with this message).
LOCAL_LIMITS = {
    "target_logprob_support": "the local trainer computes full-vocabulary logprobs only",
    "score_centering": "score_centering=True is not supported by the local trainer",
}


@pytest.fixture(scope="module")
def trainer():
    return LocalTrainer(CFG)


def tiny_seqs(kernel: str, seed: int = 0) -> list[Seq]:
    rng = np.random.default_rng(seed)
    seqs = []
    for n in (5, 8):
        toks = rng.integers(0, V, size=n)
        if KERNELS[kernel].inputs == ("weights",):
            inputs = {"weights": rng.normal(size=n - 1)}
        else:
            inputs = {
                "logprobs": rng.uniform(-4.0, -1.0, size=n - 1),
                "advantages": rng.normal(size=n - 1),
            }
        seqs.append(Seq(toks, inputs))
    return seqs


# -- (a) every backend declares its kernels from the table ---------------------------------------


def test_backends_declare_their_kernels_from_the_table():
    sdk = set(typing.get_args(types.LossFnType))
    assert sdk <= set(KERNEL_NAMES)  # the table knows every SDK kernel ...
    assert set(KERNEL_NAMES) <= sdk  # ... and only SDK kernels
    assert runner.BUILTIN_LOSSES is KERNEL_NAMES and KERNEL_NAMES == tuple(KERNELS)
    assert LocalTrainer.builtin_losses is local_kernels.SUPPORTED == KERNEL_NAMES
    assert runner.local.KERNELS is KERNELS
    assert set(FW_DEFAULT) <= set(KERNEL_NAMES) and set(OPT_IN_LOSSES) <= set(KERNEL_NAMES)
    assert "reinforce" not in FW_DEFAULT and set(OPT_IN_LOSSES) == {"reinforce"}
    assert set(BigramTrainer.builtin_losses) == set(_kernels.DOCUMENTED_KERNELS)
    # the Fireworks tables are views of the table
    for name in FW_KERNELS:
        assert KERNEL_INPUTS[name] == KERNELS[name].inputs
        assert set(LOSS_CONFIG_KEYS[name]) | set(_kernels.GENERIC_KEYS) == set(KERNELS[name].keys)
    # subsets come back in table order; a name outside the table is an error
    assert _kernels.supported("ppo", "cross_entropy") == ("cross_entropy", "ppo")
    with pytest.raises(ValueError, match="grpo"):
        _kernels.supported("ppo", "grpo")
    assert _kernels.DOCUMENTED_KERNELS == (
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
    )


def test_table_shape():
    rl = ("logprobs", "advantages")
    expected = {
        "cross_entropy": ((), ("weights",), "documented"),
        "importance_sampling": (("ratio_log_cap",), rl, "documented"),
        "ppo": (("clip_low_threshold", "clip_high_threshold"), rl, "documented"),
        "cispo": (("clip_low_threshold", "clip_high_threshold", "ratio_log_cap"), rl, "documented"),
        "dro": (("beta",), rl, "documented"),
        "dapo": (
            ("clip_low_threshold", "clip_high_threshold", "eps_clip_c", "ratio_log_cap"),
            rl,
            "inferred",
        ),
        "gspo": (
            ("clip_low_threshold", "clip_high_threshold", "seq_ratio_log_cap"),
            rl,
            "inferred",
        ),
        "dppo": (("divergence", "threshold", "ratio_log_cap"), rl, "inferred"),
        "reinforce": (("score_centering",), rl, "undocumented"),
    }
    assert tuple(expected) == KERNEL_NAMES
    for name, (keys, inputs, formula) in expected.items():
        spec = KERNELS[name]
        assert tuple(spec.keys) == (*keys, "target_logprob_support"), name
        assert spec.inputs == inputs and spec.formula == formula and spec.equation and spec.doc
        for key in spec.keys.values():
            assert key.provenance in _kernels.PROVENANCES and key.doc
    gspo = losses.gspo().config
    assert resolve_config("gspo", {})["clip_low_threshold"] == gspo["clip_low_threshold"]
    assert resolve_config("gspo", {})["clip_high_threshold"] == gspo["clip_high_threshold"]
    assert resolve_config("cispo", {})["clip_high_threshold"] == 4.0
    assert resolve_config("dapo", {})["clip_high_threshold"] == 1.28
    assert resolve_config("dppo", {"divergence": "binary_kl"})["threshold"] == 0.05
    assert resolve_config("dppo", {})["threshold"] == 0.15
    assert resolve_config("reinforce", {})["score_centering"] is False
    with pytest.raises(ValueError, match="mapping"):
        resolve_config("ppo", [("beta", 1.0)])
    with pytest.raises(ValueError, match="unknown loss 'grpo'"):
        resolve_config("grpo", {})


# -- (b) the same config is accepted / rejected identically everywhere ---------------------------


def _valid_values(key: ConfigKey) -> list:
    """Valid non-default values of a key: other choices, interior numbers, closed bounds."""
    if key.kind == "string":
        return [c for c in key.choices if c != key.default]
    if key.kind == "bool":
        return [not key.default]
    if key.default is None:
        return [(key.low if key.low is not None else 0.0) + 0.5]
    out = []
    if key.low is not None and key.high is not None:
        out.append((key.low + key.high) / 2)
    else:
        out.append(key.default * 2 if key.default > 0 else 1.0)
    for bound, is_open in ((key.low, key.low_open), (key.high, key.high_open)):
        if bound is not None and not is_open:
            out.append(bound)
    return [v for v in dict.fromkeys(out) if v != key.default]


def _invalid_values(key: ConfigKey) -> list:
    out = [] if key.default is None else [None]
    if key.kind == "string":
        return [*out, "bogus", 1.0]
    if key.kind == "bool":
        return [*out, 1, "True", 0.0]
    out += ["0.5", True, math.nan, math.inf, -math.inf, 1j]
    if key.low is not None:
        out.append(key.low if key.low_open else key.low - 1.0)
    if key.high is not None:
        out.append(key.high if key.high_open else key.high + 1.0)
    return out


def _cases() -> list[tuple[str, dict, str]]:
    """``(kernel, config, table verdict)``: ``"ok"``, ``"local-limit"`` or ``"reject"``."""
    all_keys = {k for spec in KERNELS.values() for k in spec.keys}
    cases = []
    for name, spec in KERNELS.items():
        cases.append((name, {}, "ok"))
        cases.append((name, spec.defaults, "ok"))
        for key_name, key in spec.keys.items():
            for v in _valid_values(key):
                limited = key_name in LOCAL_LIMITS
                cases.append((name, {key_name: v}, "local-limit" if limited else "ok"))
            for v in _invalid_values(key):
                cases.append((name, {key_name: v}, "reject"))
        for other in sorted(all_keys - set(spec.keys)):  # another kernel's key
            cases.append((name, {other: 1.0}, "reject"))
        cases.append((name, {"bogus_key": 1.0}, "reject"))
    cases += [
        ("dppo", {"threshold": 1.5}, "reject"),  # TV is at most 1
        ("dppo", {"divergence": "binary_kl", "threshold": 1.5}, "ok"),
        ("dapo", {"eps_clip_c": None, "clip_low_threshold": 0.7}, "ok"),
        ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2, "ratio_log_cap": 5}, "ok"),
    ]
    return cases


CASES = _cases()


class AllCapabilities:  # a trainer advertising every optional capability: only the config counts
    supports_target_logprob_support = True
    supports_reinforce = True
    supports_score_centering = True
    supports_policy_importance_sampling = True
    supports_policy_diagnostics = True


def _local(trainer: LocalTrainer, name: str, config: dict) -> str | None:
    """``None`` if the local trainer ran the kernel, else its error message."""
    trainer.reset_grads()
    try:
        result = trainer.forward_backward(tiny_seqs(name), name, config)
    except ValueError as e:
        assert trainer.accumulated_grads() is None
        return str(e)
    assert math.isfinite(result.metrics["loss:sum"])
    return None


def _fireworks(name: str, config: dict) -> str | None:
    """``None`` if the Fireworks conversion and the SDK's client-side checks accept the config."""
    try:
        cfg = builtin_config(name, config)
    except ValueError as e:
        return str(e)
    assert set(cfg) <= set(config)  # only keys the caller set are sent
    assert all(isinstance(v, float | str | bool) for v in cfg.values())
    _target_logprob_support(cfg)
    FiretitanTrainingClient._validate_loss_capabilities(AllCapabilities(), name, cfg)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[], loss_fn=name, loss_fn_config=cfg or None
        ),
        model_id="m",
        seq_id=1,
    )
    # the SDK's own serializer, validated back against its pydantic wire schema
    wire = to_pydantic_request(request)
    type(wire).model_validate(model_dump(wire, exclude_none=True, mode="json"))
    return None


@pytest.mark.parametrize("name,config,verdict", CASES, ids=lambda x: repr(x)[:60])
def test_every_backend_agrees_with_the_table(trainer, name, config, verdict):
    try:
        resolve_config(name, config)
        table = None
    except ValueError as e:
        table = str(e)
    assert (table is None) == (verdict != "reject"), table
    got = {}
    if name in BACKENDS["local"]:
        got["local"] = _local(trainer, name, config)
    if name in BACKENDS["fireworks"]:
        got["fireworks"] = _fireworks(name, config)
    for backend, error in got.items():
        if verdict == "ok":
            assert error is None, (backend, error)
        elif verdict == "local-limit":
            if backend == "local":
                (key,) = config
                assert error is not None and LOCAL_LIMITS[key] in error and name in error
            else:
                assert error is None, (backend, error)
        else:
            assert error == table, backend  # the same message: one validation function
            assert error.startswith(f"{name}:")
            assert any(f"'{k}'" in error for k in config)  # it names the key


@settings(max_examples=60)
@given(
    name=st.sampled_from(KERNEL_NAMES),
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-5, 5),
        st.booleans(),
        st.none(),
        st.sampled_from(["binary_tv", "binary_kl", "full_vocabulary", "candidates", "x"]),
    ),
    data=st.data(),
)
def test_local_and_fireworks_validation_agree_on_any_value(name, value, data):
    """Config-level agreement for arbitrary values (no forward pass: resolve vs builtin_config)."""
    key = data.draw(st.sampled_from(tuple(KERNELS[name].keys)))
    config = {key: value}

    def outcome(fn):
        try:
            fn(name, config)
        except ValueError as e:
            return str(e)
        return None

    local = outcome(local_kernels.resolve)
    fw = outcome(builtin_config)
    table = outcome(resolve_config)
    assert fw == table
    if local != table:  # only the documented local limits differ
        assert table is None and any(m in local for m in LOCAL_LIMITS.values())


# -- (c) reinforce ------------------------------------------------------------------------------


@functools.cache
def _reference(term_key: str):
    term = losses.reinforce(ratio_weight=True, reduction="token_sum")
    lp_fn = functools.partial(model.token_logprobs, n_heads=CFG.n_heads)

    def ref(params, tokens, lengths, batch):
        value, grads = jax.value_and_grad(lambda p: term(lp_fn(p, tokens, lengths), batch)[0])(
            params
        )
        lp = lp_fn(params, tokens, lengths)
        return value, grads, lp, jax.grad(lambda x: term(x, batch)[0])(lp)

    return jax.jit(ref)


def _ref_batch(seqs, rows=4, width=12):
    tokens = np.zeros((rows, width + 1), np.int64)
    lengths = np.zeros((rows,), np.int64)
    mask, adv, q = (np.zeros((rows, width), np.float32) for _ in range(3))
    for i, s in enumerate(seqs):
        n = s.num_targets
        tokens[i, : n + 1], lengths[i], mask[i, :n] = s.tokens, n + 1, 1.0
        adv[i, :n], q[i, :n] = s.inputs["advantages"], s.inputs["logprobs"]
    batch = losses.Batch(action_mask=mask, advantages=adv, sampling_logprobs=q)
    return jnp.asarray(tokens), jnp.asarray(lengths), batch


def test_local_reinforce_is_the_losses_term(trainer):
    seqs = tiny_seqs("reinforce", seed=3)
    seqs[0].inputs["logprobs"][0] = -40.0  # p - q > 20: the clamp binds
    seqs = [Seq(s.tokens, {k: v.astype(np.float32) for k, v in s.inputs.items()}) for s in seqs]
    trainer.reset_grads()
    result = trainer.forward_backward(seqs, "reinforce", {"score_centering": False})
    value, grads, lp, g_lp = _reference("reinforce")(trainer.params, *_ref_batch(seqs))
    np.testing.assert_allclose(result.metrics["loss:sum"], float(value), rtol=1e-5, atol=1e-5)
    for x, y in zip(
        jax.tree.leaves(trainer.accumulated_grads()), jax.tree.leaves(grads), strict=True
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
    # the formula itself: value -Σ sg(r)·A·p, gradient -r·A, r = exp(clamp(p - q, ±20)) unclipped
    total = 0.0
    for i, s in enumerate(seqs):
        p = result.logprobs[i].astype(np.float64)
        q, a = s.inputs["logprobs"].astype(np.float64), s.inputs["advantages"].astype(np.float64)
        r = np.exp(np.clip(p - q, -20.0, 20.0))
        total += float(np.sum(-r * a * p))
        np.testing.assert_allclose(
            np.asarray(g_lp[i, : s.num_targets]), -r * a, rtol=1e-4, atol=1e-6
        )
    np.testing.assert_allclose(result.metrics["loss:sum"], total, rtol=1e-4)
    trainer.reset_grads()


# -- (d) every kernel's term builds --------------------------------------------------------------


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_every_kernel_term_builds(name):
    spec = KERNELS[name]
    for term in (spec.term(spec.defaults), spec.term(), spec.term(None)):
        assert isinstance(term, losses.Term)
        if name != "cross_entropy":
            assert term.kind == name and term.config["reduction"] == "token_sum"
    with pytest.raises(ValueError, match="full-vocabulary"):
        spec.term({"target_logprob_support": "sampling_support"})
    if name == "reinforce":
        assert spec.term().config["ratio_weight"] is True
        assert spec.term().config["max_log_ratio"] == 20.0
        with pytest.raises(ValueError, match="score_centering"):
            spec.term({"score_centering": True})
    if name in ("ppo", "gspo"):  # no ratio_log_cap key: the fixed clamp
        assert spec.term().config["max_log_ratio"] == _kernels.FIXED_LOG_RATIO_CAP
