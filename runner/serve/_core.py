"""The local server's flavour-independent core: errors, bodies, futures, ordered model queues,
sessions, authentication, request logging, routing and dispatch to an SDK flavour.

An SDK *flavour* (`Flavour`; tinker 0.38 in `runner.serve._tinker`) turns one SDK's requests
into work on the server's state (`Server`) and encodes its replies. The core owns everything both
SDKs share:

- **Errors.** A handler raises `ServeError` (`user_error` for bad input); the error middleware
  answers ``{"error": message, "category": "user"|"server"}`` with the error's status (4xx for
  bad input, never a 5xx: a 5xx makes the SDKs retry for minutes). A future that fails carries
  the same shape in its ``retrieve_future`` reply (`ServerFuture.fail`).
- **Bodies.** `read_body` enforces the size limit (also after zstd decompression) and
  `parse_model` validates JSON with the SDK's own pydantic models, dropping (and reporting)
  fields the model does not know (docs/wire.md#lenient-parsing) before any other rule.
- **Futures.** `FutureStore` holds every submitted request's result; `retrieve` long-polls for
  at most ``ServeConfig.long_poll_s`` (< 45 s, the SDKs' timeout), then answers ``try_again``.
- **Ordering.** `OrderedQueue` runs a model's requests strictly in ``seq_id`` order, without
  gaps (a later seq_id waits for the missing ones), acknowledges every submission at once, and
  de-duplicates on ``(model, seq_id)``: a resubmission returns the first submission's future.
- **Sessions** (`Session`), **authentication** (constant-time API-key comparison, `X-API-Key`
  or ``Authorization: Bearer``) and **request logging** (method, path, status, time; never
  headers or bodies) are middlewares.
- **Routing.** Every endpoint (`ENDPOINTS`) is served bare and under each of
  ``ServeConfig.prefixes``; a request goes to the flavour that claims it (`Flavour.claims`),
  else to the default flavour, among those with a handler for the endpoint.

The server's state lives on one asyncio loop; blocking work (the JAX trainer) runs in
`Server.run_blocking`'s thread pool.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import pydantic
from aiohttp import web

from runner._json import JsonError
from runner._json import loads as strict_json
from runner._limits import MIN_API_KEY_CHARS, SERVE_LIMITS

log = logging.getLogger("runner.serve")

CATEGORIES = ("user", "server")
PROTO_CONTENT_TYPE = "application/x-protobuf"
#: The Fireworks SDK's training prefixes (docs/wire.md#configuration): every endpoint is
#: also served under them, so a base URL with either prefix reaches the same server.
DEFAULT_PREFIXES = (
    "/training/v1/serverless",
    "/training/v1/rlorTrainerJobs/{account}/{job}",
)


# -- errors -------------------------------------------------------------------------------------


class ServeError(Exception):
    """A request the server refuses or a job that failed, in the SDKs' error shape.

    Attributes:
      message: one line for the client (no secrets, no request bodies).
      status: the HTTP status of a direct reply (4xx for bad input).
      category: ``"user"`` (the request is wrong) or ``"server"`` (the server failed).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        category: str = "user",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"ServeError.category must be one of {CATEGORIES}, got {category!r}")
        super().__init__(message)
        self.message = message
        self.status = status
        self.category = category
        self.headers = dict(headers or {})

    def body(self) -> dict[str, str]:
        return {"error": self.message, "category": self.category}


def user_error(message: str, status: int = 400) -> ServeError:
    """A bad request (``category: "user"``)."""
    return ServeError(message, status=status, category="user")


def json_response(data: Any, status: int = 200, headers: Mapping[str, str] | None = None):
    return web.Response(
        body=json.dumps(data, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(err: ServeError) -> web.Response:
    return json_response(err.body(), status=err.status, headers=err.headers)


# -- bodies -------------------------------------------------------------------------------------


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, decompressed when ``Content-Encoding: zstd``, at most ``limit`` bytes.

    Raises:
      ServeError: 413 for a body (or its decompression) over the limit; 400 for a corrupt zstd
        body or another content encoding.
    """
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    if len(raw) > limit:
        raise _too_large(limit)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding != "zstd":
        raise user_error(f"unsupported Content-Encoding {encoding!r} (the server takes zstd)")
    import zstandard

    try:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise user_error(f"corrupt zstd body: {exc}") from None
    if len(out) > limit:
        raise _too_large(limit, "decompressed ")
    return out


def _too_large(limit: int, what: str = "") -> ServeError:
    return user_error(f"{what}request body exceeds the server's limit of {limit} bytes", 413)


def json_body(raw: bytes) -> dict[str, Any]:
    """A JSON object body (raises a user error naming the problem)."""
    try:
        data = strict_json(raw) if raw else {}
    except JsonError as exc:
        raise user_error(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise user_error(f"request body must be a JSON object, got {type(data).__name__}")
    return data


def parse_model(cls: type[pydantic.BaseModel], data: Any, *, what: str) -> tuple[Any, list[str]]:
    """Validates ``data`` with an SDK pydantic model, leniently for unknown fields.

    Fields the (strict, ``extra="forbid"``) model does not declare are dropped and returned
    (dotted paths), the SDKs' own extras included (docs/wire.md#lenient-parsing); every other
    rule of the model applies.

    Returns:
      ``(model instance, dropped field paths)``.

    Raises:
      ServeError: a user error naming ``what``, the field and the rule.
    """
    data = _deepcopy_json(data)
    dropped: list[str] = []
    for _ in range(16):
        try:
            return cls.model_validate(data), dropped
        except pydantic.ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            extras = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
            if not extras:
                raise user_error(f"{what}: {_describe(errors)}") from None
            for loc in extras:
                path = _drop(data, loc)
                if path is None:  # cannot locate it: report the error as it is
                    raise user_error(f"{what}: {_describe(errors)}") from None
                dropped.append(path)
    raise user_error(f"{what}: too many unknown fields")


def _deepcopy_json(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy_json(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy_json(v) for v in data]
    return data


def _drop(data: Any, loc: Sequence[Any]) -> str | None:
    """Deletes the field at a pydantic error location (union tags in it are skipped)."""
    node, path = data, []
    for i, key in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict):
            if key not in node:
                continue  # a discriminated-union tag (e.g. "encoded_text"), not a field
            if last:
                del node[key]
                return ".".join(map(str, [*path, key]))
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return None
        path.append(key)
    return None


def _describe(errors: Sequence[Mapping[str, Any]], most: int = 3) -> str:
    parts = []
    for e in errors[:most]:
        loc = ".".join(str(x) for x in e.get("loc", ())) or "(body)"
        parts.append(f"field '{loc}': {e.get('msg', 'invalid')}")
    more = f" (and {len(errors) - most} more)" if len(errors) > most else ""
    return "; ".join(parts) + more


# -- futures ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Payload:
    """A future's result: a JSON object and/or protobuf bytes (the reply picks by ``Accept``)."""

    json: Any = None
    proto: bytes | None = None

    def response(self, accept: str) -> web.Response:
        if self.proto is not None and (PROTO_CONTENT_TYPE in accept or self.json is None):
            return web.Response(body=self.proto, content_type=PROTO_CONTENT_TYPE)
        return json_response(self.json if self.json is not None else {})


class ServerFuture:
    """One submitted request: pending until `complete` or `fail` (first wins)."""

    def __init__(self, request_id: str, kind: str) -> None:
        self.request_id = request_id
        self.kind = kind
        self.created = time.monotonic()
        self.finished: float | None = None
        self.payload: Payload | None = None
        self.error: ServeError | None = None
        self.expiring = False  # listed in its store's expiry queue (`FutureStore.get`)
        self._event = asyncio.Event()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def complete(self, payload: Payload) -> None:
        if not self.done:
            self.payload = payload
            self._finish()

    def fail(self, error: ServeError) -> None:
        if not self.done:
            self.error = error
            self._finish()

    def _finish(self) -> None:
        self.finished = time.monotonic()
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return False
        return True


class FutureStore:
    """Every submitted request's future, by request id; finished ones expire after ``ttl_s``."""

    def __init__(self, ttl_s: float = 3600.0) -> None:
        self.ttl_s = ttl_s
        self._futures: dict[str, ServerFuture] = {}
        self._finished: collections.deque[ServerFuture] = collections.deque()

    def create(self, kind: str) -> ServerFuture:
        self._sweep()
        fut = ServerFuture(f"req-{uuid.uuid4().hex}", kind)
        self._futures[fut.request_id] = fut
        return fut

    def completed(self, kind: str, payload: Payload) -> ServerFuture:
        fut = self.create(kind)
        fut.complete(payload)
        return fut

    def get(self, request_id: str) -> ServerFuture:
        fut = self._futures.get(request_id)
        if fut is None:
            # 410 "gone": the SDKs resubmit a sample on it, and a training call fails cleanly.
            raise ServeError(
                f"unknown or expired request_id {request_id!r} (the server may have restarted)",
                status=410,
            )
        if fut.done and not fut.expiring:  # a flag, not a scan of the queue: O(1) per retrieve
            fut.expiring = True
            self._finished.append(fut)
        return fut

    def _sweep(self) -> None:
        now = time.monotonic()
        while self._finished and now - (self._finished[0].finished or now) > self.ttl_s:
            self._futures.pop(self._finished.popleft().request_id, None)

    def __len__(self) -> int:
        return len(self._futures)


#: `Server.complete_later`'s running tasks.
_BACKGROUND: set[asyncio.Task] = set()


def try_again_body(request_id: str) -> dict[str, Any]:
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}


async def retrieve(store: FutureStore, request_id: str, accept: str, wait_s: float):
    """The ``retrieve_future`` reply: the result, the error, or ``try_again`` after ``wait_s``."""
    fut = store.get(request_id)
    if not fut.done:
        await fut.wait(wait_s)
    if not fut.done:
        return json_response(try_again_body(request_id))
    store.get(request_id)  # (records it as finished for expiry)
    if fut.error is not None:
        return json_response(fut.error.body())
    assert fut.payload is not None
    return fut.payload.response(accept)


# -- ordered per-model execution ----------------------------------------------------------------

#: A unit of ordered work: blocking (runs in the server's thread pool) and returns the result.
Job = Callable[[], Payload]


class OrderedQueue:
    """Strict ``seq_id`` order for one model, with de-duplication (wire-protocol §1.6).

    `submit` returns at once (the SDKs need the ACK before they send the rest; tinker sends a
    call's chunks 2..n before chunk 1). The worker runs seq ``next_seq``, then the next, never
    skipping a missing id; a job given as a `ServeError` (a request that failed validation but
    named its seq_id) fails its future in its turn and consumes the id, so later ids still run.

    Args:
      name: the model id (for logs).
      run: awaits one blocking job (`Server.run_blocking`).
      first_seq: the first seq_id the client will send (1 for the tinker SDK).
    """

    def __init__(
        self,
        name: str,
        run: Callable[[Job], Awaitable[Payload]],
        futures: FutureStore,
        first_seq: int = 1,
    ) -> None:
        self.name = name
        self.next_seq = first_seq
        self._run = run
        self._futures = futures
        self._pending: dict[int, tuple[ServerFuture, Job | ServeError]] = {}
        self._seen: dict[int, ServerFuture] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # The latest new seq_ids in arrival order and in execution order (tests read these).
        self.arrived: collections.deque[int] = collections.deque(maxlen=4096)
        self.executed: collections.deque[int] = collections.deque(maxlen=4096)
        self.closed = False

    def submit(self, seq_id: int, kind: str, job: Job | ServeError) -> ServerFuture:
        """The future of ``seq_id`` (the first submission's, on a resubmission)."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise user_error(f"seq_id must be an integer, got {seq_id!r}")
        seen = self._seen.get(seq_id)
        if seen is not None:
            return seen
        if seq_id < self.next_seq:
            raise user_error(
                f"model {self.name}: seq_id {seq_id} was already executed or skipped (the next "
                f"expected seq_id is {self.next_seq})"
            )
        fut = self._futures.create(kind)
        self._seen[seq_id] = fut
        self._pending[seq_id] = (fut, job)
        self.arrived.append(seq_id)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._worker())
        self._wake.set()
        return fut

    @property
    def waiting_for(self) -> int | None:
        """The missing seq_id the queue waits for (None when idle or running)."""
        return self.next_seq if self._pending and self.next_seq not in self._pending else None

    async def _worker(self) -> None:
        while not self.closed:
            item = self._pending.pop(self.next_seq, None)
            if item is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            fut, job = item
            seq = self.next_seq
            if isinstance(job, ServeError):
                fut.fail(job)
            else:
                try:
                    fut.complete(await self._run(job))
                except ServeError as err:
                    fut.fail(err)
                except ValueError as exc:  # the trainer's rules: bad input
                    fut.fail(user_error(_one_line(exc)))
                except Exception as exc:  # noqa: BLE001 - a server bug; reported, not raised
                    log.exception("model %s seq_id %d failed", self.name, seq)
                    fut.fail(
                        ServeError(
                            f"internal error: {type(exc).__name__}: {_one_line(exc)}",
                            category="server",
                        )
                    )
            self.executed.append(seq)
            self.next_seq = seq + 1
            self._prune(seq)

    def _prune(self, seq: int, keep: int = 4096) -> None:
        if len(self._seen) > 2 * keep:
            for old in [s for s in self._seen if s < seq - keep]:
                del self._seen[old]

    def close(self) -> None:
        self.closed = True
        self._wake.set()
        for fut, _ in self._pending.values():
            fut.fail(ServeError("the model was unloaded", category="user", status=410))
        self._pending.clear()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class BoundedMap(collections.OrderedDict):
    """A dict that forgets its oldest entries beyond ``maxsize``."""

    def __init__(self, maxsize: int = 65536) -> None:
        super().__init__()
        self.maxsize = maxsize

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self) > self.maxsize:
            self.popitem(last=False)


# -- sessions -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Session:
    """One SDK session (`Server.sessions`)."""

    session_id: str
    flavour: str
    sdk_version: str
    created: float = dataclasses.field(default_factory=time.time)
    last_heartbeat: float = dataclasses.field(default_factory=time.monotonic)
    finished: str | None = None  # the finish reason once the client closed it
    model_seq: dict[int, str] = dataclasses.field(default_factory=dict)  # model_seq_id → request
    key: int = 0  # which of the server's API keys created it (`KEY_INDEX`)
    sampler_seq: dict[int, str] = dataclasses.field(default_factory=dict)  # sampler seq → sampler


# -- flavours and routing -----------------------------------------------------------------------

#: ``endpoint name → (method, path)``, the paths both SDKs share (docs/wire.md#endpoints-and-encodings). A flavour
#: may serve extra endpoints of its own (`Flavour.extra_routes`).
ENDPOINTS: dict[str, tuple[str, str]] = {
    "healthz": ("GET", "/api/v1/healthz"),
    "get_server_capabilities": ("GET", "/api/v1/get_server_capabilities"),
    "client_config": ("POST", "/api/v1/client/config"),
    "dynamic_config": ("POST", "/api/v1/client/dynamic_config"),
    "create_session": ("POST", "/api/v1/create_session"),
    "session_heartbeat": ("POST", "/api/v1/session_heartbeat"),
    "telemetry": ("POST", "/api/v1/telemetry"),
    "finish_session": ("POST", "/api/v1/sessions/{session_id}/finish"),
    "retrieve_future": ("POST", "/api/v1/retrieve_future"),
    "create_model": ("POST", "/api/v1/create_model"),
    "get_info": ("POST", "/api/v1/get_info"),
    "forward_backward": ("POST", "/api/v1/forward_backward"),
    "forward": ("POST", "/api/v1/forward"),
    "optim_step": ("POST", "/api/v1/optim_step"),
    "save_weights": ("POST", "/api/v1/save_weights"),
    "load_weights": ("POST", "/api/v1/load_weights"),
    "save_weights_for_sampler": ("POST", "/api/v1/save_weights_for_sampler"),
    "list_checkpoints": ("GET", "/api/v1/list_checkpoints"),
    "training_run_checkpoints": ("GET", "/api/v1/training_runs/{model_id}/checkpoints"),
    "create_sampling_session": ("POST", "/api/v1/create_sampling_session"),
    "get_sampler": ("GET", "/api/v1/samplers/{sampler_id}"),
    "asample": ("POST", "/api/v1/asample"),
    "unload_model": ("POST", "/api/v1/unload_model"),
}

#: ``(server, request) -> response``: a flavour's handler of one endpoint.
Handler = Callable[["Server", web.Request], Awaitable[web.StreamResponse]]


class Flavour(Protocol):
    """One SDK's encodings and handlers (`runner.serve._tinker.TinkerFlavour`).

    Attributes:
      name: the flavour's name (``"tinker"``), recorded on its sessions.
      handlers: endpoint name (a key of `ENDPOINTS`, or of `extra_routes`) → `Handler`.
      extra_routes: the flavour's own endpoints: name → ``(method, path)``.
    """

    name: str
    handlers: Mapping[str, Handler]
    extra_routes: Mapping[str, tuple[str, str]]

    def claims(self, request: web.Request) -> bool:
        """Whether the request comes from this flavour's SDK (e.g. by its User-Agent)."""
        ...


# -- the server ---------------------------------------------------------------------------------


#: `ServeConfig` limit → the ``python -m runner serve`` flag that sets it.
LIMIT_FLAGS = {name: flag for name, (flag, _, _) in SERVE_LIMITS.items()}


def over_limit(config: Any, name: str, what: str, value: int) -> None:
    """A 400 naming the limit and its flag when ``value`` exceeds ``config.<name>``."""
    limit = getattr(config, name)
    if value > limit:
        raise user_error(
            f"{what} is {value}, over this server's limit of {limit} (start the server with "
            f"{LIMIT_FLAGS[name]} N to raise it)"
        )


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Server settings (the ``python -m runner serve`` flags and test knobs).

    Attributes:
      api_key: the key clients must send (``X-API-Key`` or ``Authorization: Bearer``).
      extra_api_keys: further keys the server also accepts (the tinker SDK requires a ``tml-``
        key, the Fireworks SDK's managed path a key that is not ``tml-``: one server serves
        both SDKs with one key each).
      state_dir: where models' checkpoints live (survives restarts).
      max_body_bytes: the request body limit (after decompression).
      long_poll_s: how long ``retrieve_future`` waits before ``try_again`` (< 45 s).
      prefixes: path prefixes every endpoint is also served under.
      client_config: the ``/client/config`` flags sent to the tinker SDK (docs/wire.md#client-architecture).
      sample_quiet_s / sample_incomplete_quiet_s / sample_max_wait_s: the sampling batcher's
        coalescing windows (`runner.serve._engine.SampleBatcher`).
      workers: threads for blocking work (training jobs, sampling, loads).
      max_samples / max_sample_tokens / max_batch_rows / max_sessions / max_models: the bounds
        on what one client may ask for (`LIMIT_FLAGS` names each one's ``serve`` flag): samples
        per sampling request; tokens per sampling request (prompt + samples × max_tokens);
        sequences per forward / forward_backward; live sessions per API key; training models
        per API key. A request over one is a 400 naming the limit and its flag.
      max_loss_nodes: the most nodes a custom-loss graph may have (``--max-loss-nodes``).
    """

    api_key: str
    state_dir: str
    extra_api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 64 * 1024 * 1024
    long_poll_s: float = 20.0
    prefixes: tuple[str, ...] = DEFAULT_PREFIXES
    client_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sample_quiet_s: float = 0.002
    sample_incomplete_quiet_s: float = 0.1
    sample_max_wait_s: float = 1.0
    workers: int = 4
    max_samples: int = SERVE_LIMITS["max_samples"][1]
    max_sample_tokens: int = SERVE_LIMITS["max_sample_tokens"][1]
    max_batch_rows: int = SERVE_LIMITS["max_batch_rows"][1]
    max_sessions: int = SERVE_LIMITS["max_sessions"][1]
    max_models: int = SERVE_LIMITS["max_models"][1]
    max_loss_nodes: int = 4096
    #: Test only: ``"skyrl"`` makes ``forward_backward`` normalise as SkyRL tx's does (each
    #: datum's loss ÷ ``max(Σw, 1e-9)``, ``w`` = its weights, all ones for the policy kernels;
    #: mean over datums; no ``loss:sum``), so that tests can check that the runner refuses such
    #: a server (`runner._semantics`). ``""``: our kernels' token sums.
    test_cross_entropy: str = ""

    def __post_init__(self) -> None:
        for key in (self.api_key, *self.extra_api_keys):
            if not isinstance(key, str) or len(key.strip()) < MIN_API_KEY_CHARS:
                raise ValueError(
                    f"the server's API key must be at least {MIN_API_KEY_CHARS} characters (a "
                    "short key can be guessed; e.g. tml-$(openssl rand -hex 16))"
                )
        for name in LIMIT_FLAGS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{LIMIT_FLAGS[name]} must be an integer >= 1, got {value!r}")
        if not 0 < self.long_poll_s < 45:
            raise ValueError(f"ServeConfig.long_poll_s must be in (0, 45), got {self.long_poll_s}")
        if self.max_body_bytes < 1024:
            raise ValueError("ServeConfig.max_body_bytes must be >= 1024")
        if not 1 <= self.max_loss_nodes <= 1_000_000:
            raise ValueError("ServeConfig.max_loss_nodes must be in [1, 1000000]")

    def __repr__(self) -> str:  # never print the key
        return f"ServeConfig(state_dir={self.state_dir!r}, long_poll_s={self.long_poll_s})"


class Server:
    """The server's state, shared by the flavours: sessions, models, futures, samplers.

    Flavour handlers reach everything through it: `run_blocking` (the thread pool),
    `futures`, `sessions`, `queue` (a model's `OrderedQueue`), `engine` (the models and
    samplers, `runner.serve._engine.Engine`), and `body` / `json` (the request body, size
    limit applied).
    """

    def __init__(
        self,
        config: ServeConfig,
        engine: Any,
        flavours: Sequence[Flavour],
        make_batcher: Callable[[Server], Any] | None = None,
    ) -> None:
        if not flavours:
            raise ValueError("Server needs at least one flavour")
        self.config = config
        self.engine = engine
        self.flavours = list(flavours)
        self._ranked: dict[str, tuple[list[Flavour], Flavour]] = {}  # `flavour_for`, per endpoint
        self.futures = FutureStore()
        self.sessions: dict[str, Session] = {}
        self.queues: dict[str, OrderedQueue] = {}
        self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="serve")
        self.counters: collections.Counter[str] = collections.Counter()
        #: Unordered requests already seen, by a flavour's key (a resubmission gets the future).
        self.dedup: BoundedMap = BoundedMap()
        #: Custom losses by loss id: ``(session_id, runner.serve._graph.Program)``.
        self.custom_losses: dict[str, tuple[str, Any]] = {}
        #: The sampling batcher (`runner.serve._engine.SampleBatcher`), built for this server.
        self.batcher = make_batcher(self) if make_batcher is not None else None

    # -- services for flavours ---------------------------------------------------------------

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def complete_later(
        self, fut: ServerFuture, build: Callable[[], Any], done: Callable[[Any], None]
    ) -> None:
        """Runs ``build`` off the loop, in the background; then ``done(result)`` completes ``fut``.

        A `ServeError` fails the future as it is, a ``ValueError`` as a user error (its first
        line): the client reads either from ``retrieve_future``.
        """

        async def run() -> None:
            try:
                result = await self.run_blocking(build)
            except ServeError as err:
                fut.fail(err)
            except ValueError as exc:
                fut.fail(user_error(str(exc).splitlines()[0]))
            else:
                done(result)

        task = asyncio.get_running_loop().create_task(run())
        _BACKGROUND.add(task)  # a reference until it ends (the loop keeps only weak ones)
        task.add_done_callback(_BACKGROUND.discard)

    async def body(self, request: web.Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    async def json(self, request: web.Request) -> dict[str, Any]:
        return json_body(await self.body(request))

    def new_session(self, flavour: str, sdk_version: str, request: Any = None) -> Session:
        key = request.get(KEY_INDEX, 0) if request is not None else 0
        live = sum(1 for s in self.sessions.values() if s.key == key and s.finished is None)
        over_limit(self.config, "max_sessions", "the live sessions of this API key", live + 1)
        session = Session(f"sess-{uuid.uuid4().hex[:20]}", flavour, sdk_version, key=key)
        self.sessions[session.session_id] = session
        return session

    def check_new_model(self, session: Session) -> None:
        """A 400 when ``session``'s API key already has `ServeConfig.max_models` models."""
        models = sum(len(s.model_seq) for s in self.sessions.values() if s.key == session.key)
        over_limit(self.config, "max_models", "the training models of this API key", models + 1)

    def session(self, session_id: Any, *, live: bool = True) -> Session:
        """The session, or a user error (410 for one that finished)."""
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise user_error(
                f"unknown session_id {session_id!r} (the server may have restarted: create a "
                "new client)",
                404,
            )
        if live and session.finished is not None:
            raise user_error(f"session {session_id} has finished ({session.finished})", 410)
        return session

    def queue(self, model_id: Any) -> OrderedQueue:
        """The ordered queue of a loaded model (a 404 user error for an unknown model)."""
        queue = self.queues.get(model_id) if isinstance(model_id, str) else None
        if queue is None:
            raise user_error(f"unknown model_id {model_id!r} (not loaded on this server)", 404)
        return queue

    def add_queue(self, model_id: str) -> OrderedQueue:
        queue = OrderedQueue(model_id, self._run_job, self.futures)
        self.queues[model_id] = queue
        return queue

    async def _run_job(self, job: Job) -> Payload:
        return await self.run_blocking(job)

    async def close(self) -> None:
        for queue in self.queues.values():
            queue.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- dispatch -----------------------------------------------------------------------------

    def flavour_for(self, request: web.Request, endpoint: str) -> Flavour:
        ranked = self._ranked.get(endpoint)
        if ranked is None:
            candidates = [f for f in self.flavours if endpoint in f.handlers]
            if not candidates:
                raise user_error(f"endpoint {endpoint} is not implemented by this server", 404)
            # A flavour with a narrower claim (a higher ``claim_priority``, e.g. the Fireworks
            # SDK's ``AsyncTinker/Python 0.23`` against tinker's ``AsyncTinker/``) is asked
            # first; with no claim, the first flavour serving the endpoint.
            order = sorted(candidates, key=lambda f: -getattr(f, "claim_priority", 0))
            ranked = self._ranked[endpoint] = (order, candidates[0])
        order, default = ranked
        for flavour in order:
            if flavour.claims(request):
                return flavour
        return default

    def routes(self) -> dict[str, tuple[str, str]]:
        routes = dict(ENDPOINTS)
        for flavour in self.flavours:
            for name, route in flavour.extra_routes.items():
                if routes.setdefault(name, route) != route:
                    raise ValueError(f"flavour {flavour.name}: endpoint {name} conflicts")
        return routes


# -- middlewares and the application ------------------------------------------------------------

SERVER_KEY = web.AppKey("server", Server)


def _presented_key(request: web.Request) -> str | None:
    key = request.headers.get("X-API-Key")
    if key:
        return key
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return None


#: The request item the auth middleware sets: the index of the key it presented.
KEY_INDEX = web.RequestKey("foldloss.key_index", int)


def auth_middleware(api_key: str, *extra_keys: str):
    expected = [k.encode() for k in (api_key, *extra_keys)]

    @web.middleware
    async def middleware(request: web.Request, handler):
        presented = _presented_key(request)
        if presented is None:
            raise ServeError("missing API key (send it in the X-API-Key header)", status=401)
        given = presented.encode()
        # every key is compared (constant time each), whichever matches
        matches = [hmac.compare_digest(given, key) for key in expected]
        if not any(matches):
            raise ServeError("invalid API key", status=401)
        request[KEY_INDEX] = matches.index(True)
        return await handler(request)

    return middleware


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ServeError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        category = "user" if exc.status < 500 else "server"
        return error_response(
            ServeError(exc.reason or "error", status=exc.status, category=category)
        )
    except Exception as exc:  # noqa: BLE001 - a bug: one line to the client, the trace in the log
        log.exception("%s %s failed", request.method, request.path)
        return error_response(
            ServeError(f"internal error: {type(exc).__name__}", status=500, category="server")
        )


@web.middleware
async def log_middleware(request: web.Request, handler):
    t0 = time.perf_counter()
    response = None
    try:
        response = await handler(request)
        return response
    finally:
        status = response.status if response is not None else 500
        # Method, path and status only: never headers (the API key) or bodies (telemetry carries
        # request headers).
        log.info(
            "%s %s %d %.1f ms",
            request.method,
            request.path,
            status,
            1e3 * (time.perf_counter() - t0),
        )


def _route_handler(server: Server, endpoint: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        flavour = server.flavour_for(request, endpoint)
        server.counters[endpoint] += 1
        return await flavour.handlers[endpoint](server, request)

    return handle


def build_app(
    server: Server, *, middlewares: Iterable[Any] = (), on_cleanup: Iterable[Any] = ()
) -> web.Application:
    """The aiohttp application of ``server``.

    Middleware order: logging, errors, authentication, then ``middlewares`` (tests inject
    faults here), then the route's flavour handler.
    """
    app = web.Application(
        middlewares=[
            log_middleware,
            error_middleware,
            auth_middleware(server.config.api_key, *server.config.extra_api_keys),
            *middlewares,
        ],
        client_max_size=server.config.max_body_bytes + 4096,
    )
    app[SERVER_KEY] = server
    for prefix in ("", *server.config.prefixes):
        for endpoint, (method, path) in server.routes().items():
            app.router.add_route(method, prefix + path, _route_handler(server, endpoint))

    async def _close(app: web.Application) -> None:
        await server.close()

    app.on_cleanup.append(_close)
    for hook in on_cleanup:
        app.on_cleanup.append(hook)
    return app
