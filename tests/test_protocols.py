"""Trainer capabilities (runner._protocols): probed once, checked before any work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import runner
from runner import checkpoints as ckpt
from runner._protocols import Capabilities, capabilities, require
from runner.config import load_config
from runner.local import LocalTrainer, LocalTrainerConfig
from tests.fakes import BigramTrainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.toml"
CFG = LocalTrainerConfig(
    vocab_size=16, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32, seed=5
)
ALL = {
    "trainer",
    "checkpointing",
    "sampling",
    "rich_checkpoints",
    "loads_weights",
    "finalizing",
    "closing",
}


def _no_work(*args, **kwargs):
    raise AssertionError("the trainer was used before its capabilities were checked")


class Stub:
    """A trainer with exactly the named methods (and ``builtin_losses``); each fails if called."""

    def __init__(self, *methods: str, builtin_losses=("cross_entropy",)):
        self.builtin_losses = builtin_losses
        for name in methods:
            setattr(self, name, _no_work)


BASIC = ("forward", "forward_backward", "optim_step")
CHECKPOINTS = ("save_state", "load_state", "save_weights_for_sampler")


def test_local_trainer_capabilities(tmp_path):
    caps = capabilities(LocalTrainer(CFG, checkpoint_dir=str(tmp_path)))
    assert caps.names() == {"trainer", "checkpointing", "sampling", "loads_weights"}
    assert caps.can_checkpoint and not caps.rich_checkpoints
    assert caps.type_name == "LocalTrainer"
    assert isinstance(LocalTrainer(CFG), runner.Trainer)


def test_fireworks_trainer_capabilities(tmp_path):
    pytest.importorskip("aiohttp")
    from tests.test_serve_fireworks import connect, fireworks_server

    st = fireworks_server(tmp_path / "fw")
    try:
        trainer = connect(st)
        try:
            caps = capabilities(trainer)
            assert caps.names() == ALL - {"loads_weights"}
            assert caps.type_name == "FireworksTrainer"
        finally:
            trainer.close()
    finally:
        st.stop()


def test_bigram_fake_is_only_a_trainer():
    caps = capabilities(BigramTrainer())
    assert caps.names() == {"trainer"} and not caps.can_checkpoint


def test_capabilities_are_frozen_and_pass_through():
    caps = capabilities(Stub(*BASIC, "sample"))
    assert caps.names() == {"trainer", "sampling"}
    assert capabilities(caps) is caps
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.sampling = False  # type: ignore[misc]
    # A trainer without builtin_losses is not a `Trainer` (the step planner reads it).
    no_kernels = Stub(*BASIC)
    del no_kernels.builtin_losses
    assert not capabilities(no_kernels).trainer
    # Partial method sets do not count.
    assert not capabilities(Stub(*BASIC, "save_state", "load_state")).checkpointing
    assert not capabilities(Stub(*BASIC, "save_resumable", "load_resumable")).rich_checkpoints


def test_require_names_the_missing_capability_and_why():
    t = Stub(*BASIC)
    assert isinstance(require(t, "trainer", why="x"), Capabilities)
    with pytest.raises(ValueError) as exc:
        require(t, "trainer", "sampling", why="rollouts sample from the policy")
    msg = str(exc.value)
    assert "the trainer (Stub) lacks the Sampling (sample) capability" in msg
    assert msg.endswith("rollouts sample from the policy")
    with pytest.raises(ValueError, match=r"Checkpointing \(save_state.*\) or RichCheckpoints"):
        require(t, ("checkpointing", "rich_checkpoints"), why="checkpoints")
    assert require(Stub(*BASIC, *CHECKPOINTS), ("checkpointing", "rich_checkpoints"), why="x")
    with pytest.raises(ValueError, match="unknown capability 'sample'"):
        require(t, "sample", why="x")


# -- runner.checkpoints dispatches on the capabilities -------------------------------------


class Basic:
    builtin_losses = ()

    def __init__(self):
        self.calls = []

    def forward(self, seqs): ...
    def forward_backward(self, seqs, loss_name, config=None): ...
    def optim_step(self, adam, normalization=None): ...

    def save_state(self, name):
        self.calls.append(("save_state", name))
        return f"/state/{name}"

    def load_state(self, ref, with_optimizer=True):
        self.calls.append(("load_state", ref, with_optimizer))

    def save_weights_for_sampler(self, name):
        self.calls.append(("save_weights_for_sampler", name))
        return f"/weights/{name}"


class Rich(Basic):
    def save_resumable(self, name):
        self.calls.append(("save_resumable", name))
        return {"checkpoint_name": name, "rich": True}

    def load_resumable(self, identity, *, with_optimizer=True):
        self.calls.append(("load_resumable", identity["checkpoint_name"], with_optimizer))

    def save_promotable(self, name):
        self.calls.append(("save_promotable", name))
        return {"snapshot_name": name, "rich": True}


def test_checkpoints_dispatch_on_capabilities(tmp_path):
    kw = dict(step=1, run_state={"step": 1}, backend="local", promotable=True)
    basic = Basic()
    m = ckpt.write_checkpoint(tmp_path / "a", basic, **kw)
    assert [c[0] for c in basic.calls] == ["save_state", "save_weights_for_sampler"]
    assert m["resumable"]["provider_path"] == "/state/foldloss-step-1"
    ckpt.load_resumable(basic, m["resumable"], with_optimizer=False)
    assert basic.calls[-1] == ("load_state", "/state/foldloss-step-1", False)

    rich = Rich()
    m = ckpt.write_checkpoint(tmp_path / "b", rich, **kw, caps=capabilities(rich))
    assert [c[0] for c in rich.calls] == ["save_resumable", "save_promotable"]
    assert m["resumable"]["rich"] and m["promotable"]["rich"]
    ckpt.load_resumable(rich, m["resumable"])
    assert rich.calls[-1] == ("load_resumable", "foldloss-step-1", True)

    # The caller's probe decides (no probing at the point of use): Basic caps on a Rich trainer.
    rich.calls.clear()
    ckpt.write_checkpoint(tmp_path / "c", rich, **kw, caps=capabilities(basic))
    assert [c[0] for c in rich.calls] == ["save_state", "save_weights_for_sampler"]

    with pytest.raises(ckpt.CheckpointError, match="cannot be checkpointed"):
        ckpt.write_checkpoint(tmp_path / "d", BigramTrainer(), **kw)
    assert not (tmp_path / "d").exists()  # failed before writing anything
    with pytest.raises(ckpt.CheckpointError, match="cannot be checkpointed"):
        ckpt.load_resumable(BigramTrainer(), {"provider_path": "/x"})


# -- runner.train: fail before any work ---------------------------------------------------


def _cfg(tmp_path, *overrides):
    return load_config(TINY, [f'run.output_dir="{tmp_path}"', *overrides])


def _assert_untouched(cfg):
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


def test_run_without_sampling_fails_before_sft(tmp_path):
    from runner.train import run

    cfg = _cfg(tmp_path)
    assert cfg.rl.steps > 0
    trainer = Stub(*BASIC, *CHECKPOINTS)  # every method raises if called
    with pytest.raises(ValueError) as exc:
        run(cfg, trainer=trainer, progress=False)
    msg = str(exc.value)
    assert "lacks the Sampling (sample) capability" in msg
    assert f"rollouts of the [rl].steps = {cfg.rl.steps} RL steps" in msg
    _assert_untouched(cfg)

    # The bigram fake (forward/forward_backward/optim_step only) is refused the same way.
    with pytest.raises(ValueError, match=r"Sampling \(sample\)"):
        run(cfg, trainer=BigramTrainer(), progress=False)
    _assert_untouched(cfg)


def test_run_with_kl_needs_load_weights(tmp_path):
    from runner.train import check_capabilities, run

    cfg = _cfg(tmp_path, "rl.kl_coef=0.1")
    trainer = Stub(*BASIC, *CHECKPOINTS, "sample")  # no load_weights
    with pytest.raises(ValueError) as exc:
        run(cfg, trainer=trainer, progress=False)
    msg = str(exc.value)
    assert "lacks the LoadsWeights (load_weights) capability" in msg
    assert "[rl].kl_coef > 0 needs a frozen reference model" in msg
    _assert_untouched(cfg)
    # Satisfied with load_weights; and not needed once no RL step is left to run.
    check_capabilities(cfg, Stub(*BASIC, *CHECKPOINTS, "sample", "load_weights"))
    no_rl = _cfg(tmp_path, "rl.kl_coef=0.1", "rl.steps=0")
    check_capabilities(no_rl, trainer)


def test_run_without_checkpoints_fails_before_any_work(tmp_path):
    from runner.train import check_capabilities, run

    cfg = _cfg(tmp_path)
    with pytest.raises(ValueError) as exc:
        run(cfg, trainer=Stub(*BASIC, "sample"), progress=False)
    msg = str(exc.value)
    assert "lacks the RichCheckpoints (save_resumable, load_resumable, save_promotable) or " in msg
    assert "Checkpointing (save_state, load_state, save_weights_for_sampler) capability" in msg
    assert "writes a checkpoint at its last step and every [checkpoint].interval = 2" in msg
    _assert_untouched(cfg)
    rich = Stub(*BASIC, "sample", "save_resumable", "load_resumable", "save_promotable")
    assert check_capabilities(cfg, rich).rich_checkpoints
    with pytest.raises(ValueError, match="--resume restores the checkpoint of step 6"):
        check_capabilities(cfg, Stub(*BASIC, "sample"), start=cfg.total_steps + 1)
    with pytest.raises(ValueError, match="forward_backward and optim_step"):
        check_capabilities(cfg, Stub("forward", "sample", *CHECKPOINTS))


def test_run_closes_a_built_trainer_that_fails_the_check(tmp_path, monkeypatch):
    import runner.train as train_mod

    closed = []
    trainer = Stub(*BASIC, *CHECKPOINTS)
    trainer.close = lambda: closed.append(True)
    monkeypatch.setattr(train_mod, "make_trainer", lambda cfg, run_dir: trainer)
    with pytest.raises(ValueError, match="Sampling"):
        train_mod.run(_cfg(tmp_path), progress=False)
    assert closed == [True]
    run_dir = tmp_path / "tiny"
    # no step, no metrics (the lock file of the one-process-per-run lock, the config, the run id)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.json", "run.json"]
