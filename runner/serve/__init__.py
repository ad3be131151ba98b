"""`runner.serve`: the local training server — `runner.local.LocalTrainer` behind the SDKs' wire.

``python -m runner serve`` (docs/serve.md) serves the main job's models — a config's ``[model]``
or a Hugging Face checkpoint directory, trained in full or through LoRA adapters — to the real,
unmodified tinker SDK (0.38: JSON plus protobuf for ``forward_backward`` and sampling results)
over loopback, so ``--backend tinker`` — and any third-party tinker code pointed at it with
``TINKER_BASE_URL`` — trains locally; and to the ``fireworks-ai`` training SDK (1.2.30: its JSON
training client, streamed completions and the control plane of its managed path), so
``--backend fireworks`` runs against it with only the base URL changed. Layout:

- `runner.serve._core`: the flavour-independent core (errors, bodies, futures with long-polling
  ``retrieve_future``, strict per-model ``seq_id`` order with de-duplication, sessions,
  authentication, request logging, prefixes, routing to a flavour);
- `runner.serve._engine`: models, checkpoints and sampling on `LocalTrainer`;
- `runner.serve._tinker`: the tinker flavour's endpoints and encodings;
- `runner.serve._fireworks` (training), `_fw_control` (accounts, trainer jobs, deployments,
  hot load, checkpoint rows, promotion) and `_fw_sampling` (completions): the Fireworks flavour.

`make_server` assembles them; `ServerThread` runs a server on a background thread (tests,
benchmarks); `serve_forever` is the command line's entry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from runner._gc import freeze_heap
from runner.serve._core import DEFAULT_PREFIXES, ServeConfig, ServeError, Server, build_app
from runner.serve._engine import (
    BaseModel,
    Engine,
    LoraRequest,
    SampleBatcher,
    base_model_from_checkpoint,
    base_model_from_config,
    load_base_model,
)

__all__ = [
    "DEFAULT_MODEL",
    "BaseModel",
    "LoraRequest",
    "ServeConfig",
    "ServeError",
    "Server",
    "ServerThread",
    "base_model_from_checkpoint",
    "base_model_from_config",
    "build_app",
    "load_base_model",
    "make_server",
    "parse_model_flags",
    "serve_forever",
]

#: With no ``--model``: the ``[model]`` of examples/default.toml, served under this name.
DEFAULT_MODEL = "foldloss/default"
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "default.toml"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")

log = logging.getLogger("runner.serve")


def parse_model_flags(flags: Sequence[str]) -> dict[str, BaseModel]:
    """``NAME=PATH`` flags as base models (none: examples/default.toml's as `DEFAULT_MODEL`).

    ``PATH`` is a main-job config file (its ``[model]``: `base_model_from_config`) or a Hugging
    Face checkpoint directory (Llama / Qwen2 / Qwen3: `base_model_from_checkpoint`).

    Raises:
      ValueError: a malformed flag, a repeated name, or a path that is not a valid config or a
        supported checkpoint directory (naming the flag and the path).
    """
    if not flags:
        return {DEFAULT_MODEL: base_model_from_config(DEFAULT_MODEL, DEFAULT_CONFIG)}
    models: dict[str, BaseModel] = {}
    for flag in flags:
        name, sep, path = flag.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--model expects NAME=CONFIG.toml or NAME=MODEL_DIR, got {flag!r}")
        if name in models:
            raise ValueError(f"--model {name!r} is given twice")
        models[name] = load_base_model(name, path)
    return models


def make_server(config: ServeConfig, base_models: Mapping[str, BaseModel]) -> Server:
    """A `Server` with the tinker flavour (the default), the Fireworks flavour (when the
    ``fireworks-ai`` SDK is installed), an `Engine` over ``base_models`` and a batcher."""
    from runner.serve._tinker import TinkerFlavour

    flavours: list[Any] = [TinkerFlavour()]
    try:
        from runner.serve._fireworks import FireworksFlavour
    except ImportError as exc:  # the fireworks extra is missing: serve the tinker SDK only
        log.info("Fireworks flavour off (%s)", exc)
    else:
        flavours.append(FireworksFlavour(config.state_dir))
    engine = Engine(base_models, config.state_dir)
    engine.limits = config
    engine.cross_entropy_mode = config.test_cross_entropy
    return Server(
        config,
        engine,
        flavours,
        make_batcher=lambda server: SampleBatcher(
            engine,
            server.run_blocking,
            quiet_s=config.sample_quiet_s,
            incomplete_quiet_s=config.sample_incomplete_quiet_s,
            max_wait_s=config.sample_max_wait_s,
        ),
    )


async def _start(app: Any, host: str, port: int):
    from aiohttp import web

    # A stop does not wait for long polls (clients re-poll; a restarted server answers 410).
    runner = web.AppRunner(
        app, auto_decompress=False, access_log=None, handle_signals=False, shutdown_timeout=2.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class ServerThread:
    """A server on a background thread (tests, benchmarks): ``with ServerThread(...) as s``.

    Args:
      config: the `ServeConfig`.
      base_models: the served base models.
      host / port: where to bind (port 0 = an ephemeral port; `url` tells which).
      middlewares: extra aiohttp middlewares after authentication (fault injection in tests).

    Attributes:
      url: ``http://host:port`` once started.
      server: the `Server` (its state, for tests).
    """

    def __init__(
        self,
        config: ServeConfig,
        base_models: Mapping[str, BaseModel],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        middlewares: Iterable[Any] = (),
    ) -> None:
        self.server = make_server(config, base_models)
        self._app = build_app(self.server, middlewares=middlewares)
        self._host, self._port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: Any = None
        self.url = ""

    def start(self) -> ServerThread:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            _start(self._app, self._host, self._port), self._loop
        )
        self._runner, port = future.result(timeout=60)
        self.url = _url(self._host, port)
        return self

    def call(self, fn: Any, *args: Any) -> Any:
        """Runs ``fn(*args)`` on the server's loop (to read or change its state)."""

        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=60)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=60)
            self._runner = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def api_key_from_env(name: str) -> str:
    """The server's API key from the environment variable ``name`` (never echoed)."""
    if not _ENV_NAME_RE.match(name or ""):
        raise ValueError(
            "--api-key-env must name an environment variable in upper case (like "
            "TINKER_API_KEY), not the key itself; the value given is not shown"
        )
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(
            f"the server's API key is missing: set the environment variable {name} (named by "
            "--api-key-env); clients send the same key"
        )
    return value


def serve_forever(
    *,
    host: str,
    port: int,
    api_key_env: str,
    models: Sequence[str],
    state_dir: str,
    long_poll_s: float = 20.0,
    max_body_mb: float = 64.0,
    log_level: str = "info",
    max_loss_nodes: int = 4096,
    test_cross_entropy: str = "",
    **limits: int,
) -> int:
    """``python -m runner serve``: binds, prints the URL on one line, serves until SIGINT/TERM.

    Logs go to stderr (``log_level`` for the server's own logger, warnings for the rest)."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    log.setLevel(log_level.upper())
    # ``--api-key-env A,B``: one key per variable (e.g. a tml- key for the tinker SDK and another
    # for the Fireworks SDK, whose managed path refuses tml- keys)
    keys = [api_key_from_env(name.strip()) for name in api_key_env.split(",")]
    config = ServeConfig(
        api_key=keys[0],
        extra_api_keys=tuple(keys[1:]),
        state_dir=state_dir,
        long_poll_s=long_poll_s,
        max_body_bytes=int(max_body_mb * 1024 * 1024),
        prefixes=DEFAULT_PREFIXES,
        max_loss_nodes=max_loss_nodes,
        test_cross_entropy=test_cross_entropy,
        **limits,  # `ServeConfig.max_samples` ... (the --max-* flags)
    )
    base_models = parse_model_flags(models)
    if host not in LOOPBACK:
        log.warning("binding %s: the server is reachable beyond this machine", host)
    server = make_server(config, base_models)
    app = build_app(server)

    async def main() -> None:
        runner, bound = await _start(app, host, port)
        print(_url(host, bound), flush=True)
        names = ", ".join(sorted(base_models))
        print(f"serving models: {names}; state under {state_dir}", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        frozen = freeze_heap()  # the models and the app live as long as the process (runner._gc)
        log.info("heap frozen after startup: %d objects (runner._gc.freeze_heap)", frozen)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return 0
