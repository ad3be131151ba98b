"""Input checks and sample conversion shared by the hosted-SDK backends (Fireworks, Tinker).

Both SDKs return sampled sequences with ``tokens``/``logprobs`` (and numpy views
``tokens_np``/``logprobs_np`` where the SDK has them) and a ``stop_reason``; both backends take
the same ``sample(prompts, num_samples, max_tokens, seed, stop_token_ids)`` arguments.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from runner._padding import CheckedSeqs
from runner._seeds import check_hosted_call
from runner._types import Sample, Seq

#: The SDK calls a hosted trainer counts in ``trainer.counters`` (tests and benchmarks read
#: them): ``sample`` per prompt request, ``sampler_sync`` per weights-to-sampler sync.
COUNTERS = (
    "forward",
    "forward_backward",
    "optim_step",
    "sample",
    "sampler_sync",
    "save_state",
    "save_sampler",
    "load_state",
)


class ModelInputCache:
    """Reuses one SDK ``ModelInput`` per live token array, so the forward and the linear
    backward of a client pass send the very same model input (the precomputed-forward
    invariant) without rebuilding it.

    Args:
      build: the SDK's constructor from the input token ids (``types.ModelInput.from_ints``:
        both SDKs have one); called with ``tokens[:-1]`` as a list.
      maxsize: entries kept; when full, entries of arrays no longer alive are dropped first,
        then all.
    """

    def __init__(self, build: Callable[[list[int]], Any], maxsize: int = 4096) -> None:
        self._build = build
        self._entries: dict[int, tuple[weakref.ref, int, Any]] = {}
        self._maxsize = maxsize
        self._lock = threading.Lock()

    def get(self, tokens: np.ndarray) -> Any:
        key = id(tokens)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0]() is tokens and hit[1] == tokens.shape[0]:
                return hit[2]
        model_input = self._build(tokens[:-1].tolist())
        with self._lock:
            if len(self._entries) >= self._maxsize:
                self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
                if len(self._entries) >= self._maxsize:
                    self._entries.clear()
            self._entries[key] = (weakref.ref(tokens), tokens.shape[0], model_input)
        return model_input


def float_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The numeric entries of an SDK response's metrics as floats (booleans and the rest
    dropped: they are not training metrics)."""
    out = {}
    for key, value in dict(metrics or {}).items():
        if isinstance(value, int | float | np.number) and not isinstance(value, bool):
            out[str(key)] = float(value)
    return out


def as_seq_list(seqs: Any) -> list[Seq]:
    if isinstance(seqs, Seq) or not isinstance(seqs, Sequence):
        raise ValueError(f"expected a sequence of runner.Seq, got {type(seqs).__name__}")
    return seqs if isinstance(seqs, CheckedSeqs) else list(seqs)


def check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"sample: {name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"sample: {name} must be >= {low}, got {value!r}")
    return int(value)


def check_prompts(prompts: Any) -> list[np.ndarray]:
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        raise ValueError("sample: prompts must be a sequence of token sequences")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("sample: empty batch: at least one prompt is required")
    arrays = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.shape[0] < 1:
            raise ValueError(f"prompt {i}: must be a non-empty rank-1 token list, got {a.shape}")
        if not np.issubdtype(a.dtype, np.integer) or a.min() < 0:
            raise ValueError(f"prompt {i}: tokens must be non-negative integers")
        arrays.append(a.astype(np.int64))
    return arrays


def to_sample(seq: Any, prompt: int, stops: Sequence[int]) -> Sample:
    tokens = getattr(seq, "tokens_np", None)
    tokens = np.asarray(seq.tokens if tokens is None else tokens, np.int64).reshape(-1)
    logprobs = getattr(seq, "logprobs_np", None)
    logprobs = seq.logprobs if logprobs is None else logprobs
    if logprobs is None:
        raise RuntimeError(f"prompt {prompt}: the sampler returned no logprobs")
    logprobs = np.asarray(logprobs, np.float32).reshape(-1)
    if logprobs.shape != tokens.shape:
        raise RuntimeError(
            f"prompt {prompt}: {logprobs.shape[0]} logprobs for {tokens.shape[0]} sampled tokens"
        )
    stop = "stop" if str(seq.stop_reason) == "stop" else "length"
    if stops:
        hits = np.flatnonzero(np.isin(tokens, stops))
        if hits.size:
            end = int(hits[0]) + 1
            tokens, logprobs, stop = tokens[:end], logprobs[:end], "stop"
    return Sample(tokens=tokens, logprobs=logprobs, stop_reason=stop)


def check_sample_args(
    prompts: Any,
    num_samples: Any,
    max_tokens: Any,
    seed: Any,
    temperature: Any,
    stop_token_ids: Sequence[Any],
    max_seq_len: int | None,
) -> tuple[list[np.ndarray], int, int, int, list[int]]:
    """The checked arguments of a hosted backend's ``sample``:
    ``(prompt arrays, num_samples, max_tokens, seed, stop token ids)``.

    Raises:
      ValueError: naming the argument and the rule (seed < 2**19 and at most 2**12
        completions per call, `runner._seeds`; a finite temperature ≥ 0; the longest prompt +
        max_tokens − 1 ≤ max_seq_len).
    """
    arrays = check_prompts(prompts)
    num_samples = check_int("num_samples", num_samples, 1)
    max_tokens = check_int("max_tokens", max_tokens, 1)
    seed = check_int("seed", seed, 0)
    check_hosted_call(seed, len(arrays), num_samples)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.number):
        raise ValueError(f"sample: temperature must be a number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"sample: temperature must be finite and >= 0, got {temperature!r}")
    stops = [check_int("stop_token_ids entry", t, 0) for t in stop_token_ids]
    longest = max(a.shape[0] for a in arrays)
    if max_seq_len is not None and longest + max_tokens - 1 > max_seq_len:
        raise ValueError(
            f"sample: longest prompt ({longest}) + max_tokens ({max_tokens}) - 1 exceeds "
            f"max_seq_len={max_seq_len}"
        )
    return arrays, num_samples, max_tokens, seed, stops


def refuse_reference_model(cfg: Any, backend: str) -> None:
    """Raises ``ValueError`` when the run's RL loss needs a frozen reference model
    (`runner.config.reference_reason`): the hosted backends have none."""
    from runner.config import reference_reason

    reason = reference_reason(cfg)
    if reason is not None:
        raise ValueError(
            f"config {reason} needs a frozen reference model, which is supported on the "
            "local backend only; set [rl].kl_coef to 0 (or use a loss without ref_logprobs) for "
            f"backend '{backend}'"
        )


def api_key_from_env(name: str, environ: Any, *, service: str, section: str) -> str:
    """The API key of ``service`` from the environment variable ``name`` (named by
    ``[section].api_key_env``); the error names the variable only, never a value."""
    import os

    environ = os.environ if environ is None else environ
    value = environ.get(name, "")
    if not value.strip():
        raise ValueError(
            f"the {service} API key is missing: set the environment variable {name} (named by "
            f"[{section}].api_key_env); the key is never read from the config file"
        )
    return value.strip()
