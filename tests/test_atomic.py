"""runner._atomic: round trips, no temp files left, the old file survives a failed write, and
the parent directory is fsynced after the rename (durability of the rename itself)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from runner import _atomic
from runner import checkpoints as ckpt
from runner._atomic import (
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    make_dirs,
    publish_dir,
)


def _entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


class FsyncSpy:
    """Records what ``os.fsync`` is called on: ``("dir" | "file", path)``."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str]] = []
        real_fsync = os.fsync

        def fsync(fd):
            kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
            self.calls.append((kind, os.path.realpath(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def dirs(self) -> list[str]:
        return [p for kind, p in self.calls if kind == "dir"]

    def files(self) -> list[str]:
        return [p for kind, p in self.calls if kind == "file"]


needs_proc = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to name fsynced fds"
)


def test_round_trips_and_leaves_no_temp_file(tmp_path):
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01binary\xff")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01binary\xff"
    atomic_write_text(tmp_path / "t.txt", "héllo\nworld\n")
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo\nworld\n"
    data = {"b": [1, 2.5, None], "a": {"x": "y"}}
    atomic_write_json(tmp_path / "j.json", data)
    text = (tmp_path / "j.json").read_text()
    assert json.loads(text) == data and text.endswith("\n")
    assert text == json.dumps(data, sort_keys=True, indent=2) + "\n"  # the manifest format
    atomic_write_text(tmp_path / "t.txt", "replaced")  # replacing an existing file
    assert (tmp_path / "t.txt").read_text() == "replaced"
    assert _entries(tmp_path) == ["b.bin", "j.json", "t.txt"]


def test_creates_missing_parents(tmp_path):
    atomic_write_text(tmp_path / "a" / "b" / "c.txt", "x")
    assert (tmp_path / "a" / "b" / "c.txt").read_text() == "x"
    assert make_dirs(tmp_path / "a" / "d") == tmp_path / "a" / "d"
    assert (tmp_path / "a" / "d").is_dir()


def test_old_file_survives_an_unserializable_value(tmp_path):
    path = tmp_path / "m.json"
    atomic_write_json(path, {"step": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"step": 2, "bad": object()})
    assert json.loads(path.read_text()) == {"step": 1}
    assert _entries(tmp_path) == ["m.json"]


def test_old_file_survives_a_failed_replace(tmp_path, monkeypatch):
    path = tmp_path / "latest"
    atomic_write_text(path, "1\n")

    def failing_replace(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        atomic_write_text(path, "2\n")
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.atomic_write_text(path, "2\n")  # the re-export is the same writer
    monkeypatch.undo()
    assert path.read_text() == "1\n"
    assert _entries(tmp_path) == ["latest"]


def test_old_file_survives_a_writer_that_fails_midway(tmp_path):
    path = tmp_path / "w.safetensors"
    atomic_write_bytes(path, b"old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_bytes(b"half of the new")
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert _entries(tmp_path) == ["w.safetensors"]


def test_temp_names_are_unique_siblings(tmp_path):
    seen = []
    for _ in range(3):
        with atomic_path(tmp_path / "x.png", suffix=".png") as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".x.png.tmp-")
            assert tmp.suffix == ".png"
            tmp.write_bytes(b"png")
            seen.append(tmp.name)
    assert len(set(seen)) == 3  # not one name per process (pid), which concurrent writers share


@needs_proc
@pytest.mark.parametrize(
    "write",
    [
        lambda p: atomic_write_text(p, "1\n"),
        lambda p: atomic_write_json(p, {"a": 1}),
        lambda p: atomic_write_bytes(p, b"x"),
        lambda p: ckpt.atomic_write_text(p, "1\n"),  # what runner.checkpoints writers use
        lambda p: ckpt.atomic_write_json(p, {"a": 1}),
    ],
)
def test_fsyncs_the_file_then_the_parent_directory(tmp_path, monkeypatch, write):
    path = tmp_path / "out"
    spy = FsyncSpy(monkeypatch)
    write(path)
    # The data reached the disk before the rename (the temporary file), the rename after it.
    assert spy.files() and all(os.path.basename(p).startswith(".out.tmp-") for p in spy.files())
    assert spy.dirs() == [str(tmp_path.resolve())]
    assert spy.calls.index(("dir", str(tmp_path.resolve()))) > spy.calls.index(
        ("file", spy.files()[-1])
    )


@needs_proc
def test_checkpoint_marker_and_manifest_are_durable(tmp_path, monkeypatch):
    """`runner.checkpoints.write_checkpoint` fsyncs the directory of every file it renames."""

    class Refs:
        builtin_losses = ()

        def forward(self, seqs): ...
        def forward_backward(self, seqs, loss_name, config=None): ...
        def optim_step(self, adam, normalization=None): ...
        def save_state(self, name):
            return f"/refs/{name}"

        def load_state(self, ref, with_optimizer=True): ...
        def save_weights_for_sampler(self, name):
            return f"/weights/{name}"

    spy = FsyncSpy(monkeypatch)
    root = tmp_path / "checkpoints"
    ckpt.write_checkpoint(
        root, Refs(), step=3, run_state={"step": 3}, backend="local", promotable=True
    )
    dirs = spy.dirs()
    assert str(ckpt.step_dir(root, 3).resolve()) in dirs  # manifest.json's rename
    assert dirs[-1] == str(root.resolve())  # the latest marker's rename, last
    assert ckpt.latest_step(root) == 3
    assert ckpt.read_manifest(root, 3)["resumable"]["provider_path"] == "/refs/foldloss-step-3"


@needs_proc
def test_publish_dir_fsyncs_the_new_directory_and_its_parent(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp-1"
    tmp.mkdir()
    atomic_write_text(tmp / "meta.json", "{}\n")
    spy = FsyncSpy(monkeypatch)
    publish_dir(tmp, tmp_path / "v-1")
    assert _entries(tmp_path) == ["v-1"] and _entries(tmp_path / "v-1") == ["meta.json"]
    assert spy.dirs()[-1] == str(tmp_path.resolve())


def test_local_checkpoint_uses_the_shared_helpers():
    from runner.local import checkpoint

    for private in ("_fsync_file", "_fsync_dir", "_write_text_atomic"):
        assert not hasattr(checkpoint, private)
    assert checkpoint.atomic_path is _atomic.atomic_path
    assert ckpt.atomic_write_text is _atomic.atomic_write_text
    assert ckpt.atomic_write_json is _atomic.atomic_write_json
