"""`runner._gc.freeze_heap` and where the processes the runner owns call it; the server's
future store's expiry queue (one entry per finished future, however often it is retrieved)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from runner import __main__ as cli
from runner import _gc
from runner.serve._core import FutureStore, Payload

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"


class _Node:
    def __init__(self):
        self.other = self


def test_freeze_heap_collects_garbage_first_then_freezes_what_lives():
    gc.unfreeze()
    try:
        cycle = _Node()
        dead = weakref.ref(cycle)
        del cycle  # garbage only a collection frees (a reference cycle)
        kept = _Node()
        frozen = _gc.freeze_heap()
        assert dead() is None  # collected before the freeze, not frozen forever
        assert frozen == gc.get_freeze_count() > 0
        assert gc.get_freeze_count() >= 1 and kept.other is kept
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_train_command_freezes_the_heap_once_after_the_first_step(tmp_path, monkeypatch):
    calls: list[int] = []
    run_dir = tmp_path / "tiny"

    def spy() -> int:
        # the first step's metrics are on disk when the freeze comes
        calls.append(len((run_dir / "metrics.jsonl").read_text().splitlines()))
        return 0

    monkeypatch.setattr(_gc, "freeze_heap", spy)
    argv = ["train", "--config", str(TINY), "--output-dir", str(tmp_path), "--no-progress"]
    assert cli.main([*argv, "--sft-steps", "2", "--rl-steps", "1"]) == 0
    final = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert len(calls) == 1 and 1 <= calls[0] < final  # once, early: after step 1 of 3


def test_a_finished_future_is_queued_for_expiry_once():
    store = FutureStore(ttl_s=3600.0)
    fut = store.create("sample")
    assert store.get(fut.request_id) is fut and not store._finished  # pending: not queued
    fut.complete(Payload(json={"ok": True}))
    for _ in range(3):
        assert store.get(fut.request_id) is fut
    assert list(store._finished) == [fut]
    store.ttl_s = 0.0
    store.create("sample")  # a create sweeps expired futures
    assert len(store) == 1 and fut.request_id not in store._futures


def test_the_serve_command_freezes_the_heap_after_startup(tmp_path):
    """A real ``python -m runner serve`` logs its one freeze after binding (bounded wait)."""
    import time

    from tests.wire_helpers import ServeProcess, subprocess_env

    env = subprocess_env(tmp_path, {"FOLDLOSS_GC_TEST_KEY": "k-" + "0" * 32})
    log = tmp_path / "serve.log"
    server = ServeProcess(
        tmp_path / "state",
        env,
        log,
        models=[f"m={TINY}"],
        key_envs=["FOLDLOSS_GC_TEST_KEY"],
        extra=["--log-level", "info"],
    )
    try:
        deadline = time.monotonic() + 60
        while "heap frozen after startup" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            assert server.proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        line = next(x for x in log.read_text().splitlines() if "heap frozen" in x)
        assert int(line.split("after startup: ")[1].split()[0]) > 0
    finally:
        server.stop()
    assert log.read_text().count("heap frozen after startup") == 1
