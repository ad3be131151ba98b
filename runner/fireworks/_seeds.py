"""The Fireworks backend's per-sample seeds: the one rule in `runner._seeds` (re-exported)."""

from runner._seeds import (  # noqa: F401 - re-exported
    MAX_SAMPLES,
    PROMPT_SEED_STRIDE,
    SAMPLE_SEED_STRIDE,
    decode_sample_seed,
    prompt_seed,
    sample_seed,
)
