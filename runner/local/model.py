"""A small decoder-only transformer in plain JAX (params are a dict pytree).

Architecture (GPT-2 style, pre-LayerNorm): token embedding + learned absolute position embedding
→ ``n_layers`` blocks of ``x += Attn(LN(x)); x += MLP(LN(x))`` (causal multi-head attention
without biases, GELU MLP with biases) → final LayerNorm → unembedding (tied to the token
embedding when ``tie_embeddings``). Blocks are stored stacked (leading axis ``L``) and run under
`jax.lax.scan`, so compile time does not grow with depth.

All broadcasting is explicit (the tests run with ``jax_numpy_rank_promotion='raise'``).

Shape suffixes: ``B`` rows, ``T`` model-input positions, ``S`` key positions, ``D`` d_model,
``H`` heads, ``K`` head dim, ``F`` d_ff, ``V`` vocabulary, ``L`` layers.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]

_DTYPES = ("float32", "float64")
#: Decoders also run in bfloat16 (weights and activations; logprobs in float32).
_DECODER_DTYPES = ("float32", "float64", "bfloat16")
#: Tokens per logprob chunk of the decoders when ``logprob_chunk`` is ``None``.
DEFAULT_LOGPROB_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class LocalTrainerConfig:
    """Configuration of the embedded `LocalTrainer` model (frozen, hashable).

    The defaults fit a character-level vocabulary (64 tokens) and train a batch of 32 sequences
    of ~100 tokens in well under a second per step on 2 CPU cores.

    Attributes:
      vocab_size: number of token ids ``[0, vocab_size)``.
      d_model: residual width; must be divisible by ``n_heads``.
      n_layers: transformer blocks.
      n_heads: attention heads.
      d_ff: MLP hidden width.
      max_seq_len: longest model input (``len(tokens) - 1``) and size of the position table.
      seed: parameter-initialization seed.
      dtype: ``"float32"`` (default) or ``"float64"`` (needs ``jax_enable_x64``) for params and
        activations.
      checkpoint_dir: root directory of ``save_state``/``save_weights_for_sampler``; ``None``
        makes those calls raise.
      tie_embeddings: use the token embedding as the unembedding.
      init_std: standard deviation of the normal weight initialization.
      decoder: a Llama / Qwen2 / Qwen3 architecture (`runner.local.models.DecoderConfig`)
        instead of the GPT-2-style default; ``vocab_size`` is then taken from it and
        ``d_model``/``n_layers``/``n_heads``/``d_ff``/``tie_embeddings`` are unused.
        `LocalTrainer.from_pretrained` fills it from a Hugging Face checkpoint.
      lora: train LoRA adapters (`runner.local.models.LoraConfig`) with the decoder's weights
        frozen (decoders only).
      logprob_chunk: tokens per chunk of the memory-bounded logprobs (decoders only; 0 =
        materialized ``[B, T, V]`` logits; ``None`` = `DEFAULT_LOGPROB_CHUNK`).
      pretrained: a Hugging Face checkpoint directory whose weights initialize the decoder
        (its ``config.json`` must describe ``decoder``; `from_pretrained` sets both), so that
        ``LocalTrainer(config)`` rebuilds the same model from the config alone.
      unroll_layers: unroll the decoder's layer loop instead of scanning it (decoders only; on
        CPU about as fast forward + backward as the scan, compile time grows with depth).
      sample_vocab_size: `LocalTrainer.sample` draws ids in ``[0, sample_vocab_size)`` only
        (``None``: every id). A checkpoint whose embedding is padded past its tokenizer's ids
        (Qwen3: 151936 rows, 151669 ids) sets it to the tokenizer's size, so that no sampled id
        is one the tokenizer cannot decode; sampling logprobs are then normalised over the
        allowed ids (``forward`` still scores every id, so a token's sampling and trainer
        logprobs differ by the probability mass of the padded ids, ``-log(1 - p_pad)``).
    """

    vocab_size: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    max_seq_len: int = 256
    seed: int = 0
    dtype: str = "float32"
    checkpoint_dir: str | None = None
    tie_embeddings: bool = False
    init_std: float = 0.02
    decoder: Any = None
    lora: Any = None
    logprob_chunk: int | None = None
    pretrained: str | None = None
    unroll_layers: bool = False
    sample_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.decoder is not None:
            self._check_decoder()
        else:
            self._check_gpt2()
        s = self.sample_vocab_size
        if s is not None and (
            isinstance(s, bool) or not isinstance(s, int) or not 2 <= s <= self.vocab_size
        ):
            raise ValueError(
                f"LocalTrainerConfig.sample_vocab_size must be None or an int in [2, vocab_size="
                f"{self.vocab_size}], got {s!r}"
            )

    def _check_gpt2(self) -> None:
        if self.lora is not None:
            raise ValueError(
                "LocalTrainerConfig.lora needs a decoder (Llama / Qwen): the GPT-2-style default "
                "model has no LoRA"
            )
        if self.pretrained is not None:
            raise ValueError(
                "LocalTrainerConfig.pretrained needs a decoder (use "
                "LocalTrainerConfig.from_pretrained(path))"
            )
        if self.unroll_layers:
            raise ValueError("LocalTrainerConfig.unroll_layers applies to the decoders only")
        if self.logprob_chunk not in (None, 0):
            raise ValueError(
                "LocalTrainerConfig.logprob_chunk applies to the decoders only (the GPT-2-style "
                "default materializes its logits)"
            )
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LocalTrainerConfig.{name} must be a positive int, got {value!r}")
        if self.vocab_size < 2:
            raise ValueError(f"LocalTrainerConfig.vocab_size must be >= 2, got {self.vocab_size}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"LocalTrainerConfig.d_model={self.d_model} must be divisible by "
                f"n_heads={self.n_heads}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"LocalTrainerConfig.seed must be an int, got {self.seed!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"LocalTrainerConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}"
            )
        if not (isinstance(self.init_std, int | float) and self.init_std > 0):
            raise ValueError(f"LocalTrainerConfig.init_std must be > 0, got {self.init_std!r}")

    def _check_decoder(self) -> None:
        # The submodules, not the package (whose `_arch` imports this module).
        from runner.local.models._config import DecoderConfig
        from runner.local.models._lora import LoraConfig

        dec = self.decoder
        if not isinstance(dec, DecoderConfig):
            raise ValueError(
                f"LocalTrainerConfig.decoder must be a runner.local.models.DecoderConfig, got "
                f"{type(dec).__name__}"
            )
        if self.vocab_size not in (64, dec.vocab_size):
            raise ValueError(
                f"LocalTrainerConfig.vocab_size={self.vocab_size} differs from the decoder's "
                f"vocab_size={dec.vocab_size} (leave it unset)"
            )
        object.__setattr__(self, "vocab_size", dec.vocab_size)
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int):
            raise ValueError(
                f"LocalTrainerConfig.max_seq_len must be an int, got {self.max_seq_len!r}"
            )
        if self.max_seq_len < 1:
            raise ValueError(f"LocalTrainerConfig.max_seq_len must be >= 1, got {self.max_seq_len}")
        if dec.rope.rope_type == "dynamic" and self.max_seq_len > dec.max_position_embeddings:
            raise ValueError(
                f"LocalTrainerConfig.max_seq_len={self.max_seq_len} exceeds the decoder's "
                f"max_position_embeddings={dec.max_position_embeddings}: dynamic RoPE would "
                "rescale (not implemented)"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"LocalTrainerConfig.seed must be an int, got {self.seed!r}")
        if self.dtype not in _DECODER_DTYPES:
            raise ValueError(
                f"LocalTrainerConfig.dtype must be one of {_DECODER_DTYPES} for a decoder, got "
                f"{self.dtype!r}"
            )
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(
                f"LocalTrainerConfig.lora must be a runner.local.models.LoraConfig, got "
                f"{type(self.lora).__name__}"
            )
        width = min(dec.hidden_size, dec.intermediate_size)
        if self.lora is not None and self.lora.rank > width:
            # a rank above the narrowest adapted layer adds no capacity, only memory
            raise ValueError(
                f"LoRA rank {self.lora.rank} exceeds the model's layer width {width} "
                "(min(hidden_size, intermediate_size)): use a rank <= it"
            )
        if not isinstance(self.unroll_layers, bool):
            raise ValueError(
                f"LocalTrainerConfig.unroll_layers must be a bool, got {self.unroll_layers!r}"
            )
        if self.pretrained is not None and not isinstance(self.pretrained, str | Path):
            raise ValueError(
                f"LocalTrainerConfig.pretrained must be a path, got {self.pretrained!r}"
            )
        if self.pretrained is not None:
            object.__setattr__(self, "pretrained", str(self.pretrained))
        chunk = self.logprob_chunk
        if chunk is not None and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0
        ):
            raise ValueError(f"LocalTrainerConfig.logprob_chunk must be an int >= 0, got {chunk!r}")
        if not (isinstance(self.init_std, int | float) and self.init_std > 0):
            raise ValueError(f"LocalTrainerConfig.init_std must be > 0, got {self.init_std!r}")

    @classmethod
    def from_pretrained(cls, path: str | Path, **fields: Any) -> LocalTrainerConfig:
        """The config of a Hugging Face checkpoint directory (reads ``config.json`` only; the
        trainer built from it loads the weights).

        Args:
          path: the checkpoint directory.
          **fields: other fields (``lora``, ``dtype``, ``max_seq_len`` — default
            ``min(max_position_embeddings, 4096)`` —, ``checkpoint_dir``, ...).

        Raises:
          FileNotFoundError, ValueError: naming the file and key (`runner.local.models`).
        """
        from runner.local.models._hf_io import read_config

        decoder, _ = read_config(path)
        fields.setdefault("max_seq_len", min(decoder.max_position_embeddings, 4096))
        return cls(decoder=decoder, pretrained=str(path), **fields)

    @property
    def chunk(self) -> int:
        """Tokens per logprob chunk in effect (0 = materialized)."""
        if self.decoder is None:
            return 0
        return DEFAULT_LOGPROB_CHUNK if self.logprob_chunk is None else self.logprob_chunk

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def jnp_dtype(self) -> Any:
        return jnp.dtype(self.dtype)


def init_params(cfg: LocalTrainerConfig) -> dict[str, Any]:
    """Random initial parameters as numpy arrays of ``cfg.dtype``.

    Weights are normal with ``init_std`` (residual output projections scaled by 1/√(2L)), drawn
    with ``numpy.random.default_rng(cfg.seed)`` (no XLA compilation; identical on every
    platform); LayerNorm scales are 1 and biases 0.

    Returns:
      ``{"embed": [V, D], "pos": [max_seq_len, D], "blocks": {ln1_scale, ln1_bias: [L, D],
      wqkv: [L, D, 3D], wo: [L, D, D], ln2_scale, ln2_bias: [L, D], w1: [L, D, F], b1: [L, F],
      w2: [L, F, D], b2: [L, D]}, "lnf_scale", "lnf_bias": [D], "unembed": [D, V]}`` (no
      ``unembed`` when tied).
    """
    dt = np.dtype(cfg.dtype)
    L, D, F, V = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size
    rng = np.random.default_rng(cfg.seed)
    std = cfg.init_std
    res_std = std / math.sqrt(2 * L)

    def normal(shape, scale):
        return (scale * rng.standard_normal(shape)).astype(dt)

    params: dict[str, Any] = {
        "embed": normal((V, D), std),
        "pos": normal((cfg.max_seq_len, D), std),
        "blocks": {
            "ln1_scale": np.ones((L, D), dt),
            "ln1_bias": np.zeros((L, D), dt),
            "wqkv": normal((L, D, 3 * D), std),
            "wo": normal((L, D, D), res_std),
            "ln2_scale": np.ones((L, D), dt),
            "ln2_bias": np.zeros((L, D), dt),
            "w1": normal((L, D, F), std),
            "b1": np.zeros((L, F), dt),
            "w2": normal((L, F, D), res_std),
            "b2": np.zeros((L, D), dt),
        },
        "lnf_scale": np.ones((D,), dt),
        "lnf_bias": np.zeros((D,), dt),
    }
    if not cfg.tie_embeddings:
        params["unembed"] = normal((D, V), std)
    return params


def param_shapes(cfg: LocalTrainerConfig) -> dict[str, tuple[int, ...]]:
    """Flattened parameter names (``blocks.wqkv``, ...) and their shapes."""
    return {name: tuple(x.shape) for name, x in flatten(init_params(cfg)).items()}


def flatten(params: Params) -> dict[str, Any]:
    """``{"blocks.wqkv": array, ...}``: the nested dict flattened with ``.``-joined keys."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            for sub, leaf in flatten(value).items():
                out[f"{key}.{sub}"] = leaf
        else:
            out[key] = value
    return out


def unflatten(flat: dict[str, Any]) -> Params:
    """Inverse of `flatten`."""
    out: Params = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


# -- building blocks ----------------------------------------------------------------------------


def _layer_norm(x_BTD: jax.Array, scale_D: jax.Array, bias_D: jax.Array) -> jax.Array:
    mean = jnp.mean(x_BTD, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x_BTD - mean), axis=-1, keepdims=True)
    y = (x_BTD - mean) * jax.lax.rsqrt(var + 1e-5)
    return y * scale_D[None, None, :] + bias_D[None, None, :]


def _mlp(p: Params, x_BTD: jax.Array) -> jax.Array:
    h = _layer_norm(x_BTD, p["ln2_scale"], p["ln2_bias"])
    h = jax.nn.gelu(h @ p["w1"] + p["b1"][None, None, :])
    return h @ p["w2"] + p["b2"][None, None, :]


def _qkv(p: Params, x_BTD: jax.Array, n_heads: int):
    B, T, D = x_BTD.shape
    h = _layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"])
    qkv = (h @ p["wqkv"]).reshape(B, T, 3, n_heads, D // n_heads)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, T, H, K]


def _attend(q_BTHK, k_BSHK, v_BSHK, mask_BTS) -> jax.Array:
    """Softmax attention with a boolean key mask (True = attend); returns [B, T, H*K]."""
    B, T, H, K = q_BTHK.shape
    scores = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK) / jnp.sqrt(jnp.asarray(K, q_BTHK.dtype))
    neg = jnp.asarray(jnp.finfo(scores.dtype).min, scores.dtype)
    scores = jnp.where(mask_BTS[:, None, :, :], scores, neg)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bshk->bthk", probs, v_BSHK)
    return out.reshape(B, T, H * K)


def _embed(params: Params, tokens_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    return params["embed"][tokens_BT] + params["pos"][positions_BT]


def _unembed(params: Params, x_BTD: jax.Array) -> jax.Array:
    x = _layer_norm(x_BTD, params["lnf_scale"], params["lnf_bias"])
    w = params["unembed"] if "unembed" in params else params["embed"].T
    return x @ w  # [B, T, V]


def logits_and_kv(params: Params, tokens_BT: jax.Array, *, n_heads: int):
    """Causal forward over a right-padded batch.

    Args:
      params: model parameters.
      tokens_BT: int model-input tokens; position ``t`` is at absolute position ``t``.
      n_heads: attention heads.

    Returns:
      ``(logits[B, T, V], keys[L, B, T, H, K], values[L, B, T, H, K])``. Right padding never
      affects earlier positions (causal attention), so no padding mask is needed.
    """
    B, T = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
    x = _embed(params, tokens_BT, positions)
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = jnp.broadcast_to(causal[None, :, :], (B, T, T))

    def block(x, p):
        q, k, v = _qkv(p, x, n_heads)
        x = x + _attend(q, k, v, mask) @ p["wo"]
        x = x + _mlp(p, x)
        return x, (k, v)

    x, (ks, vs) = jax.lax.scan(block, x, params["blocks"])
    return _unembed(params, x), ks, vs


def logits(params: Params, tokens_BT: jax.Array, *, n_heads: int) -> jax.Array:
    """Next-token logits ``[B, T, V]`` for model-input tokens ``[B, T]``."""
    return logits_and_kv(params, tokens_BT, n_heads=n_heads)[0]


def token_logprobs(
    params: Params, tokens_BT: jax.Array, lengths_B: jax.Array, *, n_heads: int
) -> jax.Array:
    """Target logprobs of right-padded full sequences; pure and differentiable in ``params``.

    Args:
      params: model parameters.
      tokens_BT: int full sequences ``x[0..N_i-1]`` right-padded to ``T`` columns (any pad id).
      lengths_B: int ``N_i``, the number of real tokens of each row (0 for padding rows).
      n_heads: attention heads.

    Returns:
      float[B, T-1]: entry ``[i, t]`` is ``log p(x[t+1] | x[:t+1])`` for ``t < N_i - 1``, and
      exactly 0 on padding.
    """
    inputs, targets = tokens_BT[:, :-1], tokens_BT[:, 1:]
    logp = jax.nn.log_softmax(logits(params, inputs, n_heads=n_heads), axis=-1)
    lp = jnp.take_along_axis(logp, targets[:, :, None], axis=-1)[:, :, 0]
    T1 = targets.shape[1]
    valid = jnp.arange(T1)[None, :] < (lengths_B[:, None] - 1)
    return jnp.where(valid, lp, jnp.zeros((), lp.dtype))


def decode_step(
    params: Params,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    n_heads: int,
):
    """One cached decoding step: feeds ``tokens_B`` at ``positions_B`` (one per row).

    Writes the new keys/values at each row's position, attends to cache entries ``≤`` it, and
    returns ``(logits[B, V], k_cache, v_cache)`` with caches ``[L, B, S, H, K]``.
    """
    S = k_cache.shape[2]
    # Positions past the table only occur on a row's final (discarded) step; clamp them.
    emb_pos = jnp.minimum(positions_B, params["pos"].shape[0] - 1)
    x = _embed(params, tokens_B[:, None], emb_pos[:, None])  # [B, 1, D]
    slot_BS = jnp.arange(S)[None, :] == positions_B[:, None]
    mask = (jnp.arange(S)[None, :] <= positions_B[:, None])[:, None, :]  # [B, 1, S]

    def block(x, layer):
        p, kc, vc = layer
        q, k, v = _qkv(p, x, n_heads)  # [B, 1, H, K]
        write = slot_BS[:, :, None, None]
        kc = jnp.where(write, k, kc)
        vc = jnp.where(write, v, vc)
        x = x + _attend(q, kc, vc, mask) @ p["wo"]
        x = x + _mlp(p, x)
        return x, (kc, vc)

    x, (k_cache, v_cache) = jax.lax.scan(block, x, (params["blocks"], k_cache, v_cache))
    return _unembed(params, x)[:, 0, :], k_cache, v_cache


def num_params(params: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
