"""`runner.local`: the embedded default trainer — a small decoder-only JAX transformer (or a
Llama / Qwen2 / Qwen3 decoder from a Hugging Face checkpoint, `runner.local.models`) with the
Fireworks built-in kernels (delegated to `losses` terms), accumulate-then-step AdamW, KV-cache
sampling, data parallelism over ``jax.devices()`` and atomic checkpoints.

Example:
  >>> from runner.local import LocalTrainer, LocalTrainerConfig
  >>> trainer = LocalTrainer(LocalTrainerConfig(vocab_size=32, d_model=32, n_layers=1))
"""

from runner.local._from_config import local_trainer_config
from runner.local.kernels import KERNELS
from runner.local.model import LocalTrainerConfig
from runner.local.trainer import LocalTrainer, length_bucket, row_bucket

__all__ = [
    "KERNELS",
    "LocalTrainer",
    "LocalTrainerConfig",
    "length_bucket",
    "local_trainer_config",
    "row_bucket",
]
