"""The local server (`runner.serve`) serving a Hugging Face checkpoint directory, trained through
LoRA adapters by the real, unmodified tinker SDK over loopback; and ``[model].unroll_layers``.

A tiny random Qwen3 is built with ``transformers`` here and saved with ``save_pretrained``; the
server serves it as ``--model tiny=<dir>`` (`parse_model_flags`). The reference is
`LocalTrainer.from_pretrained(dir, lora_rank=..., lora_alpha=32, seed=...)` in this process: what
the SDK gets over the wire must equal what that trainer computes (alpha 32 is the server's rule
when the request and the served config give none: Tinker's fixed alpha).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

from tinker import types  # noqa: E402

from runner import AdamParams, Seq  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.local import LocalTrainer, local_trainer_config, models  # noqa: E402
from runner.serve import (  # noqa: E402
    LoraRequest,
    ServeConfig,
    ServeError,
    ServerThread,
    parse_model_flags,
)
from runner.serve._engine import Engine, resolve_lora  # noqa: E402
from runner.serve._tinker import parse_tinker_path  # noqa: E402
from runner.tinker._convert import to_datums  # noqa: E402
from runner.tinker._seeds import prompt_seed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = f"tml-{uuid.uuid4().hex}"  # a fresh key per run (no key-shaped literal in the source)
FW_KEY = f"fw-{uuid.uuid4().hex}"  # the Fireworks SDK's (it refuses tml- keys)
V = 128
RANK, SEED = 4, 3
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
os.environ.setdefault("TINKER_TELEMETRY", "0")


def build_qwen3(directory: Path) -> Path:
    """A tiny random Qwen3 (weights scaled up, so logits are far from uniform), saved with
    ``save_pretrained`` (safetensors)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return build_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny")


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_dir):
    base_models = parse_model_flags([f"tiny={hf_dir}", "toy=examples/tiny.toml"])
    state = tmp_path_factory.mktemp("serve-state")
    config = ServeConfig(
        api_key=KEY, extra_api_keys=(FW_KEY,), state_dir=str(state), long_poll_s=0.5
    )
    with ServerThread(config, base_models) as st:
        yield st


@pytest.fixture(scope="module")
def service(served):
    svc = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    yield svc
    svc.close("success").result(timeout=30)


def _lora_client(service, **kw):
    kw = {"rank": RANK, "seed": SEED, "train_unembed": False, **kw}
    return service.create_lora_training_client("tiny", **kw).result()


def _reference(hf_dir, rank=RANK, **kw) -> LocalTrainer:
    return LocalTrainer.from_pretrained(hf_dir, lora_rank=rank, lora_alpha=32.0, seed=SEED, **kw)


def _model(served, client):
    return served.server.engine.models[client.model_id]


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_trees_equal(a, b, atol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def _seqs(n=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, V, size=int(rng.integers(5, 16))).astype(np.int64)
        out.append(Seq(toks, {"weights": rng.uniform(0.0, 1.0, toks.shape[0] - 1)}))
    return out


def _step(client, ref, seqs, adam):
    """One cross-entropy forward_backward + optim_step on both; the logprobs and loss agree."""
    out = client.forward_backward(to_datums(seqs, ("weights",)), "cross_entropy").result()
    want = ref.forward_backward(seqs, "cross_entropy")
    for o, lp in zip(out.loss_fn_outputs, want.logprobs, strict=True):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), lp, rtol=0, atol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6, abs=1e-6)
    client.optim_step(types.AdamParams(learning_rate=adam.learning_rate)).result()
    ref.optim_step(adam)
    return out


# -- LoRA over the SDK ------------------------------------------------------------------------


def test_lora_training_equals_the_local_trainer_and_leaves_the_base_frozen(served, service, hf_dir):
    client = _lora_client(service)
    info = client.get_info()
    assert info.model_data.model_name == "tiny" and info.model_data.arch == "qwen3"
    assert info.is_lora is True and info.lora_rank == RANK
    model = _model(served, client)
    assert model.lora.rank == RANK and model.lora.alpha == 32.0
    assert model.lora.targets == models.PROJECTIONS  # train_attn + train_mlp: every projection
    ref = _reference(hf_dir)
    _assert_trees_equal(_np(model.trainer.params), ref.params)  # the same A init (seed)
    adam = AdamParams(learning_rate=2e-2)
    first = _step(client, ref, _seqs(seed=1), adam)
    _step(client, ref, _seqs(seed=2), adam)
    _assert_trees_equal(_np(model.trainer.params), ref.params, atol=1e-6)
    seqs = _seqs(seed=3)
    after = client.forward(to_datums(seqs, ("weights",)), "cross_entropy").result()
    want = ref.forward([s.with_inputs() for s in seqs])
    for o, lp in zip(after.loss_fn_outputs, want, strict=True):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), lp, rtol=0, atol=1e-6)
    assert after.metrics["loss:sum"] != pytest.approx(first.metrics["loss:sum"])  # it trained

    # the base weights did not move: the trainer's frozen base is the checkpoint's, the
    # promotable weights are a PEFT adapter of rank 4, and the base model's sampler gives the
    # checkpoint's logprobs, the trained model's sampler the adapted ones
    full = LocalTrainer.from_pretrained(hf_dir)
    _assert_trees_equal(_np(model.trainer.base_params), full.params)
    path = client.save_weights_for_sampler("two-steps").result().path
    ref_file = served.server.engine._state_path(parse_tinker_path(path))
    assert ref_file.name == models.ADAPTER_WEIGHTS
    adapter = json.loads((ref_file.parent / models.ADAPTER_CONFIG).read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (RANK, 32.0)
    assert sorted(p.name for p in ref_file.parent.iterdir()) == sorted(
        [models.ADAPTER_CONFIG, models.ADAPTER_WEIGHTS]
    )
    prompt = [5, 17, 99, 3, 64]
    (base_lp,) = full.forward([Seq(np.asarray(prompt, np.int64))])
    (lora_lp,) = ref.forward([Seq(np.asarray(prompt, np.int64))])
    assert np.max(np.abs(base_lp - lora_lp)) > 1e-3
    base_sampler = service.create_sampling_client(base_model="tiny").result()
    got = base_sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    np.testing.assert_allclose(got[1:], base_lp, rtol=0, atol=1e-6)
    sampler = service.create_sampling_client(model_path=path).result()
    got = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    np.testing.assert_allclose(got[1:], lora_lp, rtol=0, atol=1e-6)

    # sampling uses the adapted weights as the trainer does (base + adapters, unmerged)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=prompt_seed(7, 0), stop=[])
    for s in (sampler, client.save_weights_and_get_sampling_client().result()):
        out = s.sample(types.ModelInput.from_ints(prompt), 2, params).result()
        (want,) = ref.sample([prompt], num_samples=2, max_tokens=6, temperature=1.0, seed=7)
        for g, w in zip(out.sequences, want, strict=True):
            np.testing.assert_array_equal(g.tokens_np, w.tokens.astype(np.int32))
            np.testing.assert_allclose(g.logprobs_np, w.logprobs, rtol=0, atol=1e-6)


def test_lora_state_resumes_identically_and_survives_a_restart(served, service, hf_dir):
    client = _lora_client(service, rank=2, train_mlp=False)
    model = _model(served, client)
    assert model.lora.rank == 2 and model.lora.targets == ATTN  # train_mlp=False: attention only
    adam = types.AdamParams(learning_rate=2e-2)
    data = to_datums(_seqs(seed=4), ("weights",))
    client.forward_backward(data, "cross_entropy").result()
    client.optim_step(adam).result()
    path = client.save_state("one").result().path
    sampler_path = client.save_weights_for_sampler("one").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    info = resumed.get_info()
    assert info.is_lora is True and info.lora_rank == 2
    assert _model(served, resumed).lora == model.lora
    for c in (client, resumed):
        c.forward_backward(data, "cross_entropy").result()
        c.optim_step(adam).result()
    _assert_trees_equal(_np(_model(served, resumed).trainer.params), _np(model.trainer.params))
    from_sampler = service.create_training_client_from_state(sampler_path).result()
    assert _model(served, from_sampler).lora == model.lora

    # a restarted server (a new engine on the same state directory) rebuilds the LoRA model
    engine = Engine(served.server.engine.base_models, served.server.engine.state_dir)
    base, params = engine.params_of(parse_tinker_path(sampler_path))
    assert base.name == "tiny" and base.config.lora.targets == ATTN
    one = _reference(hf_dir, rank=2, lora_targets=ATTN)
    one.load_weights(str(served.server.engine._state_path(parse_tinker_path(sampler_path))))
    _assert_trees_equal(_np(params), _np(one.params))
    rows = engine.list_checkpoints(client.model_id)
    assert {(r["kind"], r["name"]) for r in rows} == {("state", "one"), ("sampler", "one")}


def test_lora_options_that_cannot_be_honoured_are_user_errors(served, service):
    with pytest.raises(tinker.RequestFailedError, match="train_unembed=True is not supported"):
        service.create_lora_training_client("tiny", rank=RANK).result()  # the SDK's default
    # the rule behind create_model: the flags within the served config's targets and alpha
    base = served.server.engine.base("tiny")
    assert resolve_lora(base, LoraRequest(rank=0), 0) is None
    assert resolve_lora(base, LoraRequest(rank=8, default_alpha=16.0), 0).alpha == 16.0
    restricted = dataclasses.replace(base, lora_targets=("q_proj", "gate_proj"), lora_alpha=4.0)
    got = resolve_lora(restricted, LoraRequest(rank=8, train_mlp=False), 5)
    assert (got.targets, got.alpha, got.seed) == (("q_proj",), 4.0, 5)
    assert resolve_lora(restricted, LoraRequest(rank=8, alpha=2.0), 5).alpha == 2.0
    with pytest.raises(ServeError, match="leave no projection to adapt within"):
        resolve_lora(restricted, LoraRequest(rank=8, train_attn=False, train_mlp=False), 0)
    with pytest.raises(ServeError, match="lora rank must be an integer >= 0"):
        resolve_lora(base, LoraRequest(rank=-1), 0)


def test_the_toy_model_trains_full_weights_and_says_so(served, service):
    client = service.create_lora_training_client("toy", rank=RANK).result()
    info = client.get_info()
    assert info.is_lora is False and info.lora_rank is None
    assert info.model_data.arch == "foldloss-local-transformer"
    model = _model(served, client)
    assert model.lora is None and model.lora_rank == RANK  # the rank asked for, recorded


def test_the_fireworks_sdk_trains_lora_with_its_alpha(served):
    sdk = pytest.importorskip("fireworks.training.sdk")
    svc = sdk.FiretitanServiceClient(api_key=FW_KEY, base_url=served.url)
    engine = served.server.engine
    kw = {"base_model": "tiny", "train_unembed": False}
    client = svc.create_training_client(lora_rank=RANK, lora_alpha=8, seed=SEED, **kw)
    got = engine.models[client.model_id].lora
    assert (got.rank, got.alpha, got.targets) == (RANK, 8.0, models.PROJECTIONS)
    client = svc.create_training_client(lora_rank=3, lora_alpha=None, train_attn=False, **kw)
    got = engine.models[client.model_id].lora  # None: the Fireworks backend's 2·rank
    assert (got.rank, got.alpha, got.targets) == (3, 6.0, ("gate_proj", "up_proj", "down_proj"))
    with pytest.raises(Exception, match="init_method 'nora' is not supported"):
        svc.create_training_client(lora_rank=2, lora_init_method="nora", **kw)
    with pytest.raises(Exception, match="train_unembed=True is not supported"):
        svc.create_training_client(base_model="tiny", lora_rank=2, seed=9)
    full = svc.create_training_client(base_model="tiny", lora_rank=0)  # full weights
    assert engine.models[full.model_id].lora is None


# -- --model NAME=PATH ------------------------------------------------------------------------


def test_bad_model_paths_fail_at_startup_naming_the_flag(tmp_path, hf_dir):
    with pytest.raises(ValueError, match=r"--model x=\S*nope: \S*nope does not exist"):
        parse_model_flags([f"x={tmp_path / 'nope'}"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"--model x=\S*empty: \S*empty has no config.json"):
        parse_model_flags([f"x={empty}"])
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64}))
    with pytest.raises(ValueError, match=r"--model x=\S*gpt2: .*gpt2"):
        parse_model_flags([f"x={gpt2}"])
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"--model x=\S*weightless: .*no model.safetensors"):
        parse_model_flags([f"x={weightless}"])


# -- [model].unroll_layers --------------------------------------------------------------------


def test_unroll_layers_is_a_model_key_for_decoders_only(tmp_path):
    sets = ['model.arch="llama"', "model.n_layers=2"]
    scanned = load_config(ROOT / "examples" / "tiny.toml", sets).model
    unrolled = load_config(ROOT / "examples" / "tiny.toml", [*sets, "model.unroll_layers=true"])
    assert unrolled.model.unroll_layers is True
    kw = dict(vocab_size=53, seed=1, checkpoint_dir=None)
    a = LocalTrainer(local_trainer_config(scanned, **kw))
    b = LocalTrainer(local_trainer_config(unrolled.model, **kw))
    assert b.config.unroll_layers is True and a.config.unroll_layers is False
    seqs = [Seq(np.arange(3, 3 + n, dtype=np.int64) % 53) for n in (5, 12)]
    for x, y in zip(a.forward(seqs), b.forward(seqs), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[model\]\.unroll_layers applies to the decoders"):
        load_config(ROOT / "examples" / "tiny.toml", ["model.unroll_layers=true"])
    with pytest.raises(ValueError, match=r"\[model\]\.unroll_layers must be true or false"):
        load_config(ROOT / "examples" / "tiny.toml", [*sets, "model.unroll_layers=1"])


def test_fireworks_promotion_of_a_decoder_is_a_loadable_checkpoint_directory(tmp_path, hf_dir):
    pytest.importorskip("fireworks.training.sdk")
    from tests.test_serve_fireworks import ADAM, BASE, connect, fireworks_server

    st = fireworks_server(tmp_path / "state", parse_model_flags([f"{BASE}={hf_dir}"]))
    try:
        t = connect(st)
        seqs = _seqs(2, seed=4)
        t.forward_backward(seqs, "cross_entropy")
        t.optim_step(ADAM, "none")
        promotable = t.save_promotable("p1")
        model = t.control_plane.promote_checkpoint(
            name=promotable["checkpoint_resource"], output_model_id="m-1", base_model=BASE
        )
        trained = st.server.engine.models[t.client.model_id].trainer
        t.close()
    finally:
        st.stop()
    assert model["kind"] == "HF_BASE_MODEL"
    promoted = Path(model["weights"])
    assert (promoted / "config.json").is_file()  # the whole transformers directory
    _, want = trained.forward(seqs)
    _, got = LocalTrainer.from_pretrained(promoted).forward(seqs)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
