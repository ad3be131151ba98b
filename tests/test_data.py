"""SFT on the user's JSONL (runner.data, runner.job): record validation naming file, line and
field; assistant-only masks checked by decoding; length policy; batching by records or tokens;
epochs; and an exact mid-epoch kill-and-resume of `python -m runner sft --data`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runner.chat import ConcatRenderer
from runner.config import load_config
from runner.data import FileSource, Position, epoch_order, load_dataset
from runner.env import tokenizer as tok
from runner.job import build_job
from runner.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
R = ConcatRenderer(CharTokenizer())


def records(n: int, seed: int = 0) -> list[dict]:
    """Chat and prompt/completion records over the character vocabulary."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, size=2))
        if i % 3 == 2:
            out.append({"prompt": f"q: {a}+{b}\n", "completion": f"ans {a + b}\n", "id": i})
        else:
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": "add.\n"},
                        {"role": "user", "content": f"q: {a}+{b}\n"},
                        {"role": "assistant", "content": f"calc {a}+{b}\n"},
                        {"role": "tool", "content": f"= {a + b}\n"},
                        {"role": "assistant", "content": f"ans {a + b}\n"},
                    ]
                }
            )
    return out


def write(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def load(path, **kw):
    opts = dict(train_on="all_assistant", max_len=64, overflow="error", key="[sft].data")
    opts.update(kw)
    return load_dataset(path, R, **opts)


@pytest.mark.parametrize("train_on", ["all_assistant", "last_assistant"])
def test_assistant_only_masks_checked_by_decoding(tmp_path, train_on):
    rows = records(12)
    ds = load(write(tmp_path / "train.jsonl", rows), train_on=train_on)
    assert len(ds.examples) == 12 and ds.lines == tuple(range(1, 13))
    for row, ex in zip(rows, ds.examples, strict=True):
        msgs = row.get("messages") or [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"]},
        ]
        shown = (
            msgs
            if train_on == "all_assistant"
            else msgs[: max(i for i, m in enumerate(msgs) if m["role"] == "assistant") + 1]
        )
        assert tok.decode(ex.tokens) == "<bos>" + "".join(m["content"] for m in shown)
        trained = [m["content"] for m in msgs if m["role"] == "assistant"]
        if train_on == "last_assistant":
            trained = trained[-1:]
        assert tok.decode(ex.tokens[ex.weights > 0]) == "".join(trained)
        assert ex.weights[0] == 0 and set(np.unique(ex.weights)) <= {0.0, 1.0}


BAD = [
    ("{not json", r"train.jsonl:2: not valid JSON \(Expecting property name"),
    ("[1, 2]", r"train.jsonl:2: a record must be a JSON object, got list"),
    (
        {"text": "x"},
        r"train.jsonl:2: a record needs \"messages\" or \"prompt\" and \"completion\"; it has \['text'\]",
    ),
    ({"messages": []}, r"train.jsonl:2: messages must be a non-empty list"),
    (
        {"messages": ["hi"]},
        r"train.jsonl:2: messages\[0\] must be an object with \"role\" and \"content\"",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "bot", "content": "c"},
            ]
        },
        r"train.jsonl:2: messages\[2\].role must be one of assistant, system, tool, user, got 'bot'",
    ),
    (
        {"messages": [{"content": "a"}]},
        r"train.jsonl:2: messages\[0\].role must be one of .*, missing",
    ),
    (
        {"messages": [{"role": "user", "content": 3}]},
        r"train.jsonl:2: messages\[0\].content must be a string, got int",
    ),
    (
        {"messages": [{"role": "user", "content": "a"}]},
        r"train.jsonl:2: messages: no assistant message to train on",
    ),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "B"}]},
        r"train.jsonl:2: messages\[1\].content: cannot encode character 'B' at position 0",
    ),
    ({"prompt": "a"}, r"train.jsonl:2: completion is missing"),
    ({"prompt": "a", "completion": 1}, r"train.jsonl:2: completion must be a string, got int"),
    ({"prompt": "Z", "completion": "b"}, r"train.jsonl:2: prompt: cannot encode character 'Z'"),
    ({"prompt": "a", "completion": ""}, r"train.jsonl:2: renders no assistant token to train on"),
    (
        {"messages": [{"role": "user", "content": "a"}], "prompt": "a", "completion": "b"},
        r"train.jsonl:2: a record has \"messages\" or \"prompt\"/\"completion\", not both",
    ),
    (
        {"prompt": "a", "completion": "b" * 80},
        r"train.jsonl:2: the record has 81 model-input tokens, over \[model\].max_seq_len = 64",
    ),
]


@pytest.mark.parametrize("bad, message", BAD)
def test_every_data_error_names_file_line_and_field(tmp_path, bad, message):
    path = write(tmp_path / "train.jsonl", [records(1)[0], bad])
    with pytest.raises(ValueError, match=message):
        load(path)


def test_file_errors_and_the_cli_error_line(tmp_path):
    with pytest.raises(ValueError, match=r"\[sft\].data: file not found"):
        load(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"\[sft\].data: .*empty.jsonl: no records"):
        load(write(tmp_path / "empty.jsonl", ["", "  "]))
    (tmp_path / "bin.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"bin.jsonl:1: not valid UTF-8"):
        load(str(tmp_path / "bin.jsonl"))
    path = write(
        tmp_path / "train.jsonl", [*records(3), {"messages": [{"role": "me", "content": ""}]}]
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "sft",
            "--config",
            str(TINY),
            "--data",
            path,
            "--output-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}:4: messages[0].role must be one of assistant, system, tool, user, got 'me'"
    ]
    assert not (tmp_path / "tiny").exists()


def test_overflow_truncate_and_drop_are_counted(tmp_path):
    long = {"prompt": "a", "completion": "b" * 80}
    late = {"prompt": "a" * 80, "completion": "b"}
    path = write(tmp_path / "train.jsonl", [*records(3), long])
    ds = load(path, overflow="truncate")
    assert ds.truncated == 1 and ds.dropped == 0 and len(ds.examples[-1].tokens) == 65
    assert ds.examples[-1].truncated
    ds = load(path, overflow="drop")
    assert ds.dropped == 1 and len(ds.examples) == 3 and ds.lines == (1, 2, 3)
    with pytest.raises(
        ValueError, match=r"train.jsonl:4: truncated to .* keeps no assistant token"
    ):
        load(write(tmp_path / "train.jsonl", [*records(3), late]), overflow="truncate")
    with pytest.raises(ValueError, match=r"all 1 records are over the length limit"):
        load(write(tmp_path / "train.jsonl", [long]), overflow="drop")


def test_batches_by_records_and_by_tokens_cover_each_epoch_in_its_order(tmp_path):
    ds = load(write(tmp_path / "train.jsonl", records(10)))
    src = FileSource(ds, seed=3, batch_size=4, batch_tokens=0, shuffle=True)
    pos, seen = Position(), []
    for _ in range(6):  # 3 batches an epoch: 4 + 4 + 2
        picked, pos = src.next_batch(pos)
        seen.append(picked)
    assert [len(b) for b in seen] == [4, 4, 2, 4, 4, 2] and pos == Position(2, 0)
    for e in (0, 1):
        assert sum(seen[3 * e : 3 * e + 3], []) == epoch_order(10, 3, e, True).tolist()
    assert epoch_order(10, 3, 0, True).tolist() != epoch_order(10, 3, 1, True).tolist()
    assert src.steps_for_epochs(2) == 6
    assert FileSource(ds, seed=3, batch_size=4, batch_tokens=0, shuffle=False).next_batch(
        Position()
    )[0] == [0, 1, 2, 3]
    budget = 60
    tsrc = FileSource(ds, seed=3, batch_size=4, batch_tokens=budget, shuffle=True)
    pos, covered = Position(), []
    while pos.epoch == 0:
        picked, pos = tsrc.next_batch(pos)
        sizes = [len(ds.examples[i].tokens) for i in picked]
        assert len(picked) == 1 or sum(sizes) <= budget
        covered += picked
    assert covered == epoch_order(10, 3, 0, True).tolist()


def test_positions_are_restored_only_for_the_same_data(tmp_path):
    path = write(tmp_path / "train.jsonl", records(10))
    src = FileSource(load(path), seed=0, batch_size=4, batch_tokens=0, shuffle=True)
    state = src.position_state(Position(1, 4))
    assert src.restore(state) == Position(1, 4)
    write(tmp_path / "train.jsonl", records(10, seed=1))
    changed = FileSource(load(path), seed=0, batch_size=4, batch_tokens=0, shuffle=True)
    with pytest.raises(ValueError, match=r"changed since the checkpoint"):
        changed.restore(state)
    with pytest.raises(ValueError, match=r"records no position in \[sft\].data"):
        src.restore({"source": "task", "step": 3})


def test_epochs_set_the_step_count_and_need_steps_zero(tmp_path):
    path = write(tmp_path / "train.jsonl", records(10))
    with pytest.raises(
        ValueError, match=r"\[sft\].epochs = 2 sets the SFT step count .* set \[sft\].steps = 0"
    ):
        load_config(TINY, [f'sft.data="{path}"', "sft.epochs=2"])
    cfg = load_config(
        TINY, [f'sft.data="{path}"', "sft.epochs=2", "sft.steps=0", "sft.batch_size=4"]
    )
    job, cfg = build_job(cfg)
    assert cfg.sft.steps == 6 and cfg.total_steps == 6 + 3
    with pytest.raises(ValueError, match=r"\[sft\].data: file not found"):
        load_config(TINY, ['sft.data="nope.jsonl"'])
    with pytest.raises(ValueError, match=r"\[sft\].eval_every needs \[sft\].eval_data"):
        load_config(TINY, ["sft.eval_every=2"])


# -- exact mid-epoch resume ------------------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path.parent / "jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def _sft_cmd(out: Path, data: str, held: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "runner", "sft", "--config", str(TINY), "--output-dir", str(out),
        "--data", data, "--eval-data", held, "--no-progress", "--checkpoint-interval", "1",
        "--sft-steps", "14", "--set", "sft.batch_size=4", "--set", "sft.eval_every=5",
        "--set", "checkpoint.save_promotable=true", *extra,
    ]  # fmt: skip


def _final(run_dir: Path):
    from safetensors.numpy import load_file

    step = int((run_dir / "checkpoints" / "latest").read_text())
    m = json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").read_text())
    return m, load_file(run_dir / m["promotable"]["snapshot_path"])


def test_sft_kill_and_resume_mid_epoch_sees_the_same_examples_in_the_same_order(tmp_path):
    """22 records in batches of 4 (6 batches an epoch: the last of 2); 14 steps span 3 epochs.
    The run is killed after a checkpoint inside the second epoch and resumed."""
    data = write(tmp_path / "train.jsonl", records(22))
    held = write(tmp_path / "held.jsonl", records(5, seed=9))
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    proc = subprocess.run(
        _sft_cmd(ref_out, data, held),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval NLL ([sft].eval_data)" in proc.stdout
    killer = subprocess.Popen(
        _sft_cmd(out, data, held),
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    marker = out / "tiny" / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline:
        if marker.exists() and marker.read_text().strip() and int(marker.read_text()) >= 8:
            break
        if killer.poll() is not None:
            pytest.fail(f"run ended before it could be killed: {killer.stderr.read()[-2000:]}")
        time.sleep(0.02)
    killer.send_signal(signal.SIGKILL)
    killer.wait()
    killed_at = int(marker.read_text())
    assert 8 <= killed_at < 14
    m = json.loads(
        (out / "tiny" / "checkpoints" / f"step_{killed_at:06d}" / "manifest.json").read_text()
    )
    pos = m["run_state"]["data_position"]
    assert pos["source"] == "file" and pos["epoch"] >= 1 and (pos["epoch"], pos["index"]) != (1, 0)
    resumed = subprocess.run(
        _sft_cmd(out, data, held, "--resume"),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def steps(run):
        return [
            json.loads(line) for line in (run / "tiny" / "metrics.jsonl").read_text().splitlines()
        ]

    ref, got = steps(ref_out), steps(out)
    assert [r["step"] for r in got] == list(range(15))
    lines_ref = [r.get("data/lines") for r in ref]
    assert lines_ref == [r.get("data/lines") for r in got]  # the same records, in the same order
    order = sum((r["data/lines"] for r in ref[1:7]), [])
    assert sorted(order) == list(range(1, 23))  # one epoch visits every record once
    assert [r["data/epoch"] for r in ref[1:]] == [0.0] * 6 + [1.0] * 6 + [2.0] * 2
    for r0, r1 in zip(ref, got, strict=True):
        assert r0.get("sft/nll") == r1.get("sft/nll") and r0.get("sft/eval_nll") == r1.get(
            "sft/eval_nll"
        )
    assert [r["step"] for r in ref if "sft/eval_nll" in r] == [0, 5, 10, 14]
    (ma, wa), (mb, wb) = _final(ref_out / "tiny"), _final(out / "tiny")
    assert ma["run_state"]["data_position"] == mb["run_state"]["data_position"]
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)
    # the data changed under the checkpoint: the resume fails closed, in one error line
    write(tmp_path / "train.jsonl", records(22, seed=5))
    step = ma["run_state"]["step"]
    again = subprocess.run(
        _sft_cmd(out, data, held, "--resume", "--sft-steps", "16"),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 2 and "changed since the checkpoint" in again.stderr, (
        step,
        again.stderr,
    )


def test_a_bom_is_accepted_duplicate_keys_and_deep_nesting_are_refused(tmp_path, capsys):
    """Issue #23 items 7 and 8: a UTF-8 BOM was refused, a duplicate key kept its last value
    silently, and a 100,000-deep value raised a RecursionError traceback."""
    from runner import __main__ as cli

    rows = records(4)
    plain = load(write(tmp_path / "plain.jsonl", rows))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "plain.jsonl").read_bytes())
    assert [e.tokens.tolist() for e in load(str(bom)).examples] == [
        e.tokens.tolist() for e in plain.examples
    ]
    twice = '{"prompt": "a", "completion": "b", "prompt": "c"}'
    dup = write(tmp_path / "dup.jsonl", [rows[0], twice])
    with pytest.raises(ValueError, match=r"dup.jsonl:2: duplicate key 'prompt' in one object"):
        load(dup)
    nested = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    deep = write(tmp_path / "deep.jsonl", [rows[0], nested])
    with pytest.raises(ValueError, match=r"deep.jsonl:2: a value is nested more than 512 levels"):
        load(deep)
    args = ["sft", "--config", str(TINY), "--data", deep, "--output-dir", str(tmp_path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {deep}:2: a value is nested more than 512 levels deep"]
