"""Reachability of a hosted service, checked before any SDK call (fail fast offline).

An SDK's own retry loop can spend minutes on a host that cannot be reached (the Fireworks SDK:
5 min of silence, then a 101-line traceback). `probe` resolves the URL's host and opens one TCP
connection to it within a bounded time, and turns every failure into one line naming the URL and
the cause. It sends nothing (no credentials cross the wire here).
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
import urllib.parse


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
