"""The bounds on what one client of ``python -m runner serve`` may ask for (one table).

Each entry: the `runner.serve.ServeConfig` field, the ``serve`` flag that sets it, its default
and what it bounds. A request over a bound is a 400 naming the bound and the flag. Kept free of
heavy imports: the CLI's parser reads it for every command.
"""

from __future__ import annotations

#: ``field: (flag, default, what it bounds)``.
SERVE_LIMITS: dict[str, tuple[str, int, str]] = {
    "max_samples": ("--max-samples", 256, "samples per sampling request"),
    "max_sample_tokens": (
        "--max-sample-tokens",
        1 << 20,
        "tokens per sampling request (prompt + samples x max_tokens)",
    ),
    "max_batch_rows": ("--max-batch-rows", 4096, "sequences per forward / forward_backward"),
    "max_sessions": ("--max-sessions", 256, "live sessions per API key"),
    "max_models": ("--max-models", 64, "training models per API key"),
}
#: Shortest API key the server accepts.
MIN_API_KEY_CHARS = 16
