"""runner.local checkpoints: resumable state (orbax) and sampler weights (safetensors), atomically."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from runner import AdamParams, Seq
from runner.local import LocalTrainer, LocalTrainerConfig, checkpoint, model

# float32 (the default dtype) under x64: bit-for-bit resume must hold there too.
CFG = LocalTrainerConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.05, grad_clip_norm=1.0)


def seqs(seed: int):
    rng = np.random.default_rng(seed)
    return [Seq(rng.integers(0, 16, size=n), {"weights": rng.normal(size=n - 1)}) for n in (6, 11)]


def train_step(tr: LocalTrainer, seed: int) -> None:
    tr.forward_backward(seqs(seed), "cross_entropy")
    tr.optim_step(ADAM, "num_loss_tokens")


def flat(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in model.flatten(jax.device_get(tree)).items()}


def opt_leaves(tr: LocalTrainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(tr._opt_state))]


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture
def make(tmp_path):
    def make(**overrides):
        return LocalTrainer(CFG, checkpoint_dir=str(tmp_path / "ckpt"), **overrides)

    return make


def test_resume_reproduces_next_step_bit_for_bit(make):
    a = make()
    train_step(a, 0)
    train_step(a, 1)
    ref = a.save_state("step-2")
    assert os.path.isdir(ref) and ref.endswith("step-2")
    train_step(a, 2)
    expected = flat(a.params)

    b = make(seed=123)  # different initial weights, fresh optimizer
    b.load_state(ref)
    assert b.step == 2
    train_step(b, 2)
    assert_identical(flat(b.params), expected)
    for x, y in zip(opt_leaves(a), opt_leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)

    c = make(seed=7)  # load by bare name too
    c.load_state("step-2")
    train_step(c, 2)
    assert_identical(flat(c.params), expected)


def test_load_without_optimizer_restores_weights_only(make):
    a = make()
    train_step(a, 0)
    saved = flat(a.params)
    ref = a.save_state("a")

    b = make(seed=5)
    train_step(b, 3)
    train_step(b, 4)
    b_opt = opt_leaves(b)
    b.forward_backward(seqs(5), "cross_entropy")  # pending gradient: dropped by the load
    b.load_state(ref, with_optimizer=False)
    assert_identical(flat(b.params), saved)
    assert b.step == 2 and b.accumulated_grads() is None
    for x, y in zip(opt_leaves(b), b_opt, strict=True):
        np.testing.assert_array_equal(x, y)


def test_interrupted_save_leaves_previous_checkpoint_loadable(make, monkeypatch, tmp_path):
    a = make()
    train_step(a, 0)
    a.save_state("other")
    ref = a.save_state("ckpt")
    saved = flat(a.params)
    train_step(a, 1)

    real_write = checkpoint.write_tree

    def crashing_write(directory, tree):
        real_write(directory, tree)  # everything written ...
        raise RuntimeError("simulated crash mid-write")  # ... but never committed

    monkeypatch.setattr(checkpoint, "write_tree", crashing_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        a.save_state("ckpt")
    with pytest.raises(RuntimeError, match="simulated crash"):
        a.save_state("new")
    monkeypatch.undo()

    # A hard crash can also leave debris behind: an uncommitted version and a temp directory.
    base = tmp_path / "ckpt" / "state" / "ckpt"
    (base / "tmp-deadbeef" / "tree").mkdir(parents=True)
    (base / "v-deadbeef").mkdir()
    (base / "v-deadbeef" / "meta.json").write_text("{not json")
    (tmp_path / "ckpt" / "state" / "half").mkdir()  # a name whose first save never finished

    assert a.list_checkpoints() == ["other", "ckpt"]
    b = make(seed=9)
    b.load_state(ref)
    assert_identical(flat(b.params), saved)
    b.load_state("other")
    with pytest.raises(FileNotFoundError, match="new"):
        b.load_state("new")

    # The next successful save of the name sweeps the debris and replaces it atomically.
    a.save_state("ckpt")
    assert sorted(p.name for p in base.iterdir() if p.is_dir()) == [
        (base / "CURRENT").read_text().strip()
    ]
    b.load_state("ckpt")
    assert_identical(flat(b.params), flat(a.params))


def test_sampler_weights_round_trip_and_atomicity(make, monkeypatch):
    a = make()
    train_step(a, 0)
    path = a.save_weights_for_sampler("w")
    assert path.endswith("w.safetensors") and os.path.isfile(path)
    tensors, meta = checkpoint.load_weights(path)
    assert "layers.0.wqkv" in tensors and "layers.1.w2" in tensors and "embed" in tensors
    assert tensors["layers.0.wqkv"].shape == (32, 96)
    assert meta["model"]["d_model"] == 32 and meta["step"] == 1

    b = make(seed=3)
    b_opt = opt_leaves(b)
    b.load_weights(path)
    assert_identical(flat(b.params), flat(a.params))
    for x, y in zip(opt_leaves(b), b_opt, strict=True):  # the optimizer is untouched
        np.testing.assert_array_equal(x, y)
    s = seqs(1)
    for x, y in zip(a.forward(s), b.forward(s), strict=True):
        np.testing.assert_array_equal(x, y)
    b.load_weights("w")  # by name

    saved = flat(a.params)
    train_step(a, 1)
    import safetensors.numpy

    def crashing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", crashing_save)
    with pytest.raises(OSError, match="disk full"):
        a.save_weights_for_sampler("w")
    monkeypatch.undo()
    assert [p for p in os.listdir(os.path.dirname(path)) if p != "w.safetensors"] == []
    b.load_weights(path)
    assert_identical(flat(b.params), saved)


def test_checkpoint_errors(make, tmp_path):
    a = make()
    with pytest.raises(FileNotFoundError, match="no complete resumable checkpoint"):
        a.load_state("missing")
    with pytest.raises(FileNotFoundError):
        a.load_state(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no sampler weights"):
        a.load_weights("missing")
    for bad in ("../escape", "", ".hidden", "a/b", "x" * 200):
        with pytest.raises(ValueError, match="invalid checkpoint name"):
            a.save_state(bad)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        LocalTrainer(CFG).save_state("x")
    assert LocalTrainer(CFG).list_checkpoints() == []

    ref = a.save_state("s")
    wpath = a.save_weights_for_sampler("s")
    other = make(d_model=64)
    with pytest.raises(ValueError, match="d_model"):
        other.load_state(ref)
    with pytest.raises(ValueError, match="d_model"):
        other.load_weights(wpath)
    meta = os.path.join(ref, open(os.path.join(ref, "CURRENT")).read().strip(), "meta.json")
    data = json.load(open(meta))
    data["format_version"] = 99
    with open(meta, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="format"):
        a.load_state(ref)


def test_non_finite_sampler_weights_are_refused_at_load(make):
    """Weights saved with a NaN (their digest matches: nothing was flipped) fail at load naming
    the file and tensor, not at the first forward."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    path = make().save_weights_for_sampler("nan")
    with safe_open(path, framework="numpy") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["embed"][3, 1] = np.nan  # as a diverged run would have saved it
    meta["data_sha256"] = checkpoint.tensors_digest(tensors)
    save_file(tensors, path, meta)
    with pytest.raises(checkpoint.IntegrityError, match=r"tensor 'embed': 1 of .* NaN or infinite"):
        checkpoint.load_weights(path)
    with pytest.raises(ValueError, match="refusing to load non-finite weights"):
        make(seed=3).load_weights(path)
