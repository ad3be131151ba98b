"""Fireworks backend configuration rules (no SDK import at module load).

`validate_static` checks the ``[fireworks]`` section and the parts of the main job that the
hosted trainer constrains (after docs/sft.md#config-validation); `api_key_from_env` reads the
API key from the environment at connection time; `is_vision_model` is the name rule that makes
vision-language models fail closed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: ``[fireworks].modality`` values: ``auto`` = decide by `is_vision_model`.
MODALITIES = ("auto", "text", "vision")
#: Environment variable names as keys are named (upper case): an API key itself (``fw_...``,
#: mixed case) never matches, so a key pasted into ``api_key_env`` is refused without echoing it.
_ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")
_OUTPUT_MODEL_ID_RE = re.compile(r"^[a-z0-9-]{1,63}$")
_VLM_TOKENS = frozenset({"vl", "vlm", "vision", "visual", "omni", "multimodal", "mm", "image"})
_VLM_TOKEN_RE = re.compile(r"^(vl\d+|\d+(p\d+)?v)$")  # deepseek-vl2, glm-4v, glm-4p5v
_VLM_FAMILIES = (
    "llava",
    "pixtral",
    "qvq",
    "idefics",
    "paligemma",
    "internvl",
    "cogvlm",
    "molmo",
    "minicpm-v",
    "llama4",
    "llama-4",
    "gemma-3n",
)


def is_vision_model(base_model: str) -> bool:
    """Whether a base model name looks like a vision-language model (no network needed).

    Rule, on the lower-cased last ``/`` segment of the name (``accounts/fireworks/models/
    qwen2p5-vl-32b-instruct`` → ``qwen2p5-vl-32b-instruct``): it is a VLM if one of its
    ``-``/``_``/``.``-separated tokens is ``vl``, ``vlm``, ``vision``, ``visual``, ``omni``,
    ``multimodal``, ``mm`` or ``image``, or looks like ``vl2`` / ``4v`` / ``4p5v``; or if the name
    contains a known multimodal family (``llava``, ``pixtral``, ``qvq``, ``idefics``,
    ``paligemma``, ``internvl``, ``cogvlm``, ``molmo``, ``minicpm-v``, ``llama4``/``llama-4``,
    ``gemma-3n``). It is a heuristic biased towards failing closed; set ``[fireworks].modality``
    to ``"text"`` to assert that a flagged model is used text-only, or ``"vision"`` to refuse a
    model the rule misses.

    Args:
      base_model: a Fireworks model resource name or short id.

    Returns:
      True when the rule flags the model.
    """
    name = base_model.strip().lower().rsplit("/", 1)[-1]
    tokens = [t for t in re.split(r"[-_.]", name) if t]
    if any(t in _VLM_TOKENS or _VLM_TOKEN_RE.match(t) for t in tokens):
        return True
    return any(family in name for family in _VLM_FAMILIES)


def check_text_only(base_model: str, modality: str = "auto") -> None:
    """Raises ``ValueError`` when the model is (or is declared) a vision-language model."""
    if modality not in MODALITIES:
        raise ValueError(
            f"config [fireworks].modality must be one of {MODALITIES}, got {modality!r}"
        )
    vision = modality == "vision" or (modality == "auto" and is_vision_model(base_model))
    if vision:
        why = "declared by [fireworks].modality" if modality == "vision" else "by its name"
        raise ValueError(
            f"base model {base_model!r} is a vision-language model ({why}); the Fireworks backend "
            "trains text-only token sequences and refuses VLMs (a VLM fed text-only tokens would "
            "train on wrong inputs). If the model is used text-only, set "
            '[fireworks].modality = "text"'
        )


def check_output_model_id(output_model_id: str) -> None:
    """The SDK's ``validate_output_model_id`` (1-63 characters of ``[a-z0-9-]``), as ValueError."""
    try:
        from fireworks.training.sdk.fireworks_client import validate_output_model_id
    except ImportError:  # pragma: no cover - the fireworks extra is missing; same rule
        errors = (
            []
            if _OUTPUT_MODEL_ID_RE.match(output_model_id)
            else [f"output_model_id '{output_model_id}' must be 1-63 characters of [a-z0-9-]"]
        )
    else:
        errors = validate_output_model_id(output_model_id)
    if errors:
        raise ValueError("config [fireworks].output_model_id is invalid: " + "; ".join(errors))


def validate_static(cfg: Any) -> None:
    """Checks a `runner.config.Config` whose backend is ``fireworks`` (no environment access).

    Rules: ``base_model`` and ``training_shape_id`` are set (``trainer_job_id`` is optional: empty
    = the SDK provisions a new trainer job); the model is text-only (`check_text_only`);
    ``api_key_env`` is a valid environment variable name; ``base_url`` is http(s); timeouts and
    ``max_seq_len`` are positive; ``[model].max_seq_len <= [fireworks].max_seq_len`` (the model
    input is the sequence minus one token); checkpoints need a path (``[run].output_dir``, under
    which manifests record the provider identities); ``output_model_id`` passes the SDK's
    validator; ``[rl].kl_coef`` is 0 (the frozen reference model is local-only).
    """
    f = cfg.fireworks
    for key in ("base_model", "training_shape_id"):
        if not str(getattr(f, key)).strip():
            raise ValueError(f"config [fireworks].{key} is required for backend 'fireworks'")
    check_text_only(f.base_model, f.modality)
    if not _ENV_NAME_RE.match(f.api_key_env):
        # Never echo the value: a user who pasted the key itself here must not see it logged.
        raise ValueError(
            "config [fireworks].api_key_env must be an environment variable name in upper case "
            "(like FIREWORKS_API_KEY), not the key itself; the value given is not shown"
        )
    if not f.base_url.startswith(("https://", "http://")):
        raise ValueError(f"config [fireworks].base_url must be an http(s) URL, got {f.base_url!r}")
    for key in ("max_seq_len", "request_timeout_s", "identity_timeout_s", "connect_timeout_s"):
        if not getattr(f, key) > 0:
            raise ValueError(f"config [fireworks].{key} must be > 0, got {getattr(f, key)!r}")
    if cfg.model.max_seq_len > f.max_seq_len:
        raise ValueError(
            f"config [model].max_seq_len ({cfg.model.max_seq_len}) exceeds [fireworks].max_seq_len "
            f"({f.max_seq_len}): the trainer would reject the longest model inputs"
        )
    if not str(cfg.run.output_dir).strip():
        raise ValueError(
            "config [run].output_dir must be set for backend 'fireworks': checkpointing needs a "
            "path (the run's manifests are the only record of the trainer's checkpoint identities)"
        )
    if f.output_model_id:
        check_output_model_id(f.output_model_id)
    from runner._hosted import refuse_reference_model

    refuse_reference_model(cfg, "fireworks")


def api_key_from_env(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The API key from the environment variable ``name``; the error names the variable only."""
    from runner._hosted import api_key_from_env as from_env

    return from_env(name, environ, service="Fireworks", section="fireworks")
