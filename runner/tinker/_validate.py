"""Tinker backend configuration rules (no SDK import at module load).

`validate_static` checks the ``[tinker]`` section and the parts of the main job the Tinker API
constrains; `api_key_from_env` reads the API key from the environment at connection time (the
error names the variable, never a value).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: Environment variable names as keys are named (upper case): a pasted key (``tml-...``) never
#: matches, so it is refused without being echoed.
_ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")


def validate_static(cfg: Any) -> None:
    """Checks a `runner.config.Config` whose backend is ``tinker`` (no environment access).

    Rules: ``base_model`` is set; ``base_url`` is http(s); ``api_key_env`` is an environment
    variable name; ``lora_rank`` >= 1; the timeouts are > 0; checkpoints need a path
    (``[run].output_dir``: the manifests are the only record of the ``tinker://`` identities);
    ``[rl].kl_coef`` is 0 (the frozen reference model is local-only).
    """
    t = cfg.tinker
    if not str(t.base_model).strip():
        raise ValueError("config [tinker].base_model is required for backend 'tinker'")
    if not t.base_url.startswith(("https://", "http://")):
        raise ValueError(f"config [tinker].base_url must be an http(s) URL, got {t.base_url!r}")
    if not _ENV_NAME_RE.match(t.api_key_env):
        raise ValueError(
            "config [tinker].api_key_env must be an environment variable name in upper case "
            "(like TINKER_API_KEY), not the key itself; the value given is not shown"
        )
    if t.lora_rank < 1:
        raise ValueError(f"config [tinker].lora_rank must be >= 1, got {t.lora_rank!r}")
    for key in ("request_timeout_s", "connect_timeout_s"):
        if not getattr(t, key) > 0:
            raise ValueError(f"config [tinker].{key} must be > 0, got {getattr(t, key)!r}")
    if not str(cfg.run.output_dir).strip():
        raise ValueError(
            "config [run].output_dir must be set for backend 'tinker': the run's manifests are "
            "the only record of its tinker:// checkpoint identities"
        )
    from runner._hosted import refuse_reference_model

    refuse_reference_model(cfg, "tinker")


def api_key_from_env(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The API key from the environment variable ``name``; the error names the variable only."""
    from runner._hosted import api_key_from_env as from_env

    return from_env(name, environ, service="Tinker", section="tinker")
