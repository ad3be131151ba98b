"""`LocalTrainer` on the decoders: `from_pretrained` (offline), forward / forward_backward equal a
direct ``jax.grad``, KV-cache sampling, resumable state and promotable Hugging Face weights with
their digests, the ``[model]`` config keys, and the main job on a checkpoint directory with LoRA
and a KL reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from runner import AdamParams, Seq
from runner._digests import IntegrityError
from runner.config import load_config
from runner.local import LocalTrainer, LocalTrainerConfig, local_trainer_config, models

ROOT = Path(__file__).resolve().parents[1]
V = 53  # the built-in character tokenizer's vocabulary, so the main job can run on the model
DEC = models.DecoderConfig(
    family="llama",
    vocab_size=V,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rms_norm_eps=1e-5,
    rope=models.RopeConfig(
        rope_type="llama3",
        theta=5e5,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A Llama checkpoint directory (random weights, written in the Hugging Face layout)."""
    path = tmp_path_factory.mktemp("llama") / "model"
    params = models.init_params(DEC, seed=7, dtype="float32", init_std=0.3)
    models.save_pretrained(path, DEC, params, extra_config={"eos_token_id": 2})
    return path


def seqs(seed=0, lengths=(11, 20, 6)):
    rng = np.random.default_rng(seed)
    return [Seq(rng.integers(0, V, n), {"weights": rng.normal(size=n - 1)}) for n in lengths]


def padded(data):
    width = max(len(s.tokens) for s in data)
    tokens = np.zeros((len(data), width), np.int32)
    weights = np.zeros((len(data), width - 1))
    for i, s in enumerate(data):
        tokens[i, : len(s.tokens)] = s.tokens
        weights[i, : len(s.tokens) - 1] = s.inputs["weights"]
    return tokens, np.array([len(s.tokens) for s in data]), weights


MAX_LEN = 32  # every trainer here has this shape, so they share their compiled functions


def trainer(ckpt_dir, **kw) -> LocalTrainer:
    return LocalTrainer.from_pretrained(ckpt_dir, max_seq_len=MAX_LEN, **kw)


def test_from_pretrained_forward_and_gradient_equal_the_direct_computation(ckpt_dir):
    t = trainer(ckpt_dir)
    assert t.config.vocab_size == V and t.config.decoder == DEC and t.config.chunk == 256
    assert t.config.pretrained == str(ckpt_dir)
    data = seqs()
    tokens, lengths, w = padded(data)
    _, params, _ = models.load_pretrained(ckpt_dir)

    @jax.jit
    def direct(p):
        lp = models.token_logprobs(DEC, p, tokens, lengths, chunk=0)
        return lp, -(lp * w).sum()  # the cross_entropy kernel: -Σ w·logprob

    lp_direct, _ = direct(params)
    for i, lp in enumerate(t.forward([s.with_inputs() for s in data])):
        assert lp.dtype == np.float32
        np.testing.assert_allclose(lp, np.asarray(lp_direct)[i, : lengths[i] - 1], atol=2e-6)
    t.forward_backward(data, "cross_entropy")
    want = jax.jit(jax.grad(lambda p: direct(p)[1]))(params)
    got = t.accumulated_grads()
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        scale = float(np.max(np.abs(np.asarray(a))))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5 * scale)
    step = t.optim_step(AdamParams(learning_rate=1e-2))
    assert step["grad_norm"] > 0 and t.step == 1


def test_sampling_logprobs_equal_the_forward(ckpt_dir):
    t = trainer(ckpt_dir)
    prompts = [[1, 5, 9], [3]]
    out = t.sample(prompts, num_samples=2, max_tokens=12, seed=4, temperature=1.0)
    for prompt, samples in zip(prompts, out, strict=True):
        for s in samples:
            full = np.concatenate([prompt, s.tokens])
            lp = t.forward([Seq(full, {})])[0][len(prompt) - 1 :]
            np.testing.assert_allclose(s.logprobs, lp, atol=2e-5)
    again = t.sample(prompts, num_samples=2, max_tokens=12, seed=4, temperature=1.0)
    assert [[list(a.tokens) for a in r] for r in out] == [
        [list(a.tokens) for a in r] for r in again
    ]
    greedy = t.sample([[1, 5, 9]], num_samples=1, max_tokens=4, temperature=0.0)[0][0]
    full = np.concatenate([[1, 5, 9], greedy.tokens[:-1]])
    from runner.local.models import logits

    z = np.asarray(logits(DEC, jax.device_get(t.params), full[None]))[0]
    assert list(np.argmax(z[2:], -1)) == list(greedy.tokens)


def test_a_vocabulary_padded_past_the_tokenizer_is_never_sampled(ckpt_dir, tmp_path):
    """Issue #23 item 5: a checkpoint whose embedding has more rows than its own tokenizer has
    ids (Qwen3's padding) sampled ids the tokenizer could not decode, mid-run. The config of
    such a pair limits sampling to the tokenizer's ids; the logprobs are the forward's,
    renormalised over those ids."""
    allowed = V - 20
    m = model_config(tmp_path, f'model.path="{ckpt_dir}"')
    cfg = local_trainer_config(m, vocab_size=allowed, seed=0, checkpoint_dir=None)
    assert cfg.sample_vocab_size == allowed
    assert (
        local_trainer_config(m, vocab_size=V, seed=0, checkpoint_dir=None).sample_vocab_size is None
    )
    prompts = [[1, 5, 9], [3]]
    kwargs = dict(num_samples=8, max_tokens=12, seed=4, temperature=3.0)
    free = LocalTrainer(dataclasses.replace(cfg, sample_vocab_size=None)).sample(prompts, **kwargs)
    assert max(max(s.tokens) for r in free for s in r) >= allowed  # the attack reproduces
    t = LocalTrainer(cfg)
    for temperature in (3.0, 0.0):
        out = t.sample(prompts, **{**kwargs, "temperature": temperature})
        assert max(max(s.tokens) for r in out for s in r) < allowed
    for prompt, samples in zip(
        prompts, t.sample(prompts, **{**kwargs, "temperature": 1.0}), strict=True
    ):
        for s in samples:
            full = np.concatenate([prompt, s.tokens])
            z = np.asarray(models.logits(DEC, jax.device_get(t.params), full[None, :-1]))[
                0, len(prompt) - 1 :, :allowed
            ].astype(np.float64)
            want = (
                np.take_along_axis(z, np.asarray(s.tokens)[:, None], -1)[:, 0]
                - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1))
                - z.max(-1)
            )
            np.testing.assert_allclose(s.logprobs, want, atol=2e-5)
    with pytest.raises(ValueError, match=r"sample_vocab_size must be None or an int in \[2"):
        dataclasses.replace(cfg, sample_vocab_size=V + 1)


def test_resumable_state_round_trips_and_checks_the_model(ckpt_dir, tmp_path):
    t = trainer(ckpt_dir, checkpoint_dir=str(tmp_path))
    t.forward_backward(seqs(), "cross_entropy")
    t.optim_step(AdamParams(learning_rate=1e-2))
    ref = t.save_state("s")
    u = LocalTrainer(LocalTrainerConfig.from_pretrained(ckpt_dir, max_seq_len=MAX_LEN))
    u.load_state(ref)
    assert u.step == 1
    for a, b in zip(jax.tree.leaves(t.params), jax.tree.leaves(u.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(t._opt_state), jax.tree.leaves(u._opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = LocalTrainer(LocalTrainerConfig(decoder=DEC, max_seq_len=MAX_LEN, dtype="bfloat16"))
    with pytest.raises(ValueError, match="checkpoint model config differs.*dtype"):
        other.load_state(ref)


def test_promotable_weights_are_a_transformers_directory_with_digests(ckpt_dir, tmp_path):
    t = trainer(ckpt_dir, checkpoint_dir=str(tmp_path / "c"))
    t.forward_backward(seqs(), "cross_entropy")
    t.optim_step(AdamParams(learning_rate=1e-2))
    ref = Path(t.save_weights_for_sampler("w"))
    assert ref == tmp_path / "c" / "sampler" / "w" / "model.safetensors"
    saved = json.loads((ref.parent / "config.json").read_text())
    assert saved["eos_token_id"] == 2 and saved["rope_parameters"]["rope_type"] == "llama3"
    copy = tmp_path / "reference.safetensors"  # the main job's KL reference is a copy of the file
    copy.write_bytes(ref.read_bytes())
    want = t.forward([s.with_inputs() for s in seqs(1)])
    for source in ("w", str(ref), str(ref.parent), str(copy)):
        u = trainer(ckpt_dir, checkpoint_dir=str(tmp_path / "c"))
        u.load_weights(source)
        for a, b in zip(u.forward([s.with_inputs() for s in seqs(1)]), want, strict=True):
            np.testing.assert_array_equal(a, b)
    data = bytearray(copy.read_bytes())
    data[-2] ^= 0x01
    copy.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corrupted or were modified"):
        u.load_weights(str(copy))
    small = models.DecoderConfig(
        family="llama", vocab_size=V, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2
    )
    with pytest.raises(ValueError, match="checkpoint model differs"):
        LocalTrainer(LocalTrainerConfig(decoder=small)).load_weights(str(ref))
    with pytest.raises(FileNotFoundError, match="no sampler weights"):
        u.load_weights("nothing-here")


def test_trainer_config_checks(ckpt_dir, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=99 differs from the decoder's vocab_size=53"):
        LocalTrainerConfig(decoder=DEC, vocab_size=99)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LocalTrainerConfig(decoder=DEC, dtype="float16")
    with pytest.raises(ValueError, match="logprob_chunk applies to the decoders only"):
        LocalTrainerConfig(logprob_chunk=64)
    with pytest.raises(ValueError, match="pretrained needs a decoder"):
        LocalTrainerConfig(pretrained=str(ckpt_dir))
    with pytest.raises(ValueError, match=r"weights=\.\.\.\) applies to decoders"):
        LocalTrainer(LocalTrainerConfig(vocab_size=8, d_model=8, n_heads=1, d_ff=8), weights={})
    with pytest.raises(
        ValueError, match=r"weights=\.\.\.\)\.layers: missing keys \['k_norm', 'q_norm'\]"
    ):
        bad = models.init_params(DEC, seed=0, dtype="float32")
        LocalTrainer(
            LocalTrainerConfig(decoder=models.DecoderConfig(**{**DEC.__dict__, "family": "qwen3"})),
            weights=bad,
        )
    dynamic = models.DecoderConfig(
        **{**DEC.__dict__, "rope": models.RopeConfig(rope_type="dynamic", factor=2.0)}
    )
    with pytest.raises(ValueError, match="exceeds the decoder's max_position_embeddings=128"):
        LocalTrainerConfig(decoder=dynamic, max_seq_len=256)
    wrong = LocalTrainerConfig(decoder=dynamic, pretrained=str(ckpt_dir), max_seq_len=64)
    with pytest.raises(ValueError, match="architecture differs from LocalTrainerConfig.decoder"):
        LocalTrainer(wrong)


def model_config(tmp_path, *sets):
    return load_config(ROOT / "examples" / "tiny.toml", list(sets)).model


def test_model_section_builds_every_family(ckpt_dir, tmp_path):
    m = model_config(tmp_path)
    gpt2 = local_trainer_config(m, vocab_size=V, seed=1, checkpoint_dir=None)
    assert gpt2 == LocalTrainerConfig(
        vocab_size=V, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64, seed=1
    )
    m = model_config(tmp_path, 'model.arch="qwen3"', "model.n_kv_heads=1", "model.head_dim=8")
    q = local_trainer_config(m, vocab_size=V, seed=1, checkpoint_dir=None)
    assert (q.decoder.family, q.decoder.num_kv_heads, q.decoder.head_dim) == ("qwen3", 1, 8)
    assert q.decoder.hidden_size == 32 and q.decoder.intermediate_size == 64 and q.chunk == 256
    m = model_config(
        tmp_path,
        f'model.path="{ckpt_dir}"',
        "model.lora_rank=4",
        'model.lora_targets="q_proj,v_proj"',
    )
    p = local_trainer_config(m, vocab_size=V, seed=1, checkpoint_dir=None)
    assert p.decoder == DEC and p.pretrained == str(ckpt_dir)
    assert p.lora == models.LoraConfig(rank=4, targets=("q_proj", "v_proj"), seed=1)


@pytest.mark.parametrize(
    "sets, message",
    [
        (['model.arch="gpt3"'], r"\[model\].arch must be one of"),
        (["model.lora_rank=4"], r"\[model\].lora_rank applies to the decoders"),
        (['model.dtype="bfloat16"'], r"\[model\].dtype applies to the decoders"),
        (['model.path="/nonexistent"'], r"\[model\].path: '/nonexistent' is not a directory"),
        (['model.arch="llama"', 'model.dtype="float16"'], r"\[model\].dtype must be one of"),
        (['model.arch="llama"', "model.n_kv_heads=3"], "num_heads=2 must be a multiple"),
        (['model.arch="llama"', "model.lora_rank=2", 'model.lora_targets="wq"'], "unknown module"),
        (["model.logprob_chunk=-1"], r"\[model\].logprob_chunk must be a finite number >= 0"),
    ],
)
def test_model_section_errors_name_the_key(tmp_path, sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(ROOT / "examples" / "tiny.toml", sets)


def test_model_path_errors(ckpt_dir, tmp_path):
    with pytest.raises(ValueError, match="arch = 'qwen2' but .*config.json is a 'llama' model"):
        load_config(
            ROOT / "examples" / "tiny.toml", [f'model.path="{ckpt_dir}"', 'model.arch="qwen2"']
        )
    m = model_config(tmp_path, f'model.path="{ckpt_dir}"')
    with pytest.raises(ValueError, match="vocab_size 53 is smaller than the tokenizer's 100"):
        local_trainer_config(m, vocab_size=100, seed=0, checkpoint_dir=None)


def test_main_job_trains_a_checkpoint_directory_with_lora_and_a_kl_reference(ckpt_dir, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "runner",
        "train",
        "--config",
        str(ROOT / "examples" / "tiny.toml"),
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        "--set",
        f'model.path="{ckpt_dir}"',
        "--set",
        "model.lora_rank=2",
        "--set",
        "rl.kl_coef=0.05",
        "--set",
        "checkpoint.save_promotable=true",
        "--sft-steps",
        "1",
        "--rl-steps",
        "2",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jc"))
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "tiny"
    adapters = sorted((run / "trainer" / "sampler").glob("*/adapter_model.safetensors"))
    assert len(adapters) >= 2  # the KL reference and the promotable checkpoints
    assert (run / "reference.safetensors").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


def test_a_lora_rank_above_the_layer_width_is_refused(ckpt_dir):
    """Issue #23 item 2: ``lora_rank=10**6`` allocated until the process was OOM-killed."""
    from runner.local.models import LoraConfig
    from runner.serve._core import ServeError
    from runner.serve._engine import BaseModel, LoraRequest, resolve_lora

    width = min(DEC.hidden_size, DEC.intermediate_size)
    message = f"LoRA rank 1000000 exceeds the model's layer width {width}"
    with pytest.raises(ValueError, match=message):
        LocalTrainer.from_pretrained(ckpt_dir, lora_rank=10**6)
    with pytest.raises(ValueError, match=f"rank {width + 1} exceeds"):
        LocalTrainerConfig(decoder=DEC, lora=LoraConfig(rank=width + 1))
    assert LocalTrainerConfig(decoder=DEC, lora=LoraConfig(rank=width)).lora.rank == width
    base = BaseModel("b", LocalTrainerConfig(decoder=DEC))
    with pytest.raises(ServeError, match=r"create_model: lora rank 1000000 exceeds the base"):
        resolve_lora(base, LoraRequest(rank=10**6), seed=0)


def test_sampling_more_than_the_trainers_bound_is_refused(ckpt_dir):
    """Issue #23 item 2: the local trainer's own API has the bound the server has."""
    t = trainer(ckpt_dir)
    with pytest.raises(ValueError, match=r"1 prompts x num_samples=1000000 is 1000000 rows"):
        t.sample([[1, 2]], num_samples=10**6, max_tokens=2, temperature=1.0, seed=0)
