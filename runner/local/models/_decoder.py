"""Llama / Qwen2 / Qwen3 dense decoders in plain JAX (docs/hf-models.md#architecture).

Forward (``LlamaModel.forward``; Qwen2/Qwen3 are the same with their flags):

    h⁰ = E[ids]
    per layer:  h += o_proj(Attn(RoPE(qk_norm(q_proj(n))), RoPE(qk_norm(k_proj(n))), v_proj(n)))
                     with n = RMSNorm_in(h);
                h += down(silu(gate(m)) ⊙ up(m)) with m = RMSNorm_post(h)
    logits = RMSNorm_final(h) W_lmᵀ   (W_lm = E when tied)

- ``RMSNorm(x) = w · (x32 · rsqrt(mean(x32²) + ε)).astype(x.dtype)`` (statistics in float32,
  the weight multiplied in the input dtype; docs/hf-models.md#parity).
- Attention: ``softmax(q kᵀ · d^-0.5 + causal)`` in float32, cast back before ``· v`` (§0 #5);
  grouped-query: query head ``h`` reads key/value head ``h // (n_h/n_kv)`` (a reshape of the
  query heads to ``[n_kv, n_h/n_kv]``, never a tile; §0 #3). Qwen3 normalizes q and k over
  ``head_dim`` before RoPE (§0 #7); Qwen2 has q/k/v biases.
- Optional LoRA on any projection: ``y = x Wᵀ + s · (x Aᵀ) Bᵀ`` (docs/hf-models.md#lora-and-peft-files).

Parameters are a dict pytree with weights in the torch ``[out, in]`` orientation (so loading
and saving Hugging Face tensors never transposes) and the layers stacked on a leading ``L`` axis
and run under `jax.lax.scan` (compile time independent of depth; ``unroll=True`` runs a Python
loop over the layers instead — no stacked residual buffers, at a compile time that grows with
depth; on XLA:CPU about as fast as the scan, benchmarks/hf_throughput.py)::

    {"embed": [V, H], "norm": [H], "lm_head": [V, H] (untied only),
     "layers": {"input_layernorm": [L, H], "post_attention_layernorm": [L, H],
                "q_proj": [L, n_h·d, H], "k_proj"/"v_proj": [L, n_kv·d, H], "o_proj": [L, H, n_h·d],
                "gate_proj"/"up_proj": [L, I, H], "down_proj": [L, H, I],
                "q_norm"/"k_norm": [L, d] (qwen3), "<proj>_bias": [L, out] (when the family has it)}}

LoRA adapters: ``{"<proj>": {"lora_A": [L, r, in], "lora_B": [L, out, r]}}``.

Backward (training throughput on XLA:CPU, issue #15): the hot blocks are `jax.custom_vjp`s that
keep few residuals — `jax.vjp` hands every residual to the backward as an output buffer (and
`jax.lax.scan` stacks each into a zero-filled ``[L, ...]`` array), so their number is what
costs: `_norm_linear` (RMSNorm then its projections; keeps ``x`` and the row ``rsqrt``, not
the normalized input), `_swiglu` (keeps the gate and up pre-activations), `_attention` (keeps
q, k, v and the row log-sum-exps; the backward recomputes the probabilities, one more ``q kᵀ``).
Causal attention splits its queries into blocks that skip the fully masked keys (`_attend`).
LoRA'd projections and MLP biases take the plain autodiff path. The RoPE tables of the training
forward (positions ``0..T-1``) are trace-time constants, so XLA does not recompute cos/sin inside
every fusion that reads them. `linear_loss` (a loss linear in the logprobs) runs the fused head
`runner.local.models._logprobs.linear_loss`.

All broadcasting is explicit (tests run with ``jax_numpy_rank_promotion='raise'``). Shape
suffixes: ``B`` rows, ``T`` query positions, ``S`` key positions, ``H`` hidden, ``N`` query heads,
``K`` key/value heads, ``R`` = N/K, ``D`` head dim, ``V`` vocabulary, ``L`` layers.
"""

from __future__ import annotations

import functools
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


def _rms_stats(x_NH: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    x32 = x_NH.astype(_acc(x_NH.dtype))
    return x32, jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm_linear(eps: float, x_NH, wn_H, ws, bs):
    """``[n Wᵢᵀ + bᵢ]`` for ``n = rms_norm(x, wn)`` and weights ``ws[i] [Oᵢ, H]`` (``bs[i]`` a bias
    ``[Oᵢ]`` or ``None``); the same values as `rms_norm` then `_proj`.

    A `jax.custom_vjp` whose backward keeps ``x`` and the per-row ``rsqrt`` only (``n`` is
    recomputed elementwise), not ``n`` and the normalized ``x``.
    """
    return _norm_linear_fwd(eps, x_NH, wn_H, ws, bs)[0]


def _norm_linear_fwd(eps, x, wn, ws, bs):
    x32, r = _rms_stats(x, eps)
    y = (x32 * r).astype(x.dtype)
    n = wn[None, :] * y
    outs = tuple(
        n @ w.T if b is None else n @ w.T + b[None, :] for w, b in zip(ws, bs, strict=True)
    )
    return outs, (x, r, wn, ws, bs)


def _norm_linear_bwd(eps, res, douts):
    x, r, wn, ws, bs = res
    x32 = x.astype(r.dtype)
    y = (x32 * r).astype(x.dtype)
    n = wn[None, :] * y
    dn = douts[0] @ ws[0]
    for w, d in zip(ws[1:], douts[1:], strict=True):
        dn = dn + d @ w
    dws = tuple(d.T @ n for d in douts)
    dbs = tuple(None if b is None else jnp.sum(d, axis=0) for b, d in zip(bs, douts, strict=True))
    dwn = jnp.sum(dn * y, axis=0)
    g = (dn * wn[None, :]).astype(r.dtype)
    dx = r * g - x32 * (r * r * r) * jnp.mean(g * x32, axis=-1, keepdims=True)
    return dx.astype(x.dtype), dwn, dws, dbs


_norm_linear.defvjp(_norm_linear_fwd, _norm_linear_bwd)


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


#: Causal attention splits its queries into blocks of at least this many positions (at most
#: `_CAUSAL_MAX_BLOCKS`); block ``i`` attends to the keys of blocks ``≤ i`` only.
_CAUSAL_BLOCK_MIN = 64
_CAUSAL_MAX_BLOCKS = 4


def _causal_blocks(T: int) -> int:
    nb = min(_CAUSAL_MAX_BLOCKS, T // _CAUSAL_BLOCK_MIN)
    while nb > 1 and T % nb:
        nb -= 1
    return max(nb, 1)


def _attend(
    q_BTND: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    mask_BTS: jax.Array,
    *,
    causal: bool = False,
) -> jax.Array:
    """Grouped-query softmax attention with a boolean key mask; returns ``[B, T, N·D]``.

    A `jax.custom_vjp` (`_attention`): the backward keeps q, k, v and the per-row softmax
    statistics, recomputes the probabilities and runs the softmax backward as one fused
    elementwise pass. ``causal`` promises that ``mask`` is (at most) the causal mask with
    ``T = S``: the queries are then split into `_causal_blocks` blocks and block ``i`` attends to
    the keys of blocks ``≤ i`` only (the keys it skips are masked, exact zeros in the softmax, so
    the values are unchanged; about 5/8 of the score products for 4 blocks).
    """
    B, T, N, D = q_BTND.shape
    K = k_BSKD.shape[2]
    R = N // K
    # [B, K, T·R, D]: each key/value head's query rows as one matrix (a layout every product
    # below reads without a transpose).
    q = q_BTND.reshape(B, T, K, R, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * R, D)
    k = k_BSKD.transpose(0, 2, 1, 3)
    v = v_BSKD.transpose(0, 2, 1, 3)
    nb = _causal_blocks(T) if causal and T == k.shape[2] else 1
    if nb > 1:
        c = T // nb
        outs = []
        for i in range(nb):
            lo, hi = i * c, (i + 1) * c
            qi = q[:, :, lo * R : hi * R]
            outs.append(_attention(qi, k[:, :, :hi], v[:, :, :hi], mask_BTS[:, lo:hi, :hi]))
        out = jnp.concatenate(outs, axis=2)
    else:
        out = _attention(q, k, v, mask_BTS)  # [B, K, T·R, D]
    return out.reshape(B, K, T, R, D).transpose(0, 2, 1, 3, 4).reshape(B, T, N * D)


def _attn_scores(q_BKMD, k_BKSD, mask_BTS):
    """Masked float32 scores ``[B, K, T, R, S]``."""
    B, K, M, D = q_BKMD.shape
    T, S = mask_BTS.shape[1:]
    scores = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKSD) * (D**-0.5)
    acc = _acc(scores.dtype)
    scores = scores.astype(acc).reshape(B, K, T, M // T, S)
    return jnp.where(mask_BTS[:, None, :, None, :], scores, jnp.finfo(acc).min)


@jax.custom_vjp
def _attention(q_BKMD, k_BKSD, v_BKSD, mask_BTS):
    """``softmax(q kᵀ · D^-0.5 + mask) v`` per key/value head; ``M = T·R`` rows ``(t, r)``."""
    return _attention_fwd(q_BKMD, k_BKSD, v_BKSD, mask_BTS)[0]


def _softmax(scores, row_max, row_sum):
    return jnp.exp(scores - row_max) / row_sum


def _attention_fwd(q, k, v, mask):
    B, K, M, _ = q.shape
    scores = _attn_scores(q, k, mask)
    # jax.nn.softmax's arithmetic, with its row max and sum kept: the backward recomputes the
    # probabilities from q, k (one more q kᵀ product) instead of storing a [B, K, M, S] float32
    # residual.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_sum = jnp.sum(jnp.exp(scores - row_max), axis=-1, keepdims=True)
    probs = _softmax(scores, row_max, row_sum).reshape(B, K, M, -1)
    out = jnp.einsum("bkms,bksd->bkmd", probs.astype(q.dtype), v)
    return out, (q, k, v, mask, row_max, row_sum)


def _attention_bwd(res, dout):
    q, k, v, mask, row_max, row_sum = res
    B, K, M, D = q.shape
    T, S = mask.shape[1:]
    dt = q.dtype
    p32 = _softmax(_attn_scores(q, k, mask), row_max, row_sum).reshape(B, K, M, S)
    dv = jnp.einsum("bkms,bkmd->bksd", p32.astype(dt), dout)
    dp = jnp.einsum("bkmd,bksd->bkms", dout, v).astype(p32.dtype)
    ds = p32 * (dp - jnp.sum(dp * p32, axis=-1, keepdims=True))
    # Masked scores get no gradient (the forward's ``where``), even in a fully masked row.
    ds = jnp.where(mask[:, None, :, None, :], ds.reshape(B, K, T, M // T, S), 0.0)
    ds = (ds.reshape(B, K, M, S) * (D**-0.5)).astype(dt)
    dq = jnp.einsum("bkms,bksd->bkmd", ds, k)
    dk = jnp.einsum("bkms,bkmd->bksd", ds, q)
    dmask = np.zeros(mask.shape, jax.dtypes.float0)
    return dq, dk, dv, dmask


_attention.defvjp(_attention_fwd, _attention_bwd)


def _qkv(cfg: DecoderConfig, layer: Params, lora: Params, x_BTH, cos, sin, scale: float):
    B, T, _ = x_BTH.shape
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    names = ("q_proj", "k_proj", "v_proj")
    if any(name in lora for name in names):
        n = rms_norm(x_BTH, layer["input_layernorm"], eps)
        q, k, v = (_proj(n, layer, lora, name, scale) for name in names)
    else:
        ws = tuple(layer[name] for name in names)
        bs = tuple(layer.get(f"{name}_bias") for name in names)
        x = x_BTH.reshape(B * T, -1)
        q, k, v = _norm_linear(eps, x, layer["input_layernorm"], ws, bs)
    q = q.reshape(B, T, cfg.num_heads, d)
    k = k.reshape(B, T, cfg.num_kv_heads, d)
    v = v.reshape(B, T, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], eps)
        k = rms_norm(k, layer["k_norm"], eps)
    return _rope.apply(q, cos, sin), _rope.apply(k, cos, sin), v


def _mlp(cfg: DecoderConfig, layer: Params, lora: Params, x_BTH, scale: float) -> jax.Array:
    if not cfg.mlp_bias and not any(name in lora for name in ("gate_proj", "up_proj", "down_proj")):
        B, T, H = x_BTH.shape
        ws = (layer["gate_proj"], layer["up_proj"])
        gate, up = _norm_linear(
            cfg.rms_norm_eps,
            x_BTH.reshape(B * T, H),
            layer["post_attention_layernorm"],
            ws,
            (None, None),
        )
        return _swiglu(gate, up, layer["down_proj"]).reshape(B, T, H)
    m = rms_norm(x_BTH, layer["post_attention_layernorm"], cfg.rms_norm_eps)
    gate = jax.nn.silu(_proj(m, layer, lora, "gate_proj", scale))
    return _proj(gate * _proj(m, layer, lora, "up_proj", scale), layer, lora, "down_proj", scale)


@jax.custom_vjp
def _swiglu(g_NI, u_NI, wd_HI):
    """``(silu(g) ⊙ u) Wdᵀ``; the backward keeps ``g`` and ``u`` only (silu and the product are
    recomputed elementwise)."""
    return _swiglu_fwd(g_NI, u_NI, wd_HI)[0]


def _swiglu_fwd(g, u, wd):
    return (jax.nn.silu(g) * u) @ wd.T, (g, u, wd)


def _swiglu_bwd(res, dy):
    g, u, wd = res
    acc = _acc(g.dtype)
    g32 = g.astype(acc)
    sig = jax.nn.sigmoid(g32)
    silu = jax.nn.silu(g)
    da = dy @ wd
    dwd = dy.T @ (silu * u)
    du = da * silu
    dg = (da.astype(acc) * u.astype(acc) * (sig * (1 + g32 * (1 - sig)))).astype(g.dtype)
    return dg, du, dwd


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


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
    # Positions 0..T-1 are static: the RoPE tables are evaluated once at trace time (constants
    # [1, T, d], broadcast over the rows). Traced, XLA fuses cos/sin into every consumer (each
    # causal block's query/key slice, each backward product), recomputing them per element.
    with jax.ensure_compile_time_eval():
        cos, sin = _rope_tables(cfg, jnp.arange(T)[None, :], x.dtype)
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = jnp.broadcast_to(causal[None, :, :], (B, T, T))

    def block(x, layer_lora):
        layer, lr = layer_lora
        q, k, v = _qkv(cfg, layer, lr, x, cos, sin, lora_scale)
        x = x + _proj(_attend(q, k, v, mask, causal=True), layer, lr, "o_proj", lora_scale)
        x = x + _mlp(cfg, layer, lr, x, lora_scale)
        return x, ((k, v) if with_kv else None)

    stacked = (params["layers"], lora or {})
    if unroll:
        # A Python loop over the layers: no stacked [L, ...] residual buffers (each a zero-filled
        # allocation plus a copy per layer under `jax.lax.scan`). The per-layer weights come
        # from one `jax.lax.split` per stacked array, whose transpose is one concatenate.
        L = cfg.num_layers
        leaves, tree = jax.tree.flatten(stacked)
        parts = [jax.lax.split(a, (1,) * L) for a in leaves]
        outs = []
        for i in range(L):
            x, out = block(x, tree.unflatten([jnp.squeeze(p[i], 0) for p in parts]))
            outs.append(out)
        kv = tuple(jnp.stack(t) for t in zip(*outs, strict=True)) if with_kv else None
    else:
        x, kv = jax.lax.scan(block, x, stacked)
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
    h_NH, y_N, valid_BT = _head_inputs(cfg, params, tokens_BT, lengths_B, lora, lora_scale, unroll)
    lp = _logprobs.token_logprobs(h_NH, unembedding(params), y_N, chunk=chunk)
    lp = lp.reshape(valid_BT.shape)
    return jnp.where(valid_BT, lp, jnp.zeros((), lp.dtype))


def _head_inputs(cfg, params, tokens_BT, lengths_B, lora, lora_scale, unroll):
    """``(h[N, H], targets[N], valid[B, T-1])`` with ``N = B·(T-1)``: the head's inputs of
    right-padded full sequences (``valid``: target ``t < N_i - 1``)."""
    inputs, targets = tokens_BT[:, :-1], tokens_BT[:, 1:]
    B, T1 = targets.shape
    h = hidden_states(cfg, params, inputs, lora=lora, lora_scale=lora_scale, unroll=unroll)
    valid = jnp.arange(T1)[None, :] < (lengths_B[:, None] - 1)
    return h.reshape(B * T1, h.shape[-1]), targets.reshape(-1), valid


def linear_loss(
    cfg: DecoderConfig,
    params: Params,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    g_BT: jax.Array,
    *,
    chunk: int,
    lora: Params | None = None,
    lora_scale: float = 1.0,
    unroll: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(L, lp)``: `token_logprobs` and ``L = Σ g·lp`` for fixed weights ``g`` (a loss linear
    in the logprobs), through the fused head `runner.local.models._logprobs.linear_loss`.

    ``L`` is differentiable (its gradient equals that of ``Σ g·token_logprobs(...)``, with the
    head's logits computed once: no recompute in the backward); ``lp`` is not (stop-gradient).

    Args:
      cfg, params, tokens_BT, lengths_B, chunk, lora, lora_scale, unroll: as `token_logprobs`.
      g_BT: float[B, T-1] ``dL/dlp`` (padding entries are ignored: their ``lp`` is 0).

    Returns:
      ``(L, lp[B, T-1])`` in ``promote_types(dtype, float32)``, ``lp`` exactly 0 on padding.
    """
    h_NH, y_N, valid_BT = _head_inputs(cfg, params, tokens_BT, lengths_B, lora, lora_scale, unroll)
    if g_BT.shape != valid_BT.shape:
        raise ValueError(f"linear_loss: weights {g_BT.shape}, expected {valid_BT.shape}")
    g_N = jnp.where(valid_BT, g_BT, jnp.zeros((), g_BT.dtype)).reshape(-1)
    loss, lp = _logprobs.linear_loss(h_NH, unembedding(params), y_N, g_N, chunk=chunk)
    lp = lp.reshape(valid_BT.shape)
    return loss, jnp.where(valid_BT, lp, jnp.zeros((), lp.dtype))


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
