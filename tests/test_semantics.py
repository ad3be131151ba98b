"""The runner refuses a server whose ``cross_entropy`` is not ``Σ −w·logp`` (`runner._semantics`).

The non-conforming server is our own HTTP server in its test-only ``skyrl`` mode (SkyRL tx's
normalisation: each datum's loss ÷ ``max(Σw, 1e-9)``, mean over datums, no ``loss:sum``), driven
by the real tinker SDK over loopback; the conforming one is the same server in its normal mode.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

from runner import __main__ as cli  # noqa: E402
from runner._semantics import PROBED, SemanticsError, check_reported_loss, probe_seqs  # noqa: E402
from runner._types import ForwardBackwardResult, Seq  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from runner.steps import sft_nll  # noqa: E402
from runner.tinker import TinkerRequestError, make_trainer  # noqa: E402
from tests.wire_helpers import TINY, one_error_line  # noqa: E402

MODEL = "foldloss/tiny"
KEY_ENV = "FOLDLOSS_TEST_SEMANTICS_KEY"
KEY = f"tml-{uuid.uuid4().hex}"
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="module", params=["", "skyrl"])
def served(request, tmp_path_factory):
    models = parse_model_flags([f"{MODEL}=examples/tiny.toml"])
    state = tmp_path_factory.mktemp("semantics-state")
    config = ServeConfig(
        api_key=KEY, state_dir=str(state), long_poll_s=0.5, test_cross_entropy=request.param
    )
    with ServerThread(config, models) as st:
        yield request.param, st


def _overrides(url: str) -> list[str]:
    return [
        "run.backend='tinker'",
        f"tinker.base_url='{url}'",
        f"tinker.base_model='{MODEL}'",
        f"tinker.api_key_env='{KEY_ENV}'",
        "tinker.lora_rank=8",
        "tinker.request_timeout_s=60.0",
    ]


def _sft_seqs(rng: np.random.Generator, n: int = 3) -> list[Seq]:
    seqs = []
    for _ in range(n):
        tokens = rng.integers(1, 20, size=int(rng.integers(6, 12)))
        w = (rng.random(len(tokens) - 1) < 0.6).astype(np.float64)
        w[-1] = 1.0
        seqs.append(Seq(tokens, {"weights": w}))
    total = sum(s.inputs["weights"].sum() for s in seqs)
    return [Seq(s.tokens, {"weights": s.inputs["weights"] / total}) for s in seqs]


def test_a_conforming_server_passes_and_a_skyrl_server_stops_before_any_step(served, monkeypatch):
    mode, st = served
    monkeypatch.setenv(KEY_ENV, KEY)
    trainer = make_trainer(load_config(TINY, _overrides(st.url)))
    try:
        seqs = _sft_seqs(np.random.default_rng(0))
        if mode == "":
            result = trainer.forward_backward(seqs, "cross_entropy")
            assert check_reported_loss(seqs, result.logprobs, result.metrics)  # checked per call
            assert not trainer._probed  # loss:sum came back: no probe needed
            for kernel in PROBED:  # every probe passes on a conforming server
                trainer.probe(kernel)
            assert trainer._probed == set(PROBED)
        else:
            with pytest.raises(TinkerRequestError) as info:
                trainer.forward_backward(seqs, "cross_entropy")
            line = str(info.value)
            assert "\n" not in line and st.url in line
            assert "cross_entropy is not the token sum" in line
            assert "expected no change of the logprobs" in line and "moved them by" in line
        assert trainer.counters["optim_step"] == 0  # the trained model never stepped
        # the probe trained a scratch model only: the trained one is at its initial weights
        assert trainer.counters["forward_backward"] == 1
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "command, sets, kernel",
    [
        ("sft", [], "cross_entropy"),  # SFT
        ("train", ["sft.steps=0"], "cross_entropy"),  # GRPO + ECHO: the fused client path
        ("train", ["sft.steps=0", "rl.env_coef=0.0"], "ppo"),  # plain GRPO: the builtin kernel
    ],
)
def test_the_main_job_against_a_skyrl_server_stops_in_one_line_before_any_step(
    served, tmp_path, monkeypatch, capsys, command, sets, kernel
):
    mode, st = served
    if mode != "skyrl":
        pytest.skip("the refusal is the skyrl server's")
    monkeypatch.setenv(KEY_ENV, KEY)
    args = [command, "--config", str(TINY), "--output-dir", str(tmp_path), "--no-progress"]
    for o in [*_overrides(st.url), *sets]:
        args += ["--set", o]
    capsys.readouterr()
    assert cli.main(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{kernel} is not the" in line and st.url in line
    records = [
        json.loads(line)
        for p in tmp_path.rglob("metrics.jsonl")
        for line in p.read_text().splitlines()
    ]
    assert all(r["phase"] == "eval" for r in records)  # the initial evaluation, no step


def _reported(seqs, logprobs, scale):
    want = sum(-np.dot(s.inputs["weights"], lp) for s, lp in zip(seqs, logprobs, strict=True))
    return {"loss:sum": float(want) * scale}


def test_the_per_call_check_catches_another_normalisation():
    rng = np.random.default_rng(1)
    seqs = _sft_seqs(rng)
    lps = [-rng.random(s.num_targets) * 3 for s in seqs]
    assert check_reported_loss(seqs, lps, _reported(seqs, lps, 1.0))
    assert not check_reported_loss(seqs, lps, {})  # nothing reported: not checkable
    assert not check_reported_loss(seqs, lps[:1], _reported(seqs, lps, 1.0))
    with pytest.raises(SemanticsError, match="expected loss:sum"):
        check_reported_loss(seqs, lps, _reported(seqs, lps, 1.0 / len(seqs)))


@pytest.mark.parametrize("kernel", sorted(PROBED))
def test_the_probe_datums_cancel_under_the_sum_and_not_per_sequence(kernel):
    cancel, control = probe_seqs(kernel)
    name = PROBED[kernel]
    n = max(s.num_targets for s in cancel)
    w = np.stack([np.pad(s.inputs[name], (0, n - s.num_targets)) for s in cancel])
    lengths = np.array([[s.num_targets] for s in cancel])
    assert len(set(lengths.ravel())) == len(cancel)  # three lengths
    # the signals sit on targets every prefix has, so their logprobs (and gradients) are shared
    assert not np.any(w[:, min(lengths.ravel()) :])
    np.testing.assert_array_equal(w.sum(axis=0), 0.0)  # Σ −w·logp: zero gradient
    per_seq = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-9) / len(cancel)
    assert np.abs(per_seq.sum(axis=0)).max() > 1.0  # SkyRL's cross_entropy: none cancel
    by_count = w / lengths  # SkyRL's policy kernels (weights = 1): a per-sequence token mean
    assert np.abs(by_count.sum(axis=0)).max() > 0.01
    assert np.abs((w / np.abs(w).sum(axis=1, keepdims=True)).sum(axis=0)).max() > 0.1
    assert control[0].inputs[name].sum() > 0


def test_sft_nll_falls_back_to_the_returned_logprobs():
    rng = np.random.default_rng(2)
    seqs = _sft_seqs(rng)
    lps = [-rng.random(s.num_targets) for s in seqs]
    want = sum(-np.dot(s.inputs["weights"], lp) for s, lp in zip(seqs, lps, strict=True))
    server = sft_nll(seqs, ForwardBackwardResult(lps, {"loss:sum": 1.5}))
    assert server == {"sft/nll": 1.5, "sft/nll_from_logprobs": 0.0}
    derived = sft_nll(seqs, ForwardBackwardResult(lps, {}))
    assert derived["sft/nll_from_logprobs"] == 1.0
    np.testing.assert_allclose(derived["sft/nll"], want, rtol=1e-12)
    assert sft_nll(seqs, ForwardBackwardResult([], {})) == {}
