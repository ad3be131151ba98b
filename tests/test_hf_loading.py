"""Hugging Face checkpoint directories without torch (docs/hf-models.md#writing-test-models-without-torch): numpy-written
safetensors + config.json load, both config layouts agree, tied and sharded checkpoints round
trip, and every loading error path names the file, tensor or key.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from runner._digests import IntegrityError
from runner.local import models

L, H, I, V, NH, NKV, D = 2, 16, 24, 40, 4, 2, 8


def base_config(**over):
    cfg = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": L,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": D,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "dtype": "float32",
    }
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def hf_tensors(seed=0, tied=True, dtype=np.float32):
    """The tensor dict by HF names (docs/hf-models.md#tensors-and-files), written independently of the loader."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(dtype)

    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + r(H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update(
            {
                p + "input_layernorm.weight": 1 + r(H),
                p + "post_attention_layernorm.weight": 1 + r(H),
                p + "self_attn.q_proj.weight": r(NH * D, H),
                p + "self_attn.k_proj.weight": r(NKV * D, H),
                p + "self_attn.v_proj.weight": r(NKV * D, H),
                p + "self_attn.o_proj.weight": r(H, NH * D),
                p + "self_attn.q_norm.weight": 1 + r(D),
                p + "self_attn.k_norm.weight": 1 + r(D),
                p + "mlp.gate_proj.weight": r(I, H),
                p + "mlp.up_proj.weight": r(I, H),
                p + "mlp.down_proj.weight": r(H, I),
            }
        )
    if not tied:
        t["lm_head.weight"] = r(V, H)
    return t


def write(directory: Path, config=None, tensors=None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(base_config() if config is None else config))
    save_file(
        hf_tensors() if tensors is None else tensors,
        directory / "model.safetensors",
        {"format": "pt"},
    )
    return directory


def test_numpy_written_checkpoint_loads_exactly(tmp_path):
    t = hf_tensors()
    cfg, params, raw = models.load_pretrained(write(tmp_path / "m", tensors=t))
    assert cfg.family == "qwen3" and cfg.head_dim == D and cfg.num_kv_heads == NKV
    assert cfg.tie_word_embeddings and "lm_head" not in params  # one array when tied
    assert raw["bos_token_id"] == 1
    np.testing.assert_array_equal(params["embed"], t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        params["layers"]["k_norm"][1], t["model.layers.1.self_attn.k_norm.weight"]
    )
    assert params["layers"]["q_proj"].shape == (L, NH * D, H)


def test_legacy_config_layout_equals_the_v5_layout(tmp_path):
    legacy = base_config(rope_parameters=None, rope_theta=1e6, rope_scaling=None, dtype=None)
    legacy["torch_dtype"] = "bfloat16"
    assert (
        models.read_config(write(tmp_path / "old", legacy))[0]
        == models.read_config(write(tmp_path / "new"))[0]
    )
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    a = base_config(rope_parameters=None, rope_theta=5e5, rope_scaling=dict(llama3))
    b = base_config(rope_parameters=dict(llama3, rope_theta=5e5))
    ca, cb = models.from_hf_config(a), models.from_hf_config(b)
    assert ca == cb and ca.rope.rope_type == "llama3" and ca.rope.theta == 5e5
    # transformers' defaults fill missing keys: theta 10000; qwen3 head_dim 128 and 32 kv heads
    c = models.from_hf_config(
        base_config(
            rope_parameters=None,
            head_dim=None,
            num_key_value_heads=None,
            num_attention_heads=32,
            hidden_size=64,
        )
    )
    assert (c.rope.theta, c.head_dim, c.num_kv_heads) == (10000.0, 128, 32)


def test_bfloat16_storage_is_cast_to_the_requested_dtype(tmp_path):
    import ml_dtypes

    t = hf_tensors(dtype=ml_dtypes.bfloat16)
    path = write(tmp_path / "bf", tensors=t)
    _, p32, _ = models.load_pretrained(path)
    _, p16, _ = models.load_pretrained(path, dtype="bfloat16")
    assert p32["embed"].dtype == np.float32 and p16["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(p32["embed"], t["model.embed_tokens.weight"].astype(np.float32))


def test_bfloat16_weights_are_written_with_their_digest_and_read_back_exactly(tmp_path):
    cfg, params, _ = models.load_pretrained(write(tmp_path / "m"), dtype="bfloat16")
    out = models.save_pretrained(tmp_path / "bf16", cfg, params)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _, back, _ = models.load_pretrained(out, dtype="bfloat16")  # verifies data_sha256
    np.testing.assert_array_equal(
        back["layers"]["q_proj"].view(np.uint16), params["layers"]["q_proj"].view(np.uint16)
    )


def test_save_round_trip_tied_untied_and_sharded(tmp_path):
    cfg, params, raw = models.load_pretrained(write(tmp_path / "m"))
    out = models.save_pretrained(tmp_path / "single", cfg, params, extra_config=raw)
    names = set(load_file(out / "model.safetensors"))
    assert "lm_head.weight" not in names and len(names) == 2 + 11 * L
    saved_cfg = json.loads((out / "config.json").read_text())
    assert saved_cfg["bos_token_id"] == 1 and saved_cfg["tie_word_embeddings"] is True
    assert saved_cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    cfg2, params2, _ = models.load_pretrained(out)
    assert cfg2 == cfg
    for a, b in zip(
        models.to_hf_tensors(cfg, params).values(),
        models.to_hf_tensors(cfg2, params2).values(),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    sharded = models.save_pretrained(tmp_path / "sharded", cfg, params, max_shard_bytes=4000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert (
        len(set(index["weight_map"].values())) > 3 and not (sharded / "model.safetensors").exists()
    )
    _, params3, _ = models.load_pretrained(sharded)
    np.testing.assert_array_equal(params3["layers"]["down_proj"], params["layers"]["down_proj"])
    untied = write(
        tmp_path / "untied", base_config(tie_word_embeddings=False), hf_tensors(tied=False)
    )
    cfg4, params4, _ = models.load_pretrained(untied)
    assert "lm_head" in params4
    assert "lm_head.weight" in load_file(
        models.save_pretrained(tmp_path / "u2", cfg4, params4) / "model.safetensors"
    )


def test_a_tied_lm_head_equal_to_the_embedding_is_accepted(tmp_path):
    t = hf_tensors()
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(D // 2, np.float32)  # old exports
    _, params, _ = models.load_pretrained(write(tmp_path / "m", tensors=t))
    assert "lm_head" not in params


def _drop(name):
    t = hf_tensors()
    del t[name]
    return t


def _reshape(name):
    t = hf_tensors()
    t[name] = np.zeros((3, 3), np.float32)
    return t


def _extra(name, value):
    t = hf_tensors()
    t[name] = value
    return t


def _poisoned(name, value, dtype=np.float32):
    t = hf_tensors(dtype=dtype)
    flat = t[name].reshape(-1)
    flat[7 if t[name].ndim == 1 else 5 * t[name].shape[1] + 7] = value
    return t


CONFIG_ERRORS = [
    (base_config(model_type=None), "no 'model_type' key"),
    (base_config(model_type="mistral"), "'model_type' = 'mistral' is not a supported"),
    (base_config(architectures=["Qwen3ForSequenceClassification"]), "'architectures'"),
    (base_config(vocab_size=None), "missing required key 'vocab_size'"),
    (base_config(hidden_act="gelu"), "'hidden_act' = 'gelu' is not supported"),
    (base_config(use_sliding_window=True), "'use_sliding_window' = True"),
    (base_config(attention_dropout=0.1), "'attention_dropout' = 0.1"),
    (base_config(layer_types=["sliding_attention", "full_attention"]), "'layer_types'"),
    (
        base_config(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
        "'rope_parameters.rope_type' = 'longrope' is not implemented",
    ),
    (
        base_config(rope_parameters=None, rope_scaling={"type": "su", "factor": 2.0}),
        "'rope_scaling.rope_type' = 'su' is not implemented",
    ),
    (
        base_config(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
        "rope_type 'llama3' needs low_freq_factor",
    ),
    (
        base_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "foo": 1}),
        "unsupported key 'rope_parameters.foo'",
    ),
    (base_config(partial_rotary_factor=0.5), "'partial_rotary_factor' = 0.5"),
    (
        base_config(quantization_config={"quant_method": "gptq"}),
        r"unsupported key\(s\) \['quantization_config'\]",
    ),
    (base_config(num_key_value_heads=3), "num_heads=4 must be a multiple of num_kv_heads=3"),
    (base_config(head_dim=7), "head_dim must be a positive even int"),
]


@pytest.mark.parametrize("config, message", CONFIG_ERRORS)
def test_config_errors_name_the_file_and_key(tmp_path, config, message):
    path = write(tmp_path / "m", config)
    with pytest.raises(ValueError, match=message) as err:
        models.load_pretrained(path)
    assert "config.json" in str(err.value)


TENSOR_ERRORS = [
    (
        lambda: _drop("model.layers.1.mlp.up_proj.weight"),
        ValueError,
        r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]",
    ),
    (
        lambda: _reshape("model.layers.0.self_attn.q_proj.weight"),
        ValueError,
        r"'model.layers.0.self_attn.q_proj.weight' has shape \[3, 3\], expected \[32, 16\]",
    ),
    (
        lambda: _extra("model.layers.2.mlp.up_proj.weight", np.zeros((I, H), np.float32)),
        ValueError,
        "unexpected tensor 'model.layers.2.mlp.up_proj.weight'",
    ),
    (
        lambda: _extra("model.layers.0.self_attn.q_proj.bias", np.zeros((NH * D,), np.float32)),
        ValueError,
        "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'",
    ),
    (
        lambda: _extra("lm_head.weight", np.ones((V, H), np.float32)),
        ValueError,
        "'lm_head.weight' differs from 'model.embed_tokens.weight'",
    ),
    (lambda: _extra("model.norm.weight", np.ones((H,), np.int32)), ValueError, "dtype I32"),
    (
        lambda: _poisoned("model.layers.1.mlp.up_proj.weight", np.nan),
        IntegrityError,
        r"tensor 'model.layers.1.mlp.up_proj.weight': 1 of 384 values are NaN or infinite "
        r"\(the first at index \[5, 7\]\); refusing to load non-finite weights",
    ),
    (
        lambda: _poisoned("model.norm.weight", -np.inf, dtype=np.float16),
        IntegrityError,
        r"tensor 'model.norm.weight': 1 of 16 values are NaN or infinite",
    ),
]


@pytest.mark.parametrize("tensors, error, message", TENSOR_ERRORS)
def test_tensor_errors_name_the_file_and_tensor(tmp_path, tensors, error, message):
    path = write(tmp_path / "m", tensors=tensors())
    with pytest.raises(error, match=message) as err:
        models.load_pretrained(path)
    assert str(path) in str(err.value)


def test_untied_config_without_lm_head_fails_instead_of_a_random_head(tmp_path):
    path = write(tmp_path / "m", base_config(tie_word_embeddings=None))  # missing flag: untied
    with pytest.raises(
        ValueError, match=r"missing tensor\(s\) \['lm_head.weight'\].*tie_word_embeddings=False"
    ):
        models.load_pretrained(path)


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        models.load_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json: model config not found"):
        models.load_pretrained(tmp_path / "empty")
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="badjson/config.json: model config is not valid JSON"):
        models.load_pretrained(bad)
    nofile = tmp_path / "noweights"
    nofile.mkdir()
    (nofile / "config.json").write_text(json.dumps(base_config()))
    (nofile / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(
        FileNotFoundError,
        match=r"no model.safetensors or model.safetensors.index.json \(only safetensors",
    ):
        models.load_pretrained(nofile)
    torn = write(tmp_path / "torn")
    (torn / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="torn/model.safetensors: not a readable safetensors file"):
        models.load_pretrained(torn)


def test_sharded_index_errors(tmp_path):
    cfg, params, _ = models.load_pretrained(write(tmp_path / "m"))
    sharded = models.save_pretrained(tmp_path / "s", cfg, params, max_shard_bytes=4000)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (sharded / shard).rename(sharded / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match=f"shard {shard} .* is missing"):
        models.load_pretrained(sharded)
    (sharded / "moved.safetensors").rename(sharded / shard)
    wmap = dict(index["weight_map"])
    name = "model.layers.0.mlp.up_proj.weight"
    wmap[name] = next(f for f in set(wmap.values()) if f != wmap[name])
    index_path.write_text(json.dumps({"weight_map": wmap}))
    with pytest.raises(ValueError, match=f"tensor '{name}' \\(named by the index\\) is missing"):
        models.load_pretrained(sharded)
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no 'weight_map'"):
        models.load_pretrained(sharded)


def test_written_files_are_verified_by_their_digests(tmp_path):
    cfg, params, _ = models.load_pretrained(write(tmp_path / "m"))
    out = models.save_pretrained(tmp_path / "ours", cfg, params)
    # a flipped byte in the tensor data
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corrupted or was modified"):
        models.load_pretrained(out)
    # a config.json that is not the one the weights were written with
    out = models.save_pretrained(tmp_path / "ours2", cfg, params)
    text = json.loads((out / "config.json").read_text())
    text["rms_norm_eps"] = 1e-5
    (out / "config.json").write_text(json.dumps(text))
    with pytest.raises(IntegrityError, match="written with a different config.json"):
        models.load_pretrained(out)


def test_saving_replaces_a_directory_atomically(tmp_path):
    cfg, params, _ = models.load_pretrained(write(tmp_path / "m"))
    out = models.save_pretrained(tmp_path / "out", cfg, params, max_shard_bytes=4000)
    models.save_pretrained(out, cfg, params)  # unsharded now: no stale shard or index is left
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]  # no temporary left
