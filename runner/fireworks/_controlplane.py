"""Control-plane checkpoint rows: predicates, names, and polling for new rows.

Rows are the dicts of ``TrainerJobManager.list_checkpoints(job_id)`` (the SDK's control-plane
listing, oldest first): ``name = accounts/<a>/rlorTrainerJobs/<job>/checkpoints/<short>``,
``createTime``, ``checkpointType`` (e.g. ``CHECKPOINT_TYPE_TRAINING``,
``CHECKPOINT_TYPE_INFERENCE_BASE``) and the authoritative ``promotable`` flag.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("runner.fireworks")

Row = dict[str, Any]
_LABEL_BAD = re.compile(r"[^a-z0-9-]+")


def short_name(resource: str) -> str:
    """The last ``/`` segment of a checkpoint resource name or path."""
    return str(resource).rstrip("/").rsplit("/", 1)[-1]


def is_resumable_row(row: Row) -> bool:
    """A DCP (weights + optimizer) row: ``checkpointType`` ends in ``TRAINING``/``TRAINING_LORA``."""
    return str(row.get("checkpointType") or "").endswith(("TRAINING", "TRAINING_LORA"))


def is_promotable_row(row: Row) -> bool:
    return row.get("promotable") is True


def dns_label(name: str, max_len: int = 63) -> str:
    """``name`` as a checkpoint DNS label (``[a-z0-9-]``, alphanumeric ends, ≤ ``max_len``)."""
    label = _LABEL_BAD.sub("-", str(name).lower()).strip("-")[:max_len].strip("-")
    return label or "ckpt"


def list_rows(list_fn: Callable[[], Iterable[Row]]) -> list[Row] | None:
    """The rows, or ``None`` when the listing fails (logged as a warning)."""
    try:
        return [dict(r) for r in list_fn()]
    except Exception as exc:  # noqa: BLE001 - any listing failure means "no baseline"
        log.warning("control-plane checkpoint listing failed: %s: %s", type(exc).__name__, exc)
        return None


def poll_new_rows(
    list_fn: Callable[[], Iterable[Row]],
    *,
    baseline: set[str],
    predicate: Callable[[Row], bool],
    timeout_s: float,
    interval_s: float,
    settle_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[Row]:
    """Polls until rows matching ``predicate`` and absent from ``baseline`` appear.

    After the first match, waits ``settle_s`` and lists once more, so that a second new row
    (an ambiguity) is seen too. Listing failures are retried until ``timeout_s``.

    Returns:
      The matching new rows (possibly empty after the timeout).
    """
    deadline = clock() + timeout_s
    while True:
        rows = list_rows(list_fn)
        if rows is not None:
            found = [r for r in rows if predicate(r) and r.get("name") not in baseline]
            if found:
                if settle_s > 0:
                    sleep(settle_s)
                    again = list_rows(list_fn)
                    if again is not None:
                        found = [r for r in again if predicate(r) and r.get("name") not in baseline]
                return found
        if clock() >= deadline:
            return []
        sleep(interval_s)
