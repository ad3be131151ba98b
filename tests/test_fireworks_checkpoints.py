"""The Fireworks checkpoint contract (docs/sft.md#checkpoints-and-resume) over the real SDK.

Against the local server's Fireworks flavour (`runner.serve`), with the behaviours of a hosted
control plane injected as server faults (`tests.test_serve_fireworks.Wire`: renamed, lagging,
ambiguous, missing rows; listing failure; a failed promotion; a deletion that does not take
effect): identity resolution against a pre-save baseline of the control plane's rows, the save
lock, the manifest fields, same-job and cross-job resume (failing closed on an unresolved
identity), promotable snapshots, and final promotion before (and only before) trainer deletion.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings

import jax
import numpy as np
import pytest

pytest.importorskip("aiohttp")

from runner import AdamParams, make_seq  # noqa: E402
from runner import checkpoints as ckpt  # noqa: E402
from runner.checkpoints import CheckpointError  # noqa: E402
from runner.fireworks import FireworksTrainer  # noqa: E402
from runner.serve import BaseModel  # noqa: E402
from tests.test_serve_fireworks import (  # noqa: E402
    BASE,
    CFG,
    Wire,
    connect,
    control_plane,
    fireworks_server,
    served_model,
)

SEQS = [make_seq([1, 2, 3, 4, 5], weights=[0.0, 1.0, 1.0, 0.5])]
ACCOUNT = "foldloss-local"
OTHER = "accounts/fireworks/models/llama-v3p1-8b-instruct"


class World:
    """The server as these tests see it: its control plane's records and the injected faults."""

    def __init__(self, st, wire: Wire) -> None:
        self.st, self.wire = st, wire
        self.control = control_plane(st)

    def __getattr__(self, name):  # the fault knobs and the recorded events
        return getattr(self.wire, name)

    def job(self, job_id: str) -> dict:
        return self.control.jobs[job_id]

    def rows(self, job_id: str) -> list[dict]:
        return self.control.jobs[job_id]["_checkpoints"]

    def rename(self, monkeypatch, fn) -> None:
        """The server stores each DCP under ``fn(name, job record)`` instead of its name."""
        control = self.control
        original = control.add_checkpoint

        def add(ns, name, ref, row_type, promotable):
            if ref.kind == "state":
                name = fn(name, control.job(ns.job))
            return original(ns, name, ref, row_type, promotable)

        monkeypatch.setattr(control, "add_checkpoint", add)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    wire = Wire()
    models = {name: BaseModel(name, dataclasses.replace(CFG, checkpoint_dir=None))
              for name in (BASE, OTHER)}  # fmt: skip
    st = fireworks_server(tmp_path_factory.mktemp("fw-ckpt"), models, wire=wire)
    yield st, wire
    st.stop()


@pytest.fixture
def world(server):
    st, wire = server
    wire.reset()
    made: list[FireworksTrainer] = []
    w = World(st, wire)
    w.made = made
    w.control.models.clear()  # each test promotes its own model ids
    yield w
    wire.reset()
    for t in made:
        t.close()


def trainer_on(world, job_id=None, **kw) -> FireworksTrainer:
    kw.setdefault("identity_timeout_s", 0.2)
    t = connect(
        world.st,
        trainer_job_id=job_id or "",
        base_model=kw.pop("base_model", BASE),
        delete_poll_s=0.01,
        delete_timeout_s=0.2,
        **kw,
    )
    world.made.append(t)
    return t


def train_step(t: FireworksTrainer) -> None:
    t.forward_backward(SEQS, "cross_entropy")
    t.optim_step(AdamParams(learning_rate=1e-2), "none")


def params(world, t: FireworksTrainer):
    return jax.tree.map(np.asarray, served_model(world.st, t).trainer.params)


def step_of(world, t: FireworksTrainer) -> int:
    return served_model(world.st, t).trainer.step


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# -- identity resolution --------------------------------------------------------------------


def test_resolved_identity_has_every_manifest_field(world, tmp_path):
    t = trainer_on(world)
    train_step(t)
    manifest = ckpt.write_checkpoint(
        tmp_path / "ckpts", t, step=1, run_state={"step": 1}, backend="fireworks", promotable=True
    )
    r = manifest["resumable"]
    assert r["identity_resolved"] is True
    assert r["checkpoint_name"] == r["requested_checkpoint_name"]
    assert r["requested_checkpoint_name"].startswith("foldloss-step-1-")
    assert r["checkpoint_resource"] == (
        f"accounts/{ACCOUNT}/rlorTrainerJobs/{t.trainer_job_id}/checkpoints/{r['checkpoint_name']}"
    )
    assert r["checkpoint_type"] == "CHECKPOINT_TYPE_TRAINING"
    assert r["provider_path"] == r["checkpoint_name"]  # the server answers the logical name
    assert r["source_trainer_job_id"] == t.trainer_job_id and r["base_model"] == BASE
    assert r["includes_optimizer_state"] is True and r["checkpoint_kind"] == "fireworks_dcp"
    p = manifest["promotable"]
    assert p["checkpoint_type"] == "CHECKPOINT_TYPE_INFERENCE_BASE"
    assert p["checkpoint_resource"].endswith("/checkpoints/" + p["snapshot_name"])
    assert ckpt.read_manifest(tmp_path / "ckpts", 1)["resumable"] == r


def _dcp_count(job: dict) -> int:
    return sum(r["kind"] == "state" for r in job["_checkpoints"])


def test_a_renamed_checkpoint_is_recorded_under_the_server_name(world, monkeypatch):
    world.rename(monkeypatch, lambda name, job: f"step-{_dcp_count(job) + 1}")
    t = trainer_on(world)
    r = t.save_resumable("foldloss-step-7")
    assert r["identity_resolved"] and r["checkpoint_name"] == "step-1"
    assert r["requested_checkpoint_name"] != "step-1"
    assert r["checkpoint_resource"].endswith("/checkpoints/step-1")


def test_rows_that_appear_late_are_still_resolved(world):
    world.wire.row_lag = 3
    t = trainer_on(world, identity_timeout_s=5.0)
    assert t.save_resumable("s")["identity_resolved"]


@pytest.mark.parametrize(
    "setup, why",
    [
        (lambda w: setattr(w.wire, "extra_rows", True), "candidates=2"),
        (lambda w: setattr(w.wire, "hide_rows", True), "candidates=0"),
        (lambda w: setattr(w.wire, "list_fails", True), "no control-plane baseline"),
    ],
    ids=["ambiguous", "missing", "listing-fails"],
)
def test_unresolved_identities_warn_and_record_none(world, setup, why):
    t = trainer_on(world)
    setup(world)
    with pytest.warns(RuntimeWarning, match=why):
        r = t.save_resumable("s")
    assert r["identity_resolved"] is False
    assert r["checkpoint_resource"] is None and r["checkpoint_type"] is None
    assert r["checkpoint_name"] == r["requested_checkpoint_name"]
    assert r["provider_path"]  # the save itself succeeded


def test_no_control_plane_means_unresolved(world):
    t = trainer_on(world)
    t.control_plane = None
    with pytest.warns(RuntimeWarning, match="no control-plane baseline"):
        assert t.save_resumable("s")["checkpoint_resource"] is None


def test_concurrent_saves_are_serialized_and_each_resolves_its_own_row(world):
    world.wire.save_delay_s = 0.05
    t = trainer_on(world, identity_timeout_s=2.0)
    results = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(t.save_resumable(f"s{i}")))
        for i in range(3)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unresolved identity
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert len(results) == 3 and all(r["identity_resolved"] for r in results)
    assert len({r["checkpoint_resource"] for r in results}) == 3
    for r in results:
        assert r["checkpoint_name"] == r["requested_checkpoint_name"]


def test_listing_failure_during_polling_is_retried(world):
    t = trainer_on(world, identity_timeout_s=2.0)
    original = t.control_plane.list_checkpoints
    calls = []

    def flaky(job_id, *, page_size=200):
        calls.append(1)
        if len(calls) == 2:  # the first poll after the baseline fails
            raise RuntimeError("HTTP 503")
        return original(job_id, page_size=page_size)

    t.control_plane.list_checkpoints = flaky
    assert t.save_resumable("s")["identity_resolved"]


# -- resume ---------------------------------------------------------------------------------


def test_same_job_resume_by_name_restores_weights_and_optimizer(world):
    t = trainer_on(world)
    train_step(t)
    identity = t.save_resumable("s1")
    saved, step = params(world, t), step_of(world, t)
    train_step(t)
    t.load_resumable(identity, with_optimizer=True)
    assert_same(params(world, t), saved)
    assert step_of(world, t) == step
    assert world.events[-1] == ("load", identity["checkpoint_name"])


def test_same_job_resume_of_a_renamed_checkpoint_uses_the_resolved_name(world, monkeypatch):
    world.rename(monkeypatch, lambda name, job: "step-4")
    t = trainer_on(world)
    train_step(t)
    identity = t.save_resumable("s1")
    train_step(t)
    t.load_resumable(identity)
    assert world.events[-1] == ("load", "step-4")


def test_cross_job_resume_uses_a_cross_job_reference(world):
    a = trainer_on(world)
    train_step(a)
    train_step(a)
    identity = a.save_resumable("s2")
    b = trainer_on(world)  # a new trainer job
    assert b.trainer_job_id != a.trainer_job_id
    b.load_resumable(identity, with_optimizer=True)
    ref = f"cross_job://{a.trainer_job_id}/{identity['checkpoint_name']}"
    assert world.events[-1] == ("load", ref)
    assert_same(params(world, b), params(world, a))
    assert step_of(world, b) == step_of(world, a) == 2
    # the optimizer state came along: the next step is identical on both
    train_step(a)
    train_step(b)
    assert_same(params(world, b), params(world, a))


def test_weights_only_resume(world):
    a = trainer_on(world)
    train_step(a)
    identity = a.save_resumable("s1")
    b = trainer_on(world)
    b.load_resumable(identity, with_optimizer=False)
    assert_same(params(world, b), params(world, a))
    assert step_of(world, b) == 0


@pytest.mark.parametrize("resource", [None, ""])
def test_unresolved_cross_job_identity_fails_closed(world, resource):
    a = trainer_on(world)
    world.wire.extra_rows = True
    with pytest.warns(RuntimeWarning):
        identity = a.save_resumable("s1")
    identity["checkpoint_resource"] = resource
    b = trainer_on(world)
    with pytest.raises(CheckpointError, match="no resolved control-plane identity"):
        b.load_resumable(identity)
    assert not [e for e in world.events if e[0] == "load"]


def test_resume_refuses_another_base_model_or_backend(world):
    a = trainer_on(world)
    identity = a.save_resumable("s1")
    b = trainer_on(world, base_model=OTHER)
    with pytest.raises(CheckpointError, match="trained from base model"):
        b.load_resumable(identity)
    with pytest.raises(CheckpointError, match="not a Fireworks DCP"):
        a.load_resumable({**identity, "checkpoint_kind": "local"})
    with pytest.raises(CheckpointError, match="no loadable reference"):
        a.load_resumable({"checkpoint_kind": "fireworks_dcp"})
    with pytest.raises(CheckpointError, match="reference is invalid"):
        a.load_resumable({**identity, "checkpoint_name": "Not A Label"})


def test_main_job_manifest_without_identity_fails_closed(world, tmp_path):
    t = trainer_on(world)
    manifest = ckpt.write_checkpoint(
        tmp_path / "c", t, step=1, run_state={"step": 1}, backend="fireworks", promotable=False
    )
    manifest["resumable"]["checkpoint_name"] = ""
    ckpt.atomic_write_json(tmp_path / "c" / "step_000001" / "manifest.json", manifest)
    with pytest.raises(CheckpointError, match="no resolved identity"):
        ckpt.read_manifest(tmp_path / "c", 1)


# -- promotable snapshots and final promotion -----------------------------------------------


def test_promotable_snapshot_without_a_row_is_recorded_without_resource(world):
    t = trainer_on(world)
    world.wire.hide_rows = True
    with pytest.warns(RuntimeWarning, match="no promotable control-plane row"):
        p = t.save_promotable("s1")
    assert p["checkpoint_resource"] is None and p["snapshot_path"]


def _final_manifest(t: FireworksTrainer, tmp_path, promotable=True) -> dict:
    train_step(t)
    return ckpt.write_checkpoint(
        tmp_path / "c", t, step=3, run_state={"step": 3}, backend="fireworks", promotable=promotable
    )


def test_finalize_without_output_model_keeps_the_trainer(world, tmp_path):
    t = trainer_on(world)
    assert t.finalize(tmp_path, _final_manifest(t, tmp_path)) is None
    assert not world.events or all(e[0] == "load" for e in world.events)
    assert world.job(t.trainer_job_id)["state"] == "JOB_STATE_RUNNING"
    assert not (tmp_path / "fireworks_final_model.json").exists()


def test_finalize_reuses_the_promotable_checkpoint_then_deletes(world, tmp_path):
    t = trainer_on(world, output_model_id="my-final-model")
    manifest = _final_manifest(t, tmp_path)
    rows_before = len(world.rows(t.trainer_job_id))
    record = t.finalize(tmp_path, manifest)
    assert len(world.rows(t.trainer_job_id)) == rows_before  # no new snapshot
    resource = manifest["promotable"]["checkpoint_resource"]
    assert world.events == [("promote", resource), ("delete", t.trainer_job_id)]
    assert record["reused_promotable_checkpoint"] is True
    assert record["trainer_state_after_delete"] == "JOB_STATE_DELETED"
    final = json.loads((tmp_path / "fireworks_final_model.json").read_text())
    assert final["checkpoint_resource"] == resource and final["output_model_id"] == "my-final-model"
    assert final["dcp_checkpoint"] == manifest["resumable"] and final["step"] == 3
    assert final["model"]["name"] == f"accounts/{ACCOUNT}/models/my-final-model"
    cleanup = json.loads((tmp_path / "fireworks_trainer_cleanup.json").read_text())
    assert cleanup == {"trainer_job_id": t.trainer_job_id, "state": "JOB_STATE_DELETED"}
    assert world.control.models["my-final-model"]["checkpoint"] == resource


def test_finalize_saves_a_final_snapshot_when_the_manifest_has_none(world, tmp_path):
    t = trainer_on(world, output_model_id="m-1")
    manifest = _final_manifest(t, tmp_path, promotable=False)
    record = t.finalize(tmp_path, manifest)
    assert record["reused_promotable_checkpoint"] is False
    assert "/checkpoints/foldloss-final-" in record["checkpoint_resource"]
    assert [e[0] for e in world.events] == ["promote", "delete"]


def test_finalize_falls_back_when_the_promotable_record_is_partial(world, tmp_path):
    t = trainer_on(world, output_model_id="m-1")
    manifest = _final_manifest(t, tmp_path)
    manifest["promotable"]["checkpoint_resource"] = None
    record = t.finalize(tmp_path, manifest)
    assert record["reused_promotable_checkpoint"] is False
    assert record["checkpoint_resource"] != manifest["promotable"]["snapshot_path"]


def test_promotion_failure_keeps_the_trainer(world, tmp_path):
    t = trainer_on(world, output_model_id="m-1")
    manifest = _final_manifest(t, tmp_path)
    world.wire.promote_error = "promotion failed: quota"
    with pytest.raises(RuntimeError, match="quota"):
        t.finalize(tmp_path, manifest)
    assert not [e for e in world.events if e[0] == "delete"]
    assert world.job(t.trainer_job_id)["state"] == "JOB_STATE_RUNNING"
    assert not (tmp_path / "fireworks_final_model.json").exists()


def test_no_promotable_row_for_the_final_snapshot_promotes_and_deletes_nothing(world, tmp_path):
    t = trainer_on(world, output_model_id="m-1")
    manifest = _final_manifest(t, tmp_path, promotable=False)
    world.wire.hide_rows = True
    with pytest.raises(CheckpointError, match="no promotable control-plane row"):
        t.finalize(tmp_path, manifest)
    assert world.events == [] and world.job(t.trainer_job_id)["state"] == "JOB_STATE_RUNNING"


def test_a_deletion_that_does_not_take_effect_is_an_error(world, tmp_path):
    t = trainer_on(world, output_model_id="m-1")
    manifest = _final_manifest(t, tmp_path)
    world.wire.delete_noop = True
    with pytest.raises(CheckpointError, match="still JOB_STATE_RUNNING"):
        t.finalize(tmp_path, manifest)
    assert [e[0] for e in world.events] == ["promote", "delete"]
    assert (tmp_path / "fireworks_final_model.json").exists()  # the promotion did happen
    assert not (tmp_path / "fireworks_trainer_cleanup.json").exists()


def test_finalize_can_keep_the_trainer_after_promotion(world, tmp_path):
    t = trainer_on(world, output_model_id="m-1", delete_trainer_after_promotion=False)
    t.finalize(tmp_path, _final_manifest(t, tmp_path))
    assert [e[0] for e in world.events] == ["promote"]
