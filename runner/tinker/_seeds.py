"""Per-prompt sampling seeds (no SDK import): the rule `runner.tinker.TinkerTrainer` encodes
and the local server (`runner.serve._engine.decode_seed`) decodes."""

from __future__ import annotations

#: Prompts per ``sample`` call are numbered below this (`prompt_seed`).
PROMPT_SEED_STRIDE = 2**20


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index`` of a ``sample(..., seed=seed)`` call.

    ``seed·2^20 + index``: distinct per prompt, reproducible, and decodable — the local server
    samples prompt ``index`` of the call with the local backend's random stream of
    ``(seed, index)``, so a run on the server reproduces a ``--backend local`` run. (The
    Fireworks backend sends the same encoding, `runner.fireworks.prompt_seed`.)
    """
    return int(seed) * PROMPT_SEED_STRIDE + int(index)


def decode_prompt_seed(seed: int) -> tuple[int, int]:
    """``(seed, index)`` of a `prompt_seed` value."""
    return divmod(int(seed), PROMPT_SEED_STRIDE)
