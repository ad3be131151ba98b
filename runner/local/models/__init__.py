"""`runner.local.models`: Llama / Qwen2 / Qwen3 decoders in JAX, Hugging Face checkpoints
(offline), LoRA in the PEFT layout and memory-bounded per-token logprobs.

docs/hf-models.md is the specification (architectures as equations, config keys, tensor
names, RoPE variants, LoRA/PEFT, chunked logprobs, parity pitfalls).

Example:
  >>> import jax.numpy as jnp
  >>> from runner.local.models import DecoderConfig, init_params, logits
  >>> cfg = DecoderConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
  ...                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
  >>> params = init_params(cfg, seed=0, dtype="float32")
  >>> logits(cfg, params, jnp.zeros((1, 5), jnp.int32)).shape
  (1, 5, 64)
"""

from runner.local.models._arch import DecoderArch, Gpt2Arch
from runner.local.models._config import (
    FAMILIES,
    ROPE_TYPES,
    DecoderConfig,
    RopeConfig,
    from_hf_config,
    to_hf_config,
)
from runner.local.models._decoder import (
    PROJECTIONS,
    decode_step,
    hidden_states,
    init_params,
    logits,
    num_params,
    param_shapes,
    prefill,
    token_logprobs,
)
from runner.local.models._hf_io import (
    hf_names,
    load_pretrained,
    read_config,
    save_pretrained,
    to_hf_tensors,
)
from runner.local.models._logprobs import token_logprobs as chunked_token_logprobs
from runner.local.models._lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraConfig,
    init_lora,
    load_peft,
    merge,
    read_adapter_config,
    save_peft,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "FAMILIES",
    "PROJECTIONS",
    "ROPE_TYPES",
    "DecoderArch",
    "DecoderConfig",
    "Gpt2Arch",
    "LoraConfig",
    "RopeConfig",
    "chunked_token_logprobs",
    "decode_step",
    "from_hf_config",
    "hf_names",
    "hidden_states",
    "init_lora",
    "init_params",
    "load_peft",
    "load_pretrained",
    "logits",
    "merge",
    "num_params",
    "param_shapes",
    "prefill",
    "read_adapter_config",
    "read_config",
    "save_peft",
    "save_pretrained",
    "to_hf_config",
    "to_hf_tensors",
    "token_logprobs",
]
