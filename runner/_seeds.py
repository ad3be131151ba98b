"""Sampling seeds of every backend and of the local server (no SDK import): one rule.

A ``sample(prompts, num_samples=n, seed=s)`` call draws its completions from random streams
numbered by *row*: completion ``j`` of prompt ``p`` is row ``p·n + j`` of the call, and the
local backend samples row ``r`` from ``fold_in(fold_in(PRNGKey(s), r), i)`` at step ``i``
(`runner.local.sampling`). A hosted backend sends each row's stream as one integer,
``wire_seed(s, r) = s·2^12 + r``, which is inside the int32 range that every Tinker-API engine
accepts (SkyRL tx's JAX backend refuses seeds ≥ 2^31) as long as the call seed is below
``CALL_SEEDS = 2^19`` and the call has at most ``ROWS_PER_CALL = 2^12`` completions:

* the Tinker backend sends one request per prompt, seeded with its first row
  (`prompt_seed`); the server samples the request's ``num_samples`` rows from there on;
* the Fireworks SDK's deployment sampler sends one ``n=1`` request per completion, each with the
  request's ``seed`` (``sampler.sample(prompt, num_samples=4, SamplingParams(seed=s))`` sends
  four identical requests, which a deployment that honours the seed answers identically: a GRPO
  group without variance), so `runner.fireworks.FireworksTrainer` seeds every completion with
  its own row (`sample_seed`).

The local server decodes a wire seed (`decode_wire_seed`) into the call seed and the row, and
samples the rows of one call together, so a hosted run on it reproduces the local backend's
completions exactly. The runner draws its call seeds below ``CALL_SEEDS`` from
``(seed, step, …)`` (`call_seed`); a hosted backend refuses a larger one.
"""

from __future__ import annotations

import numpy as np

#: Call seeds of a hosted ``sample`` are below this (``seed·2^12 + row < 2^31``).
CALL_SEEDS = 2**19
#: Completions (prompts × samples) per hosted ``sample`` call are at most this.
ROWS_PER_CALL = 2**12


def call_seed(*key: int) -> int:
    """A call seed in ``[0, CALL_SEEDS)`` drawn from the integers ``key`` (a
    ``numpy.random.SeedSequence`` of them: the same key, the same seed, on every machine)."""
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0]
    return int(state) >> (32 - 19)


def wire_seed(seed: int, row: int) -> int:
    """``seed·2^12 + row``: the int32 seed of row ``row`` of a call seeded ``seed``."""
    return int(seed) * ROWS_PER_CALL + int(row)


def decode_wire_seed(value: int) -> tuple[int, int]:
    """``(call seed, row)`` of a `wire_seed` value."""
    return divmod(int(value), ROWS_PER_CALL)


def prompt_seed(seed: int, index: int, num_samples: int = 1) -> int:
    """The seed of prompt ``index`` of a call seeded ``seed`` with ``num_samples`` completions
    per prompt: its first row's, ``wire_seed(seed, index·num_samples)``."""
    return wire_seed(seed, int(index) * int(num_samples))


def sample_seed(seed: int, index: int, sample: int, num_samples: int) -> int:
    """The seed of completion ``sample`` of prompt ``index``: ``wire_seed(seed, index·num_samples
    + sample)`` (sample 0 has the prompt's seed, `prompt_seed`)."""
    return wire_seed(seed, int(index) * int(num_samples) + int(sample))


def check_hosted_call(seed: int, num_prompts: int, num_samples: int) -> None:
    """Raises ValueError unless every row of the call has an int32 `wire_seed`."""
    if not 0 <= seed < CALL_SEEDS:
        raise ValueError(
            f"sample: seed must be in [0, 2**19) on a hosted backend (the wire seed "
            f"seed·2**12 + row must fit int32), got {seed}"
        )
    rows = num_prompts * num_samples
    if rows > ROWS_PER_CALL:
        raise ValueError(
            f"sample: at most {ROWS_PER_CALL} completions (prompts × num_samples) per call on a "
            f"hosted backend, got {num_prompts} × {num_samples}"
        )
