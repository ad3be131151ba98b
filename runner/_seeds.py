"""Sampling seeds of the hosted backends and the local server (no SDK import): one rule.

``prompt_seed(seed, i) = seed·2^20 + i`` is the seed of prompt ``i`` of a ``sample(..., seed)``
call (the Tinker backend sends it; the local server decodes it, `decode_prompt_seed`, and
samples prompt ``i`` with the local backend's random stream of ``(seed, i)``).

The Fireworks SDK's deployment sampler sends one ``n=1`` completions request per sample, each
with the request's ``seed``: ``sampler.sample(prompt, num_samples=4, SamplingParams(seed=s))``
sends four identical requests, and a deployment that honours the seed answers four identical
completions (a GRPO group without variance). `runner.fireworks.FireworksTrainer` therefore
samples each completion with its own seed, `sample_seed`, and the local server
(`runner.serve._fw_sampling`) decodes it (`decode_sample_seed`) to reproduce the local
backend's random stream of that prompt and sample exactly.
"""

from __future__ import annotations

#: Prompts per ``sample`` call are numbered below this (`prompt_seed`).
PROMPT_SEED_STRIDE = 2**20
#: Seeds per call are below this (``seed < 2**32``), so the sample index lives above it.
SAMPLE_SEED_STRIDE = 2**52
#: Samples per prompt are numbered below this (every seed stays below ``2**63``).
MAX_SAMPLES = 2**11


def prompt_seed(seed: int, index: int) -> int:
    """``seed·2^20 + index``: the seed of prompt ``index`` of a ``sample(..., seed=seed)`` call."""
    return int(seed) * PROMPT_SEED_STRIDE + int(index)


def decode_prompt_seed(seed: int) -> tuple[int, int]:
    """``(seed, index)`` of a `prompt_seed` value."""
    return divmod(int(seed), PROMPT_SEED_STRIDE)


def sample_seed(seed: int, index: int, sample: int) -> int:
    """Sample ``sample`` of prompt ``index``'s seed: ``sample·2^52 + prompt_seed(seed, index)``.

    Sample 0 has the prompt's seed (`prompt_seed`, the tinker backend's encoding); every sample of
    every prompt of a call has its own seed, below ``2**63``.
    """
    return int(sample) * SAMPLE_SEED_STRIDE + prompt_seed(seed, index)


def decode_sample_seed(value: int) -> tuple[int, int, int]:
    """``(seed, prompt index, sample index)`` of a `sample_seed` value."""
    sample, rest = divmod(int(value), SAMPLE_SEED_STRIDE)
    seed, index = divmod(rest, PROMPT_SEED_STRIDE)
    return seed, index, sample
