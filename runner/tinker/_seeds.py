"""The Tinker backend's per-prompt seeds: the one rule in `runner._seeds` (re-exported)."""

from runner._seeds import (  # noqa: F401 - re-exported
    CALL_SEEDS,
    ROWS_PER_CALL,
    decode_wire_seed,
    prompt_seed,
)
