"""Reachability of a hosted service, checked before any SDK call (fail fast offline).

An SDK's own retry loop can spend minutes on a host that cannot be reached (the Fireworks SDK:
5 min of silence, then a 101-line traceback). `probe` resolves the URL's host and opens one TCP
connection to it within a bounded time, and turns every failure into one line naming the URL and
the cause. It sends nothing (no credentials cross the wire here).
"""

from __future__ import annotations

import concurrent.futures
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any


class ServiceUnreachable(ValueError):
    """The service's host cannot be resolved or connected to within the time bound."""


def _connect(host: str, port: int, timeout_s: float) -> None:
    with socket.create_connection((host, port), timeout=timeout_s):
        pass


def probe(url: str, *, timeout_s: float, what: str, setting: str) -> None:
    """Resolves and connects to ``url``'s host within ``timeout_s`` seconds.

    Args:
      url: an ``http(s)://host[:port]/...`` URL.
      timeout_s: the bound, DNS resolution included (> 0).
      what: the service, for the message (``"Fireworks control plane"``).
      setting: the config key of the bound, for the message.

    Raises:
      ServiceUnreachable: one line: the URL, the cause and the time spent.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname
    if not host:
        raise ServiceUnreachable(f"{what} URL {url!r} has no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    t0 = time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        # DNS resolution is not bounded by the socket timeout: bound the whole attempt.
        pool.submit(_connect, host, port, timeout_s).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        cause = "no answer (DNS or connect timed out)"
    except socket.gaierror as exc:
        cause = f"cannot resolve host {host!r} ({exc.strerror or exc})"
    except OSError as exc:
        cause = exc.strerror or type(exc).__name__
    else:
        return
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    raise ServiceUnreachable(
        f"cannot reach the {what} at {url}: {cause} after {time.monotonic() - t0:.1f} s "
        f"({setting} = {timeout_s:g} s); check the URL and the network"
    )


#: `wait_result`: the first "waiting" line after this many seconds, then one every `NOTICE_EVERY_S`.
NOTICE_AFTER_S = 5.0
NOTICE_EVERY_S = 30.0
#: A service whose port has refused connections for this long is down (it does not come back
#: within one request: the SDK would retry it in silence until the request timeout).
REFUSED_FOR_S = 5.0


def _refuses(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` is refused now (nothing listens there)."""
    try:
        _connect(host, port, 1.0)
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout or another error: not proof that it is down
        return False
    return False


def wait_result(
    future: Any,
    *,
    timeout_s: float,
    what: str,
    url: str,
    setting: str,
    say: Callable[[str], None] | None = None,
) -> Any:
    """``future.result()``, waited for in one-second slices so that a wait is never silent.

    After `NOTICE_AFTER_S` seconds (then every `NOTICE_EVERY_S`) ``say`` gets one line: what is
    awaited, from where, for how long, and when the wait gives up. Between slices the service's
    port is checked: refused for `REFUSED_FOR_S` seconds, the service is down.

    Raises:
      concurrent.futures.TimeoutError: no result within ``timeout_s``.
      ServiceUnreachable: the service refused connections for `REFUSED_FOR_S` (it is down).
    """
    if say is None:

        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    t0 = time.monotonic()
    notice, refused_since = NOTICE_AFTER_S, None
    while True:
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            raise concurrent.futures.TimeoutError
        try:
            return future.result(timeout=min(1.0, timeout_s - waited))
        except concurrent.futures.TimeoutError:
            pass
        now = time.monotonic()
        if now - t0 >= notice:
            say(
                f"waiting for {what} from {url}: {now - t0:.0f} s so far (gives up after "
                f"{timeout_s:g} s, {setting})"
            )
            notice += NOTICE_EVERY_S
        if host and _refuses(host, port):
            refused_since = now if refused_since is None else refused_since
            if now - refused_since >= REFUSED_FOR_S:
                raise ServiceUnreachable(
                    f"{what}: the service at {url} refuses connections (it is down or was "
                    f"restarted elsewhere), {now - t0:.0f} s into the wait"
                )
        else:
            refused_since = None


def in_daemon_thread(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> concurrent.futures.Future:
    """``fn(*args, **kwargs)`` in a daemon thread, as a future (for `wait_result`): an SDK call
    that blocks without a timeout of its own (the tinker SDK creates its session synchronously)
    is bounded by the caller, and a thread still blocked does not hold up the interpreter's exit."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            out.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            out.set_exception(exc)

    threading.Thread(target=target, daemon=True, name="foldloss-sdk-call").start()
    return out
