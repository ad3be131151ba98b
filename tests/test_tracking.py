"""W&B and TensorBoard sinks (`runner.tracking`) against the real libraries: a real run on the tiny
config, SIGKILLed after a record past its checkpoint and resumed; the offline W&B files read back
with wandb's own protobuf records, the event files with TensorBoard's EventAccumulator. Both must
hold exactly the steps and values of ``metrics.jsonl``, each step once."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
SECRET = "wandb-key-that-must-never-be-written-0123456789"
INTERVAL = 3  # tiny: checkpoints at steps 3 and 6; the kill lands on step 4 or 5

pytest.importorskip("wandb")
pytest.importorskip("tensorboard")


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path.parent / "jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    env["WANDB_MODE"] = "offline"
    # wandb's service writes its run file every 15 s by default; 0: only when a buffer fills or
    # the run finishes, so the SIGKILLed run's file deterministically loses what it was given
    env["WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"] = "0"
    env["WANDB_API_KEY"] = SECRET
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[var] = str(tmp_path / "wandb-home")
    return env


def _cmd(out: Path, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "runner", "train", "--config", str(TINY)),
        *("--output-dir", str(out), "--no-progress", "--checkpoint-interval", str(INTERVAL)),
        *("--set", "log.wandb=true", "--set", "log.tensorboard=true"),
        *("--set", 'log.wandb_project="foldloss-test"'),
        *extra,
    ]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _expected(records: list[dict]) -> dict[int, dict[str, float]]:
    """Step -> the record's numbers (the JSONL's own reading, independent of runner.tracking)."""
    out = {}
    for r in records:
        out[r["step"]] = {
            k: float(v)
            for k, v in r.items()
            if k not in ("step", "time") and type(v) in (int, float, bool)
        }
    return out


def _wandb_records(path: Path):
    """The protobuf records of one ``.wandb`` file (LevelDB log framing: 32 KiB blocks of
    ``crc32 u32, length u16, type u8`` chunks after a 7-byte ``:W&B`` header), parsed with
    wandb's own ``Record`` message."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos : pos + length], pos + length
        parts = chunk if kind in (1, 2) else parts + chunk  # FULL/FIRST start, MIDDLE/LAST add
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            out.append(rec)
    return out


def _wandb_history(run_dir: Path, run_id: str):
    """Every offline W&B run file of ``run_id`` and each one's history rows, in writing order."""
    files = sorted(
        (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"),
        key=lambda p: p.parent.name,  # offline-run-<YYYYmmdd_HHMMSS>-<id>
    )
    rows, configs, run_ids = [], [], set()
    for f in files:
        rows.append([])
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(rec.run.run_id)
                configs.extend(rec.run.config.update)
            elif kind == "config":
                configs.extend(rec.config.update)
            elif kind == "history":
                row = {}
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                rows[-1].append(row)
    return files, rows, {c.key: json.loads(c.value_json) for c in configs}, run_ids


def _tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_sinks_hold_exactly_the_jsonl_after_sigkill_and_resume(tmp_path):
    run_dir = tmp_path / "tiny"
    env = _env(tmp_path)
    proc = subprocess.Popen(
        _cmd(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    marker, log = run_dir / "checkpoints" / "latest", run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once a record past the checkpoint of step 3 is written
        if marker.exists() and marker.read_text().strip() == str(INTERVAL) and log.exists():
            if any(r["step"] > INTERVAL for r in _records(run_dir)):
                break
        if proc.poll() is not None:
            pytest.fail(f"run ended before it could be killed: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    out1, err1 = proc.communicate()
    killed = _records(run_dir)
    assert int(marker.read_text()) == INTERVAL and killed[-1]["step"] > INTERVAL
    resumed = subprocess.run(
        _cmd(tmp_path, "--resume"), env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = _records(run_dir)
    cfg = load_config(TINY)
    assert [r["step"] for r in records] == list(range(cfg.total_steps + 1))
    expected = _expected(records)
    # the killed run's records past the checkpoint were recomputed: the sinks must not hold them
    stale = [r for r in killed if r["step"] > INTERVAL]
    assert all(_expected([r])[r["step"]] != expected[r["step"]] for r in stale)

    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    files, per_file, config, run_ids = _wandb_history(run_dir, run_id)
    assert len(files) == 2 and run_ids == {run_id}  # the resume continued the same W&B run
    # W&B buffers: the killed run's file lost the rows it was given at the checkpoint, and the
    # resume gave them again (a durable sink, TensorBoard below, is not given them twice)
    assert per_file[0] == []
    rows = per_file[1]
    # one row per step, in order, none twice
    assert [row["_step"] for row in rows] == sorted(expected)
    by_step = {row["_step"]: row for row in rows}
    for step, values in expected.items():
        got = {k: v for k, v in by_step[step].items() if not k.startswith(("_", "plot/"))}
        assert got == values, step
    plots = sorted(s for s, row in by_step.items() if row.get("plot/_type") == "image-file")
    assert plots == [INTERVAL, cfg.total_steps]  # the plot at each checkpoint
    last = files[-1].parent / "files" / by_step[cfg.total_steps]["plot/path"]
    assert last.read_bytes() == (run_dir / "plot.png").read_bytes()
    saved = json.loads((run_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "_wandb"} == saved  # the config, once

    acc = _tensorboard(run_dir)
    tags = acc.Tags()
    keys = {k for v in expected.values() for k in v}
    assert set(tags["scalars"]) == keys
    for key in keys:
        events = acc.Scalars(key)
        want = [(s, v[key]) for s, v in sorted(expected.items()) if key in v]
        got = [(e.step, e.value) for e in events]
        # float32 on the wire: the same steps, each once, and the values to float32
        assert [s for s, _ in got] == [s for s, _ in want], key
        for (_, g), (_, w) in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-6, abs=1e-30), key
    assert [e.step for e in acc.Images("plot")] == [INTERVAL, cfg.total_steps]
    assert acc.Images("plot")[-1].encoded_image_string == (run_dir / "plot.png").read_bytes()
    config_text = acc.Tensors("config")
    assert len(config_text) == 1 and json.loads(config_text[0].tensor_proto.string_val[0]) == saved

    # the API key: never written into the run directory or printed
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    for text in (out1, err1, resumed.stdout, resumed.stderr):
        assert SECRET not in text


@pytest.mark.parametrize("key, extra", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_a_sink_without_its_extra_fails_at_config_load_naming_the_extra(monkeypatch, key, extra):
    load_config(TINY, [f"log.{key}=false"])  # off: the library is never imported
    monkeypatch.setitem(sys.modules, extra, None)  # the package is not installed
    load_config(TINY, [f"log.{key}=false"])
    with pytest.raises(ValueError) as info:
        load_config(TINY, [f"log.{key}=true"])
    message = str(info.value)
    assert "\n" not in message
    assert f"[log].{key}" in message and f"pip install 'foldloss[{extra}]'" in message


def test_tracking_settings_do_not_change_what_the_run_computes():
    base = load_config(TINY)
    logged = load_config(TINY, ["log.tensorboard=true", 'log.wandb_project="x"'])
    assert logged.identity() == base.identity()  # a resume may switch a sink on or off
    with pytest.raises(ValueError, match=r"\[log\].wandb_project"):
        load_config(TINY, ["log.wandb=true", 'log.wandb_project=""'])


def _recs(steps, offset=0.0):
    return [{"step": s, "phase": "rl", "time": 1.7e9 + s, "x": s + offset, "l": [1]} for s in steps]


def test_tensorboard_resume_discards_a_torn_flush_and_a_late_sink_is_backfilled(tmp_path):
    """Without training: the real TensorBoard sink through `Tracking`, as a resume sees it."""
    from runner.tracking import STATE_FILE, Tracking

    cfg = load_config(TINY, ["log.tensorboard=true"])
    t = Tracking.open(cfg, tmp_path, "rid", [], resume=False)
    t.commit(_recs(range(3)), 2)  # the checkpoint of step 2
    for r in _recs([3, 4], offset=100.0):  # a flush torn by a kill: sent, never saved as sent
        t.sinks["tensorboard"].log(r["step"], {"x": r["x"]}, r["time"], {})
    t.close(ok=False)
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"tensorboard": 2}
    t = Tracking.open(cfg, tmp_path, "rid", _recs(range(3)), resume=True)
    t.commit(_recs(range(6)), 5)
    t.close()
    acc = _tensorboard(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(s, float(s)) for s in range(6)]
    assert set(acc.Tags()["scalars"]) == {"x"} and len(acc.Tensors("config")) == 1

    # a sink switched on at a resume gets the config and every record up to the checkpoint
    (tmp_path / "late").mkdir()
    t = Tracking.open(cfg, tmp_path / "late", "rid", _recs(range(4)), resume=True)
    t.close()
    acc = _tensorboard(tmp_path / "late")
    assert [e.step for e in acc.Scalars("x")] == [0, 1, 2, 3] and len(acc.Tensors("config")) == 1
    (tmp_path / "late" / STATE_FILE).write_text("[1]")
    with pytest.raises(ValueError, match=r"tracking.json is not a JSON object of steps"):
        Tracking.open(cfg, tmp_path / "late", "rid", [], resume=True)
