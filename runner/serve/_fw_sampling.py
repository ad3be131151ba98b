"""Fireworks sampling on the local server: ``POST /inference/v1/completions``.

The SDK's deployment sampler (``fireworks.training.sdk.sampling.DeploymentSampler``) sends one
``n=1`` request per sample, token prompts, ``stream: true``, ``raw_output: true``,
``logprobs: true``, and reads ``raw_output.completion_token_ids`` and one
``logprobs.content[].sampling_logprob`` per generated token from server-sent events ending with
``data: [DONE]`` (docs/wire.md#endpoints-and-encodings). A non-streamed request gets the same choices
as one JSON object.

**Seeds.** A request's ``seed`` names a random stream of the local trainer
(`runner._seeds.decode_wire_seed`): ``(seed, row)``, the stream that completion has in the
local backend's ``sample(prompts, seed=seed)`` (its ``n`` completions: rows ``row..row+n-1``).
Equal seeds give equal completions (as a seeded deployment does); a request without a seed gets
a fresh random stream. Requests that arrive together with the same weights, seed, length and
temperature are answered from one `LocalTrainer.sample` call (`Coalescer`, then the server's
sampling batcher), so the runner's per-sample requests reproduce its local run exactly.

The model is ``accounts/<account>/deployments/<id>`` (the deployment's hot-loaded snapshot, its
base model's initial weights before any hot load) or a served base model's name.

Not implemented (a user error says so): text prompts and stop strings (the server has no
tokenizer), ``top_p``/``top_k`` other than full-distribution sampling, top logprobs, images,
router replay, Parquet sampling references, ``echo_last``, and ``echo`` at temperatures other
than 0 and 1 (raw prompt logprobs are the model's, sampled ones are tempered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from runner._seeds import ROWS_PER_CALL, decode_wire_seed
from runner.serve._core import ServeError, Server, json_response, user_error
from runner.serve._engine import SampleJob, decode_seed

#: Fields a completions request may carry (anything else is refused, naming the field).
FIELDS = frozenset(
    {
        "model",
        "prompt",
        "n",
        "max_tokens",
        "temperature",
        "stream",
        "perf_metrics_in_response",
        "raw_output",
        "logprobs",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "echo",
        "prompt_cache_key",
        "return_token_ids",
        "user",
    }
)
MAX_N = 128


@dataclasses.dataclass
class Wanted:
    """One completions request waiting for its samples."""

    sampler_id: str
    prompt: np.ndarray
    base_seed: int
    index: int
    n: int
    max_tokens: int
    temperature: float
    echo: bool
    future: asyncio.Future
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    dispatched: float | None = None

    @property
    def key(self) -> tuple:
        return (self.sampler_id, self.base_seed, self.max_tokens, self.temperature)


class Coalescer:
    """Groups the completions requests that arrive together into the server's sampling jobs.

    After the first pending request, waits until none has arrived for the server's
    ``sample_incomplete_quiet_s`` (the requests of one call carry no count of their siblings;
    at most ``sample_max_wait_s``); then each group of requests with equal weights, call seed,
    ``max_tokens`` and temperature becomes one `SampleJob` per row (equal requests share one),
    and the batcher runs the group as one
    `LocalTrainer.sample` call.
    """

    def __init__(self, server: Server) -> None:
        self.server = server
        self._pending: list[Wanted] = []
        self._arrivals = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def submit(self, wanted: Wanted) -> None:
        self._pending.append(wanted)
        self._arrivals += 1
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        assert self._wake is not None
        self._wake.set()

    async def _loop(self) -> None:
        assert self._wake is not None
        cfg = self.server.config
        quiet_s = getattr(cfg, "sample_incomplete_quiet_s", cfg.sample_quiet_s)
        while True:
            await self._wake.wait()
            start = time.monotonic()
            while True:
                seen = self._arrivals
                await asyncio.sleep(quiet_s)
                if self._arrivals == seen or time.monotonic() - start >= cfg.sample_max_wait_s:
                    break
            pending, self._pending = self._pending, []
            self._wake.clear()
            groups: dict[tuple, list[Wanted]] = {}
            for w in pending:
                if not w.future.done():
                    groups.setdefault(w.key, []).append(w)
            for items in groups.values():
                self._dispatch(items)

    def _dispatch(self, items: list[Wanted]) -> None:
        prompts: dict[tuple, list[Wanted]] = {}
        for w in items:
            prompts.setdefault((w.index, w.prompt.tobytes()), []).append(w)
        first = items[0]
        now = time.monotonic()
        for w in items:
            w.dispatched = now
        for members in prompts.values():
            job = SampleJob(
                sampler_id=first.sampler_id,
                prompt=members[0].prompt,
                num_samples=max(w.n for w in members),
                max_tokens=first.max_tokens,
                temperature=first.temperature,
                base_seed=first.base_seed,
                index=members[0].index,
                stops=(),
                prompt_logprobs=any(w.echo for w in members),
            )
            job.done = lambda samples, plp, ws=members: _deliver(ws, samples, plp)
            job.failed = lambda err, ws=members: _fail(ws, err)
            self.server.batcher.submit(job)


def _deliver(members: list[Wanted], samples: list[Any], plp: np.ndarray | None) -> None:
    for w in members:
        if not w.future.done():
            w.future.set_result((samples[: w.n], plp))


def _fail(members: list[Wanted], err: ServeError) -> None:
    for w in members:
        if not w.future.done():
            w.future.set_exception(err)


def _int(body: dict, name: str, default: Any, low: int, high: int | None = None) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise user_error(f"completions: {name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise user_error(f"completions: {name} must be <= {high}, got {value}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise user_error(f"completions: {name} must be a finite number, got {value!r}")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise user_error(f"completions: {name} must be true or false, got {value!r}")
    return value


class SamplingRoutes:
    """The completions endpoint of the Fireworks flavour (one `Coalescer` per server)."""

    routes = {"fw_completions": ("POST", "/inference/v1/completions")}

    def __init__(self, control: Any) -> None:
        self.control = control
        self.handlers = {"fw_completions": self.completions}
        self._coalescers: dict[int, Coalescer] = {}

    def _coalescer(self, server: Server) -> Coalescer:
        c = self._coalescers.get(id(server))
        if c is None:
            c = self._coalescers[id(server)] = Coalescer(server)
        return c

    async def completions(self, server: Server, request: web.Request) -> web.StreamResponse:
        body = await server.json(request)
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise user_error(
                f"completions: field(s) {unknown} are not supported by the local server"
            )
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            raise user_error(
                "completions: text prompts need a tokenizer, which the server does not have; send "
                "token ids (a list of integers)"
            )
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            raise user_error(
                "completions: prompt must be a non-empty list of non-negative token ids"
            )
        n = _int(body, "n", 1, 1, MAX_N)
        max_tokens = _int(body, "max_tokens", 1024, 1)
        temperature = _number(body, "temperature", 1.0)
        if temperature < 0:
            raise user_error(f"completions: temperature must be >= 0, got {temperature}")
        stream = _bool(body, "stream", False)
        echo = _bool(body, "echo", False)
        for name in ("raw_output", "perf_metrics_in_response", "return_token_ids"):
            _bool(body, name, False)
        logprobs = body.get("logprobs", False)
        if logprobs not in (True, False, None, 0, 1) or isinstance(logprobs, float):
            raise user_error("completions: logprobs must be true or false (no top logprobs)")
        if _number(body, "top_p", 1.0) != 1.0:
            raise user_error("completions: top_p other than 1 is not implemented")
        if body.get("top_k", 0) not in (0, -1):
            raise user_error("completions: top_k other than 0 (off) is not implemented")
        if body.get("stop") not in (None, [], ""):
            raise user_error(
                "completions: stop sequences need a tokenizer, which the server does not have; "
                "cut completions at stop tokens on the client"
            )
        if echo and temperature not in (0.0, 1.0):
            raise user_error("completions: echo is implemented at temperature 0 and 1 only")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise user_error(f"completions: seed must be a non-negative integer, got {seed!r}")
        if seed is None:
            base_seed, index = decode_seed(None)
        else:
            base_seed, index = decode_wire_seed(seed)
            if base_seed >= 2**32:
                raise user_error(f"completions: seed {seed} decodes to a base seed >= 2**32")
        if index + n > ROWS_PER_CALL:
            raise user_error(f"completions: the seed's row + n exceeds {ROWS_PER_CALL}")
        sampler_id = await self.control.sampler_for(server, body.get("model"))
        entry = server.engine.sampler(sampler_id)
        arr = np.asarray(prompt, np.int64)
        if arr.max() >= 2**31:
            raise user_error("completions: prompt token id too large")
        arr = arr.astype(np.int32)
        probe = SampleJob(sampler_id, arr, n, max_tokens, temperature, base_seed, index, ())
        server.engine.check_sample(entry, probe)
        fut = asyncio.get_running_loop().create_future()
        wanted = Wanted(sampler_id, arr, base_seed, index, n, max_tokens, temperature, echo, fut)
        self._coalescer(server).submit(wanted)
        samples, plp = await fut
        started = wanted.dispatched or wanted.arrived
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        choices = [
            _choice(k, s, prompt, plp if echo else None, temperature) for k, s in enumerate(samples)
        ]
        completion_tokens = sum(len(s.tokens) for s in samples)
        reply = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
        }
        if not stream:
            return json_response(reply)
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for choice in choices:
            chunk = {k: v for k, v in reply.items() if k != "usage"}
            chunk["choices"] = [choice]
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        # The serving stack's timing (the SDK's concurrency controller reads the prefill queue).
        perf = {
            "prefill-queue-duration": f"{started - wanted.arrived:.6f}",
            "generation-queue-duration": "0.0",
            "num-concurrent-requests": str(len(self._coalescer(server)._pending) + 1),
        }
        tail = {
            "id": rid,
            "object": "text_completion",
            "choices": [],
            "usage": reply["usage"],
            "perf_metrics": perf,
        }
        await response.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _choice(k: int, s: Any, prompt: list[int], plp: np.ndarray | None, temperature: float):
    tokens = [int(t) for t in s.tokens]
    lps = [float(x) for x in np.asarray(s.logprobs, np.float32)]
    raw = temperature in (0.0, 1.0)  # the local sampler's logprobs are the model's there
    content = []
    ids = list(tokens)
    if plp is not None:
        ids = [*prompt, *tokens]
        content.append({"token_id": int(prompt[0]), "logprob": 0.0, "sampling_logprob": None})
        for i in range(1, len(prompt)):
            content.append(
                {"token_id": int(prompt[i]), "logprob": float(plp[i]), "sampling_logprob": None}
            )
    for t, lp in zip(tokens, lps, strict=True):
        entry: dict[str, Any] = {"token_id": t, "sampling_logprob": lp}
        if raw:
            entry["logprob"] = lp
        content.append(entry)
    return {
        "index": k,
        "text": "",
        "finish_reason": "stop" if s.stop_reason == "stop" else "length",
        "logprobs": {"content": content},
        "raw_output": {"completion_token_ids": ids, "prompt_token_ids": list(prompt)},
    }
