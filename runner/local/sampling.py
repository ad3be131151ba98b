"""Batched autoregressive sampling with a KV cache.

One jitted call per (rows, prompt-bucket, cache-bucket, stop-bucket) shape: prefill every prompt
once (a causal forward that also returns each layer's keys/values), then a `jax.lax.while_loop`
of single-token ``decode_step`` calls of the model (`runner.local.models._arch`) over the
cache, one token per row per step, stopping early when every row is done. ``max_tokens`` and
``temperature`` are traced scalars, so changing them does not recompile.

Randomness: row ``r`` draws step ``i`` from ``fold_in(fold_in(fold_in(PRNGKey(seed), p), j), i)``
with its ``prompt_idx`` ``p`` and ``sample_idx`` ``j`` (`LocalTrainer.sample` passes the call's
row number ``p·num_samples + j`` as ``p`` and 0 as ``j``, `runner._seeds`), so a row's completion
depends only on the seed, those two indices, its prompt tokens and the weights — not on the other
prompts or the batch padding.

Reported logprobs: ``log_softmax(logits / temperature)[token]``, the logprob of the sampled token
under the temperature-scaled distribution it was drawn from (equal to the model's
``forward()`` logprob at temperature 1). At temperature 0 (greedy) the token is the argmax and
the reported logprob is the untempered (temperature 1) model logprob of that token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from runner.local.models import Gpt2Arch


def generate(
    params,
    prompts_RP: jax.Array,
    prompt_lens_R: jax.Array,
    prompt_idx_R: jax.Array,
    sample_idx_R: jax.Array,
    active_R: jax.Array,
    stop_ids_S: jax.Array,
    max_tokens: jax.Array,
    temperature: jax.Array,
    key: jax.Array,
    *,
    cache_len: int,
    n_heads: int | None = None,
    arch=None,
    frozen=None,
    sample_vocab: int | None = None,
):
    """Samples up to ``max_tokens`` tokens per row; returns ``(tokens, logprobs, n, stopped)``.

    Args:
      params: model parameters.
      prompts_RP: int prompts right-padded to ``P`` columns.
      prompt_lens_R: int prompt lengths (≥ 1).
      prompt_idx_R: int prompt index of each row (for the row's key).
      sample_idx_R: int sample index of each row (for the row's key).
      active_R: bool, False for padding rows (which generate nothing).
      stop_ids_S: int stop token ids, padded with -1.
      max_tokens: int scalar, ``1 ≤ max_tokens ≤ cache_len``.
      temperature: float scalar ≥ 0 (0 = greedy).
      key: PRNG key from the seed.
      cache_len: static KV-cache length ``≥ max(prompt_lens) + max_tokens - 1``.
      n_heads: attention heads of the GPT-2-style default model (when ``arch`` is ``None``).
      arch: the model (`runner.local.models.Gpt2Arch` or ``DecoderArch``); its ``prefill`` and
        ``decode_step`` run the model.
      frozen: the model's frozen parameters (the LoRA base; ``{}`` or ``None`` otherwise).
      sample_vocab: static; draw only ids ``< sample_vocab`` (the others get ``-inf`` logits
        before the temperature, the softmax and the argmax); ``None``: every id.

    Returns:
      ``tokens[R, cache_len]`` int, ``logprobs[R, cache_len]`` float (column ``i`` = step ``i``),
      ``n[R]`` number of generated tokens, ``stopped[R]`` bool (ended on a stop token).
    """
    R, P = prompts_RP.shape
    if arch is None:
        arch = Gpt2Arch(n_heads)
    frozen = {} if frozen is None else frozen
    last, ks, vs = arch.prefill(params, frozen, prompts_RP, prompt_lens_R)
    pad = [(0, 0), (0, 0), (0, cache_len - P), (0, 0), (0, 0)]
    k_cache, v_cache = jnp.pad(ks, pad), jnp.pad(vs, pad)
    row_keys = jax.vmap(lambda p, j: jax.random.fold_in(jax.random.fold_in(key, p), j))(
        prompt_idx_R, sample_idx_R
    )
    greedy = temperature <= 0
    inv_temp = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperature)).astype(last.dtype)

    def draw(logits_RV, i):
        if sample_vocab is not None and sample_vocab < logits_RV.shape[-1]:
            allowed = jnp.arange(logits_RV.shape[-1]) < sample_vocab
            logits_RV = jnp.where(allowed, logits_RV, -jnp.inf)
        scaled = logits_RV * inv_temp
        logp = jax.nn.log_softmax(scaled, axis=-1)
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)
        sampled = jax.vmap(jax.random.categorical)(step_keys, scaled)
        tok = jnp.where(greedy, jnp.argmax(logits_RV, axis=-1), sampled)
        lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
        return tok.astype(prompts_RP.dtype), lp

    out_tok = jnp.zeros((R, cache_len), prompts_RP.dtype)
    out_lp = jnp.zeros((R, cache_len), last.dtype)
    init = (
        jnp.zeros((), jnp.int32),
        last,
        k_cache,
        v_cache,
        prompt_lens_R,
        ~active_R,
        jnp.zeros((R,), bool),
        jnp.zeros((R,), jnp.int32),
        out_tok,
        out_lp,
    )

    def cond(state):
        i, done = state[0], state[5]
        return (i < max_tokens) & ~jnp.all(done)

    def body(state):
        i, logits_RV, kc, vc, pos, done, stopped, n, toks, lps = state
        tok, lp = draw(logits_RV, i)
        live = ~done
        col = jnp.arange(cache_len)[None, :] == i
        toks = jnp.where(col & live[:, None], tok[:, None], toks)
        lps = jnp.where(col & live[:, None], lp[:, None], lps)
        n = n + live.astype(n.dtype)
        hit = jnp.any(tok[:, None] == stop_ids_S[None, :], axis=1) & live
        stopped = stopped | hit
        done = done | hit
        # Feed the new token at `pos`. After a row's last step the result is never used (its
        # position may then be past the cache, a no-op write).
        logits_RV, kc, vc = arch.decode_step(params, frozen, tok, pos, kc, vc)
        pos = jnp.where(done, pos, pos + 1)
        return (i + 1, logits_RV, kc, vc, pos, done, stopped, n, toks, lps)

    final = jax.lax.while_loop(cond, body, init)
    return final[8], final[9], final[7], final[6]
