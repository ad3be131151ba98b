"""Shared helpers of the benchmark scripts: argument parsing, timing, tables, JSON, machine info.

Every script is runnable as ``python benchmarks/<name>.py`` from anywhere: `setup` puts the
repository root on ``sys.path`` so an uninstalled checkout works too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def setup() -> None:
    """Makes ``losses`` and ``runner`` importable from a plain checkout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: ``--quick`` and ``--out``."""
    p = argparse.ArgumentParser(prog=f"python benchmarks/{name}.py", description=description)
    p.add_argument(
        "--quick", action="store_true", help="a small, fast configuration (used by the tests)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench_results") / f"{name}.json",
        help="where to write the JSON results (default: bench_results/%(default)s)",
    )
    return p


def command(argv: Sequence[str] | None, name: str) -> str:
    """The command line that reproduces this run."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", f"benchmarks/{name}.py", *args])


def _lscpu_model() -> str | None:
    if shutil.which("lscpu") is None:
        return None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, core count, library versions, date."""
    import jax
    import numpy as np

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "platform": platform.platform(),
        "cpu": _lscpu_model() or platform.processor() or "unknown",
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "numpy": np.__version__,
    }
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except ImportError:  # pragma: no cover - jax always ships jaxlib
        pass
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_1m_at_start"] = float(f.read().split()[0])
    except OSError:
        pass
    return info


def timings(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float(s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2]))


def fmt(x: Any, digits: int = 3) -> str:
    """Compact number formatting for tables (``n/a`` for None)."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if x == 0:
            return "0"
        if abs(x) >= 1e4 or abs(x) < 1e-3:
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{max(digits - 1, 1)}f}"
    return str(x)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Prints a table (rich when installed, else plain text) and returns its Markdown form."""
    cells = [[fmt(c) for c in r] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in columns:
            t.add_column(c)
        for r in cells:
            t.add_row(*r)
        Console(width=max(shutil.get_terminal_size((160, 40)).columns, 160)).print(t)
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
        for r in cells:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    head = "| " + " | ".join(columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join([f"**{title}**", "", head, sep, *body])


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Writes ``payload`` as JSON (NaN/inf as null), creating the parent directory."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        if hasattr(x, "item") and callable(x.item):  # numpy scalars
            return clean(x.item())
        return x

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean(payload), indent=2, allow_nan=False) + "\n")
    tmp.replace(path)
    print(f"\nwrote {path}")
    return path
