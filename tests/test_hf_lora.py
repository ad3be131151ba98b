"""LoRA on the decoders: the forward at initialization equals the base model's; a step changes
the adapters only (the base is frozen, the optimizer state covers the adapters only); a merged
checkpoint equals base + s·B·A; the PEFT files round-trip and load with `peft` where installed;
unsupported adapter configs fail naming the key.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from runner import AdamParams, Seq
from runner.local import LocalTrainer, LocalTrainerConfig, models

DEC = models.DecoderConfig(
    family="qwen3",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
)
LORA = models.LoraConfig(rank=3, alpha=5.0, targets=("q_proj", "v_proj", "down_proj"))


def config(**kw):
    kw.setdefault("dtype", "float64")
    return LocalTrainerConfig(decoder=DEC, max_seq_len=32, seed=3, **kw)


def seqs(seed=0):
    rng = np.random.default_rng(seed)
    return [Seq(rng.integers(0, 32, n), {"weights": rng.normal(size=n - 1)}) for n in (9, 14, 5)]


def flat(tree):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in models_flat(tree)}


def models_flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return [(tuple(getattr(p, "key", p) for p in path), v) for path, v in leaves]


@pytest.fixture(scope="module")
def stepped():
    """A LoRA trainer after one AdamW step (so that B ≠ 0), and its base weights before it."""
    t = LocalTrainer(config(lora=LORA))
    base_before = flat(t.base_params)
    t.forward_backward(seqs(), "cross_entropy")
    t.optim_step(AdamParams(learning_rate=0.05, weight_decay=0.1))
    return t, base_before


def test_lora_config_validation():
    assert LORA.scale == pytest.approx(5 / 3)
    assert models.LoraConfig(rank=4, alpha=8, use_rslora=True).scale == pytest.approx(4.0)
    assert models.LoraConfig(rank=4).alpha == 4.0  # default: scale 1
    assert models.LoraConfig(rank=2).targets == models.PROJECTIONS  # all-linear
    assert models.LoraConfig(rank=2, targets=["v_proj", "q_proj"]).targets == ("q_proj", "v_proj")
    for kwargs, message in [
        (dict(rank=0), "rank must be an int >= 1"),
        (dict(rank=2, alpha=-1), "alpha must be a number > 0"),
        (dict(rank=2, targets=("lm_head",)), "unknown module"),
        (dict(rank=2, targets=()), "non-empty"),
        (dict(rank=2, targets=("q_proj", "q_proj")), "duplicates"),
    ]:
        with pytest.raises(ValueError, match=message):
            models.LoraConfig(**kwargs)
    with pytest.raises(ValueError, match="lora needs a decoder"):
        LocalTrainerConfig(lora=LORA)


def test_forward_at_initialization_equals_the_base_model():
    base = LocalTrainer(config())
    lora = LocalTrainer(config(lora=LORA))
    assert set(lora.params) == set(LORA.targets)
    for a in lora.params.values():
        assert not np.any(np.asarray(a["lora_B"])) and np.any(np.asarray(a["lora_A"]))
        bound = 1 / math.sqrt(a["lora_A"].shape[-1])
        assert np.max(np.abs(np.asarray(a["lora_A"]))) <= bound  # kaiming-uniform(a=√5)
    for x, y in zip(lora.forward(seqs()), base.forward(seqs()), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_step_changes_only_the_adapters(stepped):
    t, base_before = stepped
    for k, v in flat(t.base_params).items():
        np.testing.assert_array_equal(v, base_before[k], err_msg=k)
    assert all(np.any(np.asarray(a["lora_B"])) for a in t.params.values())
    n_adapter = sum(v.size for v in flat(t.params).values())
    opt = jax.tree.leaves(t._opt_state)
    big = [x for x in opt if np.size(x) > 1]
    assert sum(np.size(x) for x in big) == 2 * n_adapter  # Adam moments of the adapters only


def test_accumulated_gradient_equals_jax_grad_through_the_adapters():
    t = LocalTrainer(config(lora=LORA))
    t.set_params(jax.tree.map(lambda x: np.asarray(x) + 0.1, jax.device_get(t.params)))
    data = seqs(1)
    t.forward_backward(data, "cross_entropy")
    width = max(len(s.tokens) for s in data)
    tokens = np.zeros((len(data), width), np.int32)
    w = np.zeros((len(data), width - 1))
    for i, s in enumerate(data):
        tokens[i, : len(s.tokens)] = s.tokens
        w[i, : len(s.tokens) - 1] = s.inputs["weights"]
    lengths = np.array([len(s.tokens) for s in data])

    def loss(p):  # the cross_entropy kernel: -Σ w·logprob
        return -(t.token_logprobs(p, tokens, lengths) * w).sum()

    direct = jax.jit(jax.grad(loss))(t.params)
    got = t.accumulated_grads()
    for (k, a), (_, b) in zip(models_flat(direct), models_flat(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12, err_msg=str(k))


def test_merged_checkpoint_equals_base_plus_scaled_b_a(stepped, tmp_path):
    t, _ = stepped
    out = t.save_pretrained(tmp_path / "merged")
    merged = load_file(f"{out}/model.safetensors")
    base = jax.device_get(t.base_params)
    for name, ab in jax.device_get(t.params).items():
        module = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        for i in range(DEC.num_layers):
            want = base["layers"][name][i] + LORA.scale * ab["lora_B"][i] @ ab["lora_A"][i]
            got = merged[f"model.layers.{i}.{module}.{name}.weight"]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    untouched = merged["model.layers.1.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(untouched, base["layers"]["k_proj"][1])
    # the merged model (no LoRA) computes what the LoRA trainer computes
    full = LocalTrainer.from_pretrained(out, max_seq_len=32, dtype="float64")
    for x, y in zip(full.forward(seqs(2)), t.forward(seqs(2)), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-10)


def test_peft_files_round_trip(stepped, tmp_path):
    t, _ = stepped
    out = t.save_adapter(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 3, 5.0)
    assert sorted(cfg["target_modules"]) == sorted(LORA.targets)
    names = set(load_file(f"{out}/adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names
    assert len(names) == 2 * len(LORA.targets) * DEC.num_layers
    fresh = LocalTrainer(config(lora=LORA))  # the same seeded base
    fresh.load_weights(out)
    for x, y in zip(fresh.forward(seqs()), t.forward(seqs()), strict=True):
        np.testing.assert_array_equal(x, y)


def test_sampler_weights_of_a_lora_trainer_are_a_peft_adapter(stepped, tmp_path):
    t, _ = stepped
    t2 = LocalTrainer(config(lora=LORA, checkpoint_dir=str(tmp_path)))  # the same seeded base
    t2.set_params(jax.device_get(t.params))
    ref = t2.save_weights_for_sampler("w")
    assert ref.endswith("sampler/w/adapter_model.safetensors")
    t3 = LocalTrainer(config(lora=LORA, checkpoint_dir=str(tmp_path)))
    t3.load_weights("w")  # by name; the file alone (the KL reference's copy) works too
    t3.load_weights(ref)
    for x, y in zip(t3.forward(seqs()), t.forward(seqs()), strict=True):
        np.testing.assert_array_equal(x, y)
    other = LocalTrainer(config(lora=models.LoraConfig(rank=2), checkpoint_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="checkpoint model differs from this trainer's"):
        other.load_weights(ref)


def _adapter_dir(tmp_path, stepped, **edit):
    t, _ = stepped
    out = t.save_adapter(tmp_path / "a")
    cfg_path = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(edit)
    cfg_path.write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(use_dora=True), "'use_dora' = True is not supported"),
        (dict(peft_type="IA3"), "only LORA is supported"),
        (dict(bias="all"), "'bias' = 'all' is not supported"),
        (dict(rank_pattern={"q_proj": 8}), "'rank_pattern'"),
        (dict(target_modules=["dense"]), "unknown module"),
        (dict(r=4), "has shape"),
    ],
)
def test_adapter_config_errors_name_the_key(stepped, tmp_path, edit, message):
    out = _adapter_dir(tmp_path, stepped, **edit)
    with pytest.raises(ValueError, match=message) as err:
        models.load_peft(out, DEC, dtype="float64")
    assert "adapter_" in str(err.value)


def test_loading_the_wrong_adapter_shape_fails(stepped, tmp_path):
    out = _adapter_dir(tmp_path, stepped)
    other = LocalTrainer(config(lora=models.LoraConfig(rank=3, alpha=5.0)))  # all-linear
    with pytest.raises(ValueError, match="differs from this trainer's LoRA"):
        other.load_weights(out)
    full = LocalTrainer(config())
    with pytest.raises(ValueError, match="is a LoRA adapter, but this trainer trains every"):
        full.load_weights(out)


def test_peft_loads_the_adapter_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = LocalTrainer(config())
    base_dir = base.save_pretrained(tmp_path / "base")
    t = LocalTrainer.from_pretrained(base_dir, max_seq_len=32, lora=LORA, dtype="float64")
    assert t.arch == LocalTrainer(config(lora=LORA)).arch  # compiled functions are shared
    t.forward_backward(seqs(), "cross_entropy")
    t.optim_step(AdamParams(learning_rate=0.05))
    out = t.save_adapter(tmp_path / "adapter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    model = peft.PeftModel.from_pretrained(hf, out).eval()
    data = seqs(3)
    ours = t.forward([s.with_inputs() for s in data])
    for s, lp in zip(data, ours, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor(s.tokens[None])).logits[0].double()
        ref = torch.log_softmax(logits, -1).numpy()[np.arange(len(s.tokens) - 1), s.tokens[1:]]
        # PEFT keeps the adapter weights in float32 (autocast_adapter_dtype): ~1e-8 off float64
        np.testing.assert_allclose(lp, ref, rtol=0, atol=1e-6)
    merged = model.merge_and_unload().state_dict()
    mine = load_file(f"{t.save_pretrained(tmp_path / 'merged')}/model.safetensors")
    for name, value in mine.items():
        np.testing.assert_allclose(merged[name].numpy(), value, rtol=0, atol=1e-6, err_msg=name)
