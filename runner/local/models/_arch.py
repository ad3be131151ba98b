"""The local trainer's model families behind one small interface (static, hashable objects).

`LocalTrainer` and `runner.local.sampling` call a model only through these methods, so the
jitted functions are keyed by the architecture object (a frozen dataclass) and compile once per
bucket for every model of the same shape:

- ``token_logprobs(params, frozen, tokens_BT, lengths_B) -> float[B, T-1]``
- ``prefill(params, frozen, prompts_RP, prompt_lens_R) -> (last logits[R, V], keys, values)``
- ``decode_step(params, frozen, tokens_B, positions_B, k_cache, v_cache)
  -> (logits[B, V], k_cache, v_cache)``
- ``linear_loss(params, frozen, tokens_BT, lengths_B, g_BT) -> (Σ g·lp, lp[B, T-1])``, only
  where ``fused_linear_loss`` is true (the decoders; the GPT-2 default has no fused head)

``params`` are the trainable parameters (what the optimizer updates and the gradient is taken
with respect to); ``frozen`` are the rest: ``{}`` for full fine-tuning, the base weights for
LoRA (whose ``params`` are the adapters).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from runner.local import model as gpt2
from runner.local.models import _decoder
from runner.local.models._config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class Gpt2Arch:
    """The default GPT-2-style model (`runner.local.model`); ``frozen`` is always ``{}``."""

    n_heads: int

    #: No fused linear-loss head (`DecoderArch.linear_loss`): its head is the materialized
    #: logits under plain autodiff, and the trainer runs every kernel through the generic path.
    fused_linear_loss: ClassVar[bool] = False

    def token_logprobs(self, params, frozen, tokens_BT, lengths_B) -> jax.Array:
        del frozen
        return gpt2.token_logprobs(params, tokens_BT, lengths_B, n_heads=self.n_heads)

    def prefill(self, params, frozen, prompts_RP, prompt_lens_R):
        del frozen
        logits_all, ks, vs = gpt2.logits_and_kv(params, prompts_RP, n_heads=self.n_heads)
        last = jnp.take_along_axis(logits_all, (prompt_lens_R - 1)[:, None, None], axis=1)
        return last[:, 0, :], ks, vs

    def decode_step(self, params, frozen, tokens_B, positions_B, k_cache, v_cache):
        del frozen
        return gpt2.decode_step(
            params, tokens_B, positions_B, k_cache, v_cache, n_heads=self.n_heads
        )


@dataclasses.dataclass(frozen=True)
class DecoderArch:
    """A Llama / Qwen2 / Qwen3 decoder (`runner.local.models._decoder`).

    Attributes:
      config: the architecture.
      chunk: tokens per logprob chunk (0 = materialized logits).
      lora_scale: ``None`` for full fine-tuning; else LoRA's ``s`` (``params`` are adapters).
      unroll: unroll the layer loop instead of scanning it (`runner.local.models._decoder`).
    """

    config: DecoderConfig
    chunk: int
    lora_scale: float | None = None
    unroll: bool = False

    def _split(self, params, frozen) -> tuple[Any, Any]:
        if self.lora_scale is None:
            return params, None
        return frozen, params

    def _kw(self, lora) -> dict[str, Any]:
        scale = 1.0 if self.lora_scale is None else self.lora_scale
        return {"lora": lora, "lora_scale": scale, "unroll": self.unroll}

    def token_logprobs(self, params, frozen, tokens_BT, lengths_B) -> jax.Array:
        weights, lora = self._split(params, frozen)
        return _decoder.token_logprobs(
            self.config, weights, tokens_BT, lengths_B, chunk=self.chunk, **self._kw(lora)
        )

    #: `linear_loss` runs the fused head (the trainer's linear-kernel path).
    fused_linear_loss: ClassVar[bool] = True

    def linear_loss(self, params, frozen, tokens_BT, lengths_B, g_BT):
        """``(Σ g·lp, lp[B, T-1])`` for fixed weights ``g[B, T-1]``; only the sum is
        differentiable (`runner.local.models._decoder.linear_loss`)."""
        weights, lora = self._split(params, frozen)
        return _decoder.linear_loss(
            self.config, weights, tokens_BT, lengths_B, g_BT, chunk=self.chunk, **self._kw(lora)
        )

    def prefill(self, params, frozen, prompts_RP, prompt_lens_R):
        weights, lora = self._split(params, frozen)
        return _decoder.prefill(self.config, weights, prompts_RP, prompt_lens_R, **self._kw(lora))

    def decode_step(self, params, frozen, tokens_B, positions_B, k_cache, v_cache):
        weights, lora = self._split(params, frozen)
        return _decoder.decode_step(
            self.config, weights, tokens_B, positions_B, k_cache, v_cache, **self._kw(lora)
        )
