"""The Tinker backend's per-prompt seeds: the one rule in `runner._seeds` (re-exported)."""

from runner._seeds import PROMPT_SEED_STRIDE, decode_prompt_seed, prompt_seed  # noqa: F401
