"""The main job's ``[model]`` section → a `LocalTrainerConfig` (the local backend's model).

``arch = "gpt2"`` (default) with the sizes is the GPT-2-style toy; ``arch = "llama" | "qwen2" |
"qwen3"`` with the same sizes (``d_model`` → hidden, ``d_ff`` → intermediate, plus
``n_kv_heads``, ``head_dim``, ``rope_theta``) is a randomly initialized decoder of that family;
``path = "<dir>"`` is a Hugging Face checkpoint directory whose ``config.json`` gives the
architecture and whose safetensors give the weights (the sizes are then unused). ``lora_rank > 0``
trains LoRA adapters on a decoder; ``dtype``, ``logprob_chunk`` and ``unroll_layers`` apply to
decoders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.local.model import LocalTrainerConfig

ARCHS = ("gpt2", "llama", "qwen2", "qwen3")
_DTYPES = ("float32", "bfloat16")


def local_trainer_config(
    m: Any, *, vocab_size: int, seed: int, checkpoint_dir: str | None
) -> LocalTrainerConfig:
    """The `LocalTrainerConfig` of a ``runner.config.ModelConfig``.

    The GPT-2-style default gets exactly the fields it always had (the main job's trajectory is
    unchanged). Reads ``<path>/config.json`` when ``path`` is set (not the weights: the trainer
    loads them when it is built).

    Raises:
      ValueError: naming the ``[model]`` key — unknown ``arch``, a decoder knob on the GPT-2
        model, a checkpoint whose vocabulary is smaller than the tokenizer's, or the
        architecture's own errors (`runner.local.models.DecoderConfig`, ``config.json`` keys).
    """
    from runner.local import models

    arch = getattr(m, "arch", "gpt2")
    path = getattr(m, "path", "")
    if arch not in ARCHS:
        raise ValueError(f"config [model].arch must be one of {ARCHS}, got {arch!r}")
    if arch == "gpt2" and not path:
        for key, neutral in (
            ("lora_rank", 0),
            ("n_kv_heads", 0),
            ("head_dim", 0),
            ("dtype", "float32"),
            ("unroll_layers", False),
        ):
            if getattr(m, key, neutral) != neutral:
                raise ValueError(
                    f"config [model].{key} applies to the decoders ([model].arch = llama | qwen2 "
                    "| qwen3, or [model].path); the GPT-2-style default has no such knob"
                )
        kwargs = dict(
            vocab_size=vocab_size,
            d_model=m.d_model,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            d_ff=m.d_ff,
            max_seq_len=m.max_seq_len,
            seed=seed,
            checkpoint_dir=checkpoint_dir,
        )
        if getattr(m, "tie_embeddings", False):
            kwargs["tie_embeddings"] = True
        return LocalTrainerConfig(**kwargs)
    dtype = getattr(m, "dtype", "float32")
    if dtype not in _DTYPES:
        raise ValueError(f"config [model].dtype must be one of {_DTYPES}, got {dtype!r}")
    lora = None
    if getattr(m, "lora_rank", 0):
        targets = getattr(m, "lora_targets", "all-linear")
        if targets != "all-linear":
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        try:
            lora = models.LoraConfig(
                rank=m.lora_rank,
                alpha=getattr(m, "lora_alpha", 0.0) or None,
                targets=targets,
                seed=seed,
            )
        except ValueError as exc:
            raise ValueError(f"config [model] (lora_rank/lora_alpha/lora_targets): {exc}") from None
    chunk = getattr(m, "logprob_chunk", None)
    if path:
        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"config [model].path: {path!r} is not a directory")
        try:
            decoder, _ = models.read_config(directory)
        except (OSError, ValueError) as exc:
            raise ValueError(f"config [model].path: {exc}") from None
        if arch != "gpt2" and arch != decoder.family:
            raise ValueError(
                f"config [model].arch = {arch!r} but {directory / 'config.json'} is a "
                f"{decoder.family!r} model (leave arch unset with a path)"
            )
        if decoder.vocab_size < vocab_size:
            raise ValueError(
                f"config [model].path: the checkpoint's vocab_size {decoder.vocab_size} is smaller "
                f"than the tokenizer's {vocab_size}"
            )
        pretrained: str | None = str(directory)
    else:
        try:
            decoder = models.DecoderConfig(
                family=arch,
                vocab_size=vocab_size,
                hidden_size=m.d_model,
                intermediate_size=m.d_ff,
                num_layers=m.n_layers,
                num_heads=m.n_heads,
                num_kv_heads=getattr(m, "n_kv_heads", 0) or None,
                head_dim=getattr(m, "head_dim", 0) or None,
                rope=models.RopeConfig(theta=float(getattr(m, "rope_theta", 10000.0))),
                max_position_embeddings=max(m.max_seq_len, 1),
                tie_word_embeddings=bool(getattr(m, "tie_embeddings", False)),
            )
        except ValueError as exc:
            raise ValueError(f"config [model]: {exc}") from None
        pretrained = None
    try:
        return LocalTrainerConfig(
            decoder=decoder,
            pretrained=pretrained,
            lora=lora,
            max_seq_len=m.max_seq_len,
            dtype=dtype,
            seed=seed,
            checkpoint_dir=checkpoint_dir,
            logprob_chunk=chunk,
            unroll_layers=bool(getattr(m, "unroll_layers", False)),
            # a checkpoint's embedding padded past its tokenizer's ids (Qwen3's): never sample
            # an id the tokenizer cannot decode
            sample_vocab_size=vocab_size if decoder.vocab_size > vocab_size else None,
        )
    except ValueError as exc:
        raise ValueError(f"config [model]: {exc}") from None
