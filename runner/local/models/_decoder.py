"""Llama / Qwen2 / Qwen3 dense decoders in plain JAX (reference/hf-models.md §1).

Forward (``LlamaModel.forward``; Qwen2/Qwen3 are the same with their flags):

    h⁰ = E[ids]
    per layer:  h += o_proj(Attn(RoPE(qk_norm(q_proj(n))), RoPE(qk_norm(k_proj(n))), v_proj(n)))
                     with n = RMSNorm_in(h);
                h += down(silu(gate(m)) ⊙ up(m)) with m = RMSNorm_post(h)
    logits = RMSNorm_final(h) W_lmᵀ   (W_lm = E when tied)

- ``RMSNorm(x) = w · (x32 · rsqrt(mean(x32²) + ε)).astype(x.dtype)`` (statistics in float32,
  the weight multiplied in the input dtype; reference §0 #4).
- Attention: ``softmax(q kᵀ · d^-0.5 + causal)`` in float32, cast back before ``· v`` (§0 #5);
  grouped-query: query head ``h`` reads key/value head ``h // (n_h/n_kv)`` (a reshape of the
  query heads to ``[n_kv, n_h/n_kv]``, never a tile; §0 #3). Qwen3 normalizes q and k over
  ``head_dim`` before RoPE (§0 #7); Qwen2 has q/k/v biases.
- Optional LoRA on any projection: ``y = x Wᵀ + s · (x Aᵀ) Bᵀ`` (reference §5.1).

Parameters are a dict pytree with weights in the torch ``[out, in]`` orientation (so loading
and saving Hugging Face tensors never transposes) and the layers stacked on a leading ``L`` axis
and run under `jax.lax.scan` (compile time independent of depth; ``unroll=True`` unrolls the
loop instead — on XLA:CPU about 1.4× faster forward + backward, at a compile time that grows
with depth)::

    {"embed": [V, H], "norm": [H], "lm_head": [V, H] (untied only),
     "layers": {"input_layernorm": [L, H], "post_attention_layernorm": [L, H],
                "q_proj": [L, n_h·d, H], "k_proj"/"v_proj": [L, n_kv·d, H], "o_proj": [L, H, n_h·d],
                "gate_proj"/"up_proj": [L, I, H], "down_proj": [L, H, I],
                "q_norm"/"k_norm": [L, d] (qwen3), "<proj>_bias": [L, out] (when the family has it)}}

LoRA adapters: ``{"<proj>": {"lora_A": [L, r, in], "lora_B": [L, out, r]}}``.

All broadcasting is explicit (tests run with ``jax_numpy_rank_promotion='raise'``). Shape
suffixes: ``B`` rows, ``T`` query positions, ``S`` key positions, ``H`` hidden, ``N`` query heads,
``K`` key/value heads, ``R`` = N/K, ``D`` head dim, ``V`` vocabulary, ``L`` layers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runner.local.models import _logprobs, _rope
from runner.local.models._config import DecoderConfig

Params = dict[str, Any]

#: Projections LoRA can target, with their ``(in, out)`` sizes as functions of the config.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def proj_shape(cfg: DecoderConfig, name: str) -> tuple[int, int]:
    """``(out, in)`` of one projection's weight."""
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d  # type: ignore[operator]
    return {
        "q_proj": (q, H),
        "k_proj": (kv, H),
        "v_proj": (kv, H),
        "o_proj": (H, q),
        "gate_proj": (I, H),
        "up_proj": (I, H),
        "down_proj": (H, I),
    }[name]


def param_shapes(cfg: DecoderConfig) -> dict[str, Any]:
    """The nested parameter shapes (the module docstring's layout)."""
    L, H, V, d = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    layers: dict[str, tuple[int, ...]] = {
        "input_layernorm": (L, H),
        "post_attention_layernorm": (L, H),
    }
    for name in PROJECTIONS:
        layers[name] = (L, *proj_shape(cfg, name))
    if cfg.qkv_bias:
        for name in ("q_proj", "k_proj", "v_proj"):
            layers[f"{name}_bias"] = (L, proj_shape(cfg, name)[0])
    if cfg.o_bias:
        layers["o_proj_bias"] = (L, H)
    if cfg.mlp_bias:
        for name in ("gate_proj", "up_proj", "down_proj"):
            layers[f"{name}_bias"] = (L, proj_shape(cfg, name)[0])
    if cfg.qk_norm:
        layers["q_norm"] = (L, d)
        layers["k_norm"] = (L, d)
    shapes: dict[str, Any] = {"embed": (V, H), "layers": layers, "norm": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, H)
    return shapes


def init_params(cfg: DecoderConfig, *, seed: int, dtype: Any, init_std: float = 0.02) -> Params:
    """Random parameters as numpy arrays (``PreTrainedModel._init_weights``: linear and
    embedding weights ~ N(0, init_std), biases 0, norm weights 1), from
    ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)

    def make(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm") or name.endswith("layernorm"):
            return np.ones(shape, dt)
        if name.endswith("_bias"):
            return np.zeros(shape, dt)
        return (init_std * rng.standard_normal(shape, np.float32)).astype(dt)

    shapes = param_shapes(cfg)
    out: Params = {k: make(k, v) for k, v in shapes.items() if k != "layers"}
    out["layers"] = {k: make(k, v) for k, v in shapes["layers"].items()}
    return out


# -- building blocks ----------------------------------------------------------------------------


def _acc(dtype) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``w · (x · rsqrt(mean(x²) + ε))`` over the last axis, statistics in float32 (§1.2)."""
    x32 = x.astype(_acc(x.dtype))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w.reshape((1,) * (x.ndim - 1) + w.shape) * y.astype(x.dtype)


def _proj(x_BTI: jax.Array, layer: Params, lora: Params, name: str, scale: float) -> jax.Array:
    # As one [B·T, I] x [I, O] matrix product: XLA:CPU runs a 3-D einsum whose operand is an
    # elementwise fusion (SwiGLU's silu(gate)·up) with a slow loop instead of its GEMM, which
    # made the MLP's backward ~3x slower (benchmarks/hf_throughput.py).
    B, T, I = x_BTI.shape
    x = x_BTI.reshape(B * T, I)
    y = x @ layer[name].T
    bias = layer.get(f"{name}_bias")
    if bias is not None:
        y = y + bias[None, :]
    if name in lora:
        a = lora[name]["lora_A"].astype(x_BTI.dtype)
        b = lora[name]["lora_B"].astype(x_BTI.dtype)
        y = y + scale * ((x @ a.T) @ b.T)
    return y.reshape(B, T, y.shape[-1])


def _attend(
    q_BTND: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask_BTS: jax.Array
) -> jax.Array:
    """Grouped-query softmax attention with a boolean key mask; returns ``[B, T, N·D]``."""
    B, T, N, D = q_BTND.shape
    K = k_BSKD.shape[2]
    q = q_BTND.reshape(B, T, K, N // K, D)
    scores = jnp.einsum("btkrd,bskd->bkrts", q, k_BSKD) * (D**-0.5)
    acc = _acc(scores.dtype)
    scores = scores.astype(acc)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, jnp.finfo(acc).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BTND.dtype)
    out = jnp.einsum("bkrts,bskd->btkrd", probs, v_BSKD)
    return out.reshape(B, T, N * D)


def _qkv(cfg: DecoderConfig, layer: Params, lora: Params, x_BTH, cos, sin, scale: float):
    B, T, _ = x_BTH.shape
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    n = rms_norm(x_BTH, layer["input_layernorm"], eps)
    q = _proj(n, layer, lora, "q_proj", scale).reshape(B, T, cfg.num_heads, d)
    k = _proj(n, layer, lora, "k_proj", scale).reshape(B, T, cfg.num_kv_heads, d)
    v = _proj(n, layer, lora, "v_proj", scale).reshape(B, T, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], eps)
        k = rms_norm(k, layer["k_norm"], eps)
    return _rope.apply(q, cos, sin), _rope.apply(k, cos, sin), v


def _mlp(cfg: DecoderConfig, layer: Params, lora: Params, x_BTH, scale: float) -> jax.Array:
    m = rms_norm(x_BTH, layer["post_attention_layernorm"], cfg.rms_norm_eps)
    gate = jax.nn.silu(_proj(m, layer, lora, "gate_proj", scale))
    return _proj(gate * _proj(m, layer, lora, "up_proj", scale), layer, lora, "down_proj", scale)


def _rope_tables(cfg: DecoderConfig, positions_BT: jax.Array, dtype):
    inv, scaling = _rope.inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    return _rope.cos_sin(positions_BT, inv, scaling, dtype)


def unembedding(params: Params) -> jax.Array:
    """``W_lm [V, H]``: ``lm_head`` or, when tied, the token embedding."""
    return params["lm_head"] if "lm_head" in params else params["embed"]


def hidden_states(
    cfg: DecoderConfig,
    params: Params,
    tokens_BT: jax.Array,
    *,
    lora: Params | None = None,
    lora_scale: float = 1.0,
    with_kv: bool = False,
    unroll: bool = False,
):
    """Final hidden states (after the last RMSNorm) of a right-padded causal batch.

    Position ``t`` is at absolute position ``t``; right padding never affects earlier
    positions, so no padding mask is needed.

    Returns:
      ``h[B, T, H]``, and with ``with_kv`` also ``(keys, values)`` ``[L, B, T, K, D]`` (after
      RoPE; the sampler's prefill).
    """
    B, T = tokens_BT.shape
    x = params["embed"][tokens_BT]
    positions = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
    cos, sin = _rope_tables(cfg, positions, x.dtype)
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = jnp.broadcast_to(causal[None, :, :], (B, T, T))

    def block(x, layer_lora):
        layer, lr = layer_lora
        q, k, v = _qkv(cfg, layer, lr, x, cos, sin, lora_scale)
        x = x + _proj(_attend(q, k, v, mask), layer, lr, "o_proj", lora_scale)
        x = x + _mlp(cfg, layer, lr, x, lora_scale)
        return x, ((k, v) if with_kv else None)

    x, kv = jax.lax.scan(block, x, (params["layers"], lora or {}), unroll=_unroll(unroll))
    h = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return (h, *kv) if with_kv else h


def logits(cfg: DecoderConfig, params: Params, tokens_BT: jax.Array, **kw) -> jax.Array:
    """Next-token logits ``[B, T, V]`` (in ``promote_types(dtype, float32)``)."""
    h = hidden_states(cfg, params, tokens_BT, **kw)
    w = unembedding(params)
    return jnp.einsum("bth,vh->btv", h, w, preferred_element_type=_acc(w.dtype))


def token_logprobs(
    cfg: DecoderConfig,
    params: Params,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    *,
    chunk: int,
    lora: Params | None = None,
    lora_scale: float = 1.0,
    unroll: bool = False,
) -> jax.Array:
    """Target logprobs of right-padded full sequences; pure and differentiable.

    Args:
      cfg: the architecture.
      params: the weights.
      tokens_BT: int full sequences ``x[0..N_i-1]`` right-padded to ``T`` columns.
      lengths_B: int ``N_i`` (0 for padding rows).
      chunk: tokens per logprob chunk (`runner.local.models._logprobs`; 0 = materialized).
      lora: LoRA adapters, or ``None``.
      lora_scale: ``alpha / r`` (or ``alpha / √r``).
      unroll: unroll the layer loop (module docstring).

    Returns:
      float[B, T-1] (``promote_types(dtype, float32)``): ``log p(x[t+1] | x[:t+1])`` for
      ``t < N_i - 1``, exactly 0 on padding.
    """
    inputs, targets = tokens_BT[:, :-1], tokens_BT[:, 1:]
    B, T1 = targets.shape
    h = hidden_states(cfg, params, inputs, lora=lora, lora_scale=lora_scale, unroll=unroll)
    lp = _logprobs.token_logprobs(
        h.reshape(B * T1, h.shape[-1]), unembedding(params), targets.reshape(-1), chunk=chunk
    ).reshape(B, T1)
    valid = jnp.arange(T1)[None, :] < (lengths_B[:, None] - 1)
    return jnp.where(valid, lp, jnp.zeros((), lp.dtype))


def prefill(
    cfg: DecoderConfig,
    params: Params,
    prompts_RP: jax.Array,
    prompt_lens_R: jax.Array,
    *,
    lora: Params | None = None,
    lora_scale: float = 1.0,
    unroll: bool = False,
):
    """The sampler's prefill: ``(logits[R, V] at each prompt's last token, keys, values)``.

    Only the last position's logits are formed (never ``[R, P, V]``).
    """
    h, ks, vs = hidden_states(
        cfg, params, prompts_RP, lora=lora, lora_scale=lora_scale, with_kv=True, unroll=unroll
    )
    last = jnp.take_along_axis(h, (prompt_lens_R - 1)[:, None, None], axis=1)[:, 0, :]
    w = unembedding(params)
    return jnp.einsum("rh,vh->rv", last, w, preferred_element_type=_acc(w.dtype)), ks, vs


def decode_step(
    cfg: DecoderConfig,
    params: Params,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    lora: Params | None = None,
    lora_scale: float = 1.0,
    unroll: bool = False,
):
    """One cached decoding step: feeds ``tokens_B`` at ``positions_B`` (one per row).

    Writes the new keys/values (after RoPE) at each row's position, attends to cache entries
    ``≤`` it and returns ``(logits[B, V], k_cache, v_cache)``, caches ``[L, B, S, K, D]``.
    """
    S = k_cache.shape[2]
    x = params["embed"][tokens_B[:, None]]  # [B, 1, H]
    cos, sin = _rope_tables(cfg, positions_B[:, None], x.dtype)
    slot_BS = jnp.arange(S)[None, :] == positions_B[:, None]
    mask = (jnp.arange(S)[None, :] <= positions_B[:, None])[:, None, :]  # [B, 1, S]

    def block(x, layer_kv):
        layer, lr, kc, vc = layer_kv
        q, k, v = _qkv(cfg, layer, lr, x, cos, sin, lora_scale)  # [B, 1, ., D]
        write = slot_BS[:, :, None, None]
        kc = jnp.where(write, k, kc)
        vc = jnp.where(write, v, vc)
        x = x + _proj(_attend(q, kc, vc, mask), layer, lr, "o_proj", lora_scale)
        x = x + _mlp(cfg, layer, lr, x, lora_scale)
        return x, (kc, vc)

    x, (k_cache, v_cache) = jax.lax.scan(
        block, x, (params["layers"], lora or {}, k_cache, v_cache), unroll=_unroll(unroll)
    )
    h = rms_norm(x[:, 0, :], params["norm"], cfg.rms_norm_eps)
    w = unembedding(params)
    return jnp.einsum("bh,vh->bv", h, w, preferred_element_type=_acc(w.dtype)), k_cache, v_cache


def _unroll(unroll: bool) -> int | bool:
    return True if unroll else 1


def num_params(cfg: DecoderConfig) -> int:
    """Parameter count of the architecture (tied embeddings counted once)."""
    return int(sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=_is_shape)))


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)
