"""Parity with `transformers`: tiny random Llama / Qwen2 / Qwen3 models built here with
`transformers` and saved with ``save_pretrained`` load into the JAX decoders and give the same
logits and per-token logprobs (float32, max abs difference ≤ 1e-4; measured ≈ 1e-5); the KV-cache
decoding path gives the same logits; what the JAX side saves loads back into `transformers` with
the same logits; bfloat16 stays as close to the float32 reference as torch's own bfloat16.

Weights are scaled ×10 (norm weights 1 + 0.1·N(0, 1)) so that logits are O(1) and every
single-flag mistake of docs/hf-models.md#parity (interleaved RoPE, GQA tile, wrong scale or ε,
ignored rope scaling) is far above the tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runner.local import LocalTrainer, models  # noqa: E402
from runner.local.models import _decoder  # noqa: E402

TOL = 1e-4
B, T = 2, 24
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=5e5,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
#: name → (config class, model class, config kwargs); V = 96 everywhere.
CASES = {
    "llama_gqa_llama3_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_parameters=LLAMA3,
            max_position_embeddings=64,
        ),
    ),
    "qwen3_headdim_untied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    "qwen2_biases": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    "llama_yarn_biases": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=8
            ),
            max_position_embeddings=32,
        ),
    ),
    "llama_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=3.0),
        ),
    ),
    "qwen3_dynamic": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0),
            max_position_embeddings=32,
        ),
    ),
}


def build(name: str, dtype=None):
    cfg_cls, model_cls, kwargs = CASES[name]
    cfg = getattr(transformers, cfg_cls)(vocab_size=96, **kwargs)
    torch.manual_seed(0)
    m = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.mul_(10.0)
    return m


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved once with ``save_pretrained``: ``{name: (dir, model)}``."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in CASES:
        m = build(name)
        m.save_pretrained(root / name)
        out[name] = (root / name, m)
    return out


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, 96, (B, T))


def hf_logits(m, toks, **kw):
    with torch.no_grad():
        return m(torch.tensor(toks), **kw).logits.float().numpy()


def target_logprobs(logits, toks):
    z = logits[:, :-1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(logp, toks[:, 1:, None], -1)[..., 0]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_logprobs_match_transformers(saved, name):
    path, m = saved[name]
    cfg, params, _ = models.load_pretrained(path)
    toks = tokens()
    ref = hf_logits(m, toks)
    ours = np.asarray(jax.jit(lambda p, t: models.logits(cfg, p, t))(params, jnp.asarray(toks)))
    assert np.abs(ours - ref).max() <= TOL, np.abs(ours - ref).max()
    lp = jax.jit(  # chunked: 23 targets per row, 46 per batch
        lambda p, t: models.token_logprobs(cfg, p, t, jnp.full((B,), T), chunk=7)
    )(params, jnp.asarray(toks))
    diff = np.abs(np.asarray(lp) - target_logprobs(ref, toks)).max()
    assert diff <= TOL, diff
    assert ref.std() > 0.5  # logits are O(1): the tolerance is meaningful


def test_eager_attention_matches_too(saved):
    path, m = saved["llama_gqa_llama3_tied"]
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg, params, _ = models.load_pretrained(path)
    toks = tokens(1)
    ours = np.asarray(models.logits(cfg, params, jnp.asarray(toks)))
    assert np.abs(ours - hf_logits(eager, toks)).max() <= TOL


@pytest.mark.parametrize("name", ["llama_gqa_llama3_tied", "qwen3_headdim_untied"])
def test_kv_cache_decoding_matches_the_full_forward(saved, name):
    """Prefill 5 tokens, then decode the rest one at a time: each step's logits equal
    transformers' logits at that position."""
    path, m = saved[name]
    cfg, params, _ = models.load_pretrained(path)
    toks = tokens(2)
    ref = hf_logits(m, toks)
    P, S = 5, T
    last, ks, vs = _decoder.prefill(cfg, params, jnp.asarray(toks[:, :P]), jnp.full((B,), P))
    pad = [(0, 0), (0, 0), (0, S - P), (0, 0), (0, 0)]
    kc, vc = jnp.pad(ks, pad), jnp.pad(vs, pad)
    got = [np.asarray(last)]
    step = jax.jit(lambda p, t, pos, kc, vc: _decoder.decode_step(cfg, p, t, pos, kc, vc))
    for pos in range(P, T):
        logit, kc, vc = step(params, jnp.asarray(toks[:, pos]), jnp.full((B,), pos), kc, vc)
        got.append(np.asarray(logit))
    got = np.stack(got, axis=1)  # logits after positions P-1 .. T-1
    assert np.abs(got - ref[:, P - 1 :]).max() <= TOL


@pytest.mark.parametrize("name", ["qwen3_headdim_untied", "qwen2_biases", "llama_yarn_biases"])
def test_saved_back_loads_into_transformers_with_the_same_logits(saved, name, tmp_path):
    """What the JAX side writes loads into transformers (no missing, unexpected or misshapen
    tensor; tie kept) with the same logits."""
    path, m = saved[name]
    cfg, params, raw = models.load_pretrained(path)
    params = jax.tree.map(lambda x: x * 1.01, params)  # not the source weights
    out = models.save_pretrained(tmp_path / "out", cfg, params, extra_config=raw)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert back.config.tie_word_embeddings == m.config.tie_word_embeddings
    toks = tokens(3)
    ours = np.asarray(models.logits(cfg, params, jnp.asarray(toks)))
    assert np.abs(hf_logits(back.eval(), toks) - ours).max() <= TOL


def test_trainer_weights_after_a_step_load_into_transformers(saved, tmp_path):
    """After one optimizer step, the trainer's ``save_pretrained`` directory loads into
    transformers, tie and all, with the logprobs the trainer computes."""
    from runner import AdamParams, Seq

    name = "llama_gqa_llama3_tied"
    path, _ = saved[name]
    trainer = LocalTrainer.from_pretrained(path, max_seq_len=32)
    toks = tokens(3)
    seqs = [Seq(t, {"weights": np.ones(T - 1)}) for t in toks]
    trainer.forward_backward(seqs, "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=1e-3))
    out = trainer.save_pretrained(tmp_path / "out")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    if back.config.tie_word_embeddings:
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    mine = np.stack(trainer.forward([s.with_inputs() for s in seqs]))
    assert np.abs(target_logprobs(hf_logits(back.eval(), toks), toks) - mine).max() <= TOL


def test_sharded_checkpoints_both_ways(saved, tmp_path):
    path, m = saved["qwen2_biases"]
    m.save_pretrained(tmp_path / "hf_sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "hf_sharded").glob("model-*.safetensors"))) > 2
    cfg, params, _ = models.load_pretrained(tmp_path / "hf_sharded")
    toks = tokens(4)
    ref = hf_logits(m, toks)
    assert np.abs(np.asarray(models.logits(cfg, params, jnp.asarray(toks))) - ref).max() <= TOL
    models.save_pretrained(tmp_path / "ours_sharded", cfg, params, max_shard_bytes=20_000)
    assert (tmp_path / "ours_sharded" / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours_sharded", dtype=torch.float32
    ).eval()
    assert np.abs(hf_logits(back, toks) - ref).max() <= TOL


def test_bfloat16_is_as_close_to_float32_as_torch_bfloat16(saved):
    path, m = saved["llama_gqa_llama3_tied"]
    toks = tokens(5)
    ref = target_logprobs(hf_logits(m, toks), toks)
    torch_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16
    ).eval()
    err_torch = np.abs(target_logprobs(hf_logits(torch_bf16, toks), toks) - ref).max()
    cfg, params, _ = models.load_pretrained(path, dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16
    lp = models.token_logprobs(cfg, params, jnp.asarray(toks), jnp.full((B,), T), chunk=0)
    assert lp.dtype == jnp.float32
    err_ours = np.abs(np.asarray(lp) - ref).max()
    assert err_ours <= max(2 * err_torch, 0.05), (err_ours, err_torch)
