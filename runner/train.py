"""The main job: SFT (the user's JSONL data or the task's demonstrations), then RL on the
configured task (`runner.tasks`; the calculator by default) with GRPO + ECHO or ``[rl].loss``.

One global step counter spans both phases (steps ``1..sft.steps`` are SFT, the rest RL). Every
random choice of step ``k`` (its problems, its sampling seed) is derived from ``(seed, k)``, and
the SFT data position after each step is part of the checkpoint's run state (`runner.job`), so a
run resumed from the checkpoint of step ``N`` continues at ``N + 1`` exactly as the uninterrupted
run would have: the state is the trainer's (weights + optimizer, restored exactly), ``N`` and the
data position. What the run trains on is built and checked by `runner.job.build_job`, one step of
each phase is `runner.steps`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner import checkpoints as ckpt
from runner._atomic import atomic_write_text
from runner._digests import tree_digests
from runner._lock import check_unlocked, run_lock
from runner._protocols import Capabilities, Trainer, capabilities, require
from runner._step import StepRunner
from runner._types import NonFiniteUpdateError
from runner.backends import backend
from runner.config import Config, identity_diff, reference_reason, rl_loss
from runner.job import build_job, check_job
from runner.steps import eval_nll, eval_problems, evaluate, rl_step, sft_step
from runner.tracking import STATE_FILE, Tracking


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    last_step: int
    metrics: list[dict[str, Any]]


def make_trainer(cfg: Config, run_dir: Path) -> Trainer:
    """The configured backend's trainer (``local`` by default).

    `run` probes its capabilities once, right after building it (`check_capabilities`).
    """
    return backend(cfg.run.backend).make_trainer(cfg, run_dir)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step, appended and flushed."""

    def __init__(self, path: Path, resume_after: int | None):
        self.path = path
        self.records: list[dict[str, Any]] = []
        if resume_after is not None and path.exists():
            # Keep the records up to the checkpoint; every line after the checkpoint's own record
            # (written before an interruption, possibly torn mid-line) is dropped unread.
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if self.records and self.records[-1].get("step", -1) >= resume_after:
                    break
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ckpt.CheckpointError(
                        f"{path} line {number} is not valid JSON ({exc.msg}), before the record of "
                        f"checkpointed step {resume_after}: fix or remove the line to resume"
                    ) from None
                if not isinstance(rec, dict):
                    raise ckpt.CheckpointError(f"{path} line {number} is not a JSON object")
                if rec.get("step", 0) <= resume_after:
                    self.records.append(rec)
        if resume_after is not None and not any(
            r.get("step") == resume_after for r in self.records
        ):  # emptied, deleted or cut: resuming would lose the history silently
            state = "is missing" if not path.exists() else "has no record of that step"
            raise ckpt.CheckpointError(
                f"--resume: the checkpoint is at step {resume_after} but {path} {state}: the "
                "run's metrics before it would be lost; restore the file from a backup"
            )
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _clear_unfinished(run_dir: Path) -> None:
    """Removes what a run stopped before its first checkpoint left (``--restart``)."""
    for name in ("metrics.jsonl", "plot.png", "config.json", "reference.safetensors", RUN_FILE):
        (run_dir / name).unlink(missing_ok=True)
    (run_dir / STATE_FILE).unlink(missing_ok=True)  # (the W&B run of the new id is another run)
    for name in ("checkpoints", "trainer", "reference_trainer", "tensorboard"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def _changed_keys(run_dir: Path, cfg: Config) -> str:
    """``": [sft].learning_rate = 0.003 -> 0.1, ..."``: the settings that differ from the run's
    ``config.json`` (its last start's), or ``""`` when it cannot be read."""
    try:
        old = json.loads((run_dir / "config.json").read_text())
        changed = identity_diff(old, cfg.to_dict()) if isinstance(old, dict) else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    return f": {', '.join(changed)}" if changed else ""


def _check_resume_steps(cfg: Config, latest: int, run_state: dict[str, Any]) -> None:
    """Step counts may change on resume, but never so that they rewrite what already ran.

    Raises:
      CheckpointError: the new total ends before the checkpoint; RL had begun and ``[sft].steps``
        changed (later steps would be relabelled SFT, or the SFT/RL boundary moved); the
        checkpoint is in SFT and ``[sft].steps`` shrank below it.
    """
    if cfg.total_steps < latest:
        raise ckpt.CheckpointError(
            f"--resume: the run is at step {latest}, but [sft].steps + [rl].steps = "
            f"{cfg.total_steps}: a resume cannot shorten a run below its checkpoint"
        )
    phase, old_sft = run_state.get("phase"), run_state.get("sft_steps")
    if phase == "rl":
        moved = cfg.sft.steps != old_sft if old_sft is not None else cfg.sft.steps >= latest
        if moved:
            was = f"{old_sft}" if old_sft is not None else f"< {latest}"
            raise ckpt.CheckpointError(
                f"--resume: RL had begun (checkpoint at step {latest}, [sft].steps was {was}); "
                f"[sft].steps = {cfg.sft.steps} would rewrite the phases: keep it and change "
                "[rl].steps"
            )
    elif phase == "sft" and cfg.sft.steps < latest:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint is SFT step {latest}; [sft].steps = {cfg.sft.steps} would "
            "end SFT before steps that already ran"
        )


#: The run's identity file: ``{"run_id": ...}``, written once when a run starts.
RUN_FILE = "run.json"
REFERENCE_FILE = "reference.safetensors"


def new_run_id(run_dir: Path) -> str:
    """Creates the run's id (``run.json``) at the start of a fresh run."""
    run_id = uuid.uuid4().hex
    atomic_write_text(run_dir / RUN_FILE, json.dumps({"run_id": run_id}) + "\n")
    return run_id


def checkpoint_prefix(run_id: str) -> str:
    """The name prefix of a run's checkpoints (the run id in every saved state's name)."""
    return f"foldloss-{run_id[:8]}"


def checkpoint_name(run_id: str, step: int) -> str:
    """The resumable state's name at ``step`` (what `runner.checkpoints.write_checkpoint` uses)."""
    return f"{checkpoint_prefix(run_id)}-step-{step}"


def read_run_id(run_dir: Path) -> str:
    """The id in ``run_dir/run.json`` (fail closed when it is missing or corrupt)."""
    path = run_dir / RUN_FILE
    try:
        run_id = json.loads(path.read_text()).get("run_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ckpt.CheckpointError(
            f"--resume: the run's identity file {path} is missing or corrupt ({exc}); this "
            "directory cannot be resumed"
        ) from None
    if not isinstance(run_id, str) or not run_id:
        raise ckpt.CheckpointError(f"--resume: {path} records no run_id")
    return run_id


def _reference_trainer(
    cfg: Config, trainer: Trainer, run_dir: Path, recorded: dict[str, Any] | None
) -> Trainer:
    """A frozen copy of the policy at the start of RL, for the KL penalty (local backend).

    ``recorded``: the checkpoint's ``{"path", "sha256"}`` of the reference when it was saved
    before the checkpoint (the file is verified before it is loaded); ``None``: the reference
    is (re)created from the current policy (a resume from before RL, or a fresh RL start).
    """
    reason = reference_reason(cfg)
    if not backend(cfg.run.backend).in_process:
        raise ValueError(
            f"{reason} needs a reference model; it is supported on the local backend only"
        )
    ref_path = run_dir / REFERENCE_FILE
    if recorded is None:
        shutil.copyfile(trainer.save_weights_for_sampler("reference"), ref_path)
    else:
        ckpt.verify_files(run_dir, recorded, "path", "KL reference")
    reference = make_trainer(cfg, run_dir / "reference_trainer")
    require(reference, "trainer", "loads_weights", why=_KL_WHY.format(reason=reason))
    reference.load_weights(str(ref_path))
    return reference


_KL_WHY = (
    "{reason} needs a frozen reference model: the policy's weights are saved with "
    "save_weights_for_sampler and loaded into a second trainer of the same backend with "
    "load_weights (the local backend has both)"
)


def non_finite_message(cfg: Config, step: int, problem: str) -> str:
    """``step N (phase): <problem>; stopped before ...``, naming the settings that usually cause
    a NaN/inf loss or gradient."""
    sft = step <= cfg.sft.steps
    lr = f"[{'sft' if sft else 'rl'}].learning_rate = {cfg.sft.learning_rate if sft else cfg.rl.learning_rate:g}"
    return (
        f"step {step} ({'sft' if sft else 'rl'}): {problem}; the run stopped before this step's "
        f"optimizer update and checkpoint. Likely cause: {lr} too large, or [optim].eps = "
        f"{cfg.optim.eps:g} too small (eps = 0 divides by a zero second moment)"
    )


def check_finite(step: int, metrics: dict[str, Any]) -> None:
    """Raises `NonFiniteUpdateError` when a loss or gradient-norm metric is NaN/inf (a hosted
    backend that applied the update anyway: the step is still not checkpointed)."""
    bad = sorted(
        k
        for k, v in metrics.items()
        if (k.endswith(("loss", "nll", "loss:sum")) or k == "optim/grad_norm")
        and isinstance(v, float)
        and not math.isfinite(v)
    )
    if bad:
        raise NonFiniteUpdateError(f"{', '.join(f'{k} = {metrics[k]}' for k in bad)}")


def check_capabilities(cfg: Config, trainer: Any, *, start: int = 1) -> Capabilities:
    """Checks that ``trainer`` (or its `Capabilities`) can do what ``cfg`` asks from ``start`` on.

    Called by `run` right after the trainer is built (or received), before any step, evaluation
    or checkpoint load, so a missing capability fails at once rather than after the SFT phase.

    Raises:
      ValueError: naming the missing capability (its Protocol and methods) and the config
        setting that needs it (`runner.require`).
    """
    caps = capabilities(trainer)
    total = cfg.total_steps
    require(
        caps,
        "trainer",
        why="every step runs forward_backward and optim_step, and the step planner reads "
        "builtin_losses",
    )
    rl_left = max(start, cfg.sft.steps + 1) <= total  # an RL step is still to run
    if start <= total:  # the step-0 evaluation (start == 1), later evaluations, RL rollouts
        rollouts = (
            f" and the rollouts of the [rl].steps = {cfg.rl.steps} RL steps" if rl_left else ""
        )
        require(
            caps,
            "sampling",
            why="the main job samples from the policy for its held-out evaluations (step 0 and "
            f"the end of each phase){rollouts}",
        )
    if start > 1:
        require(
            caps,
            ("rich_checkpoints", "checkpointing"),
            why=f"--resume restores the checkpoint of step {start - 1}",
        )
    if start <= total:
        every = (
            f" and every [checkpoint].interval = {cfg.checkpoint.interval} steps"
            if cfg.checkpoint.interval
            else ""
        )
        require(
            caps,
            ("rich_checkpoints", "checkpointing"),
            why=f"the run writes a checkpoint at its last step{every}",
        )
    reason = reference_reason(cfg)
    if reason is not None and rl_left:
        require(caps, "loads_weights", "checkpointing", why=_KL_WHY.format(reason=reason))
    return caps


def run(
    cfg: Config,
    *,
    resume: bool = False,
    trainer: Trainer | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    progress: bool | str = True,
    restart: bool = False,
) -> RunResult:
    """Runs (or resumes) the main job; returns the metrics of every step.

    Args:
      cfg: the validated `Config`.
      resume: continue from the latest checkpoint of ``runs/<name>`` (fail closed if there is
        none, if it cannot be resolved, or if the config changed what the run computes).
      trainer: an already-built trainer (tests; the Fireworks fake); default: `make_trainer`.
        Its capabilities are checked against the config (`check_capabilities`) before any work.
      on_step: callback after each step's metrics are written.
      progress: a `runner.progress.Progress` mode: ``"bar"`` (True: a rich progress bar),
        ``"lines"`` (a plain line every few steps, for a log) or ``"off"`` (False).
    """
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    ckpt_root = run_dir / "checkpoints"
    start = 1
    manifest = None
    check_unlocked(run_dir)  # a run in progress is named before anything else is said about it
    job, cfg = build_job(cfg)  # the tokenizer, task and data ([sft].epochs sets [sft].steps)
    if restart:
        if resume:
            raise ValueError("--restart and --resume exclude each other")
        latest = ckpt.latest_step(ckpt_root) if run_dir.exists() else None
        if latest is not None:
            raise ckpt.CheckpointError(
                f"--restart: {run_dir} has a checkpoint at step {latest}; --resume continues it "
                "(--restart only starts over a run stopped before its first checkpoint)"
            )
    if resume:
        latest = ckpt.latest_step(ckpt_root)
        if latest is None:
            raise ckpt.CheckpointError(
                f"--resume: no checkpoint in {ckpt_root} (no 'latest' marker)"
            )
        ckpt.check_marker_consistency(ckpt_root, latest, cfg.checkpoint.interval)
        manifest = ckpt.read_manifest(ckpt_root, latest)
        saved = manifest["run_state"].get("config_identity")
        if saved != cfg.identity():
            raise ckpt.CheckpointError(
                f"--resume: the config differs from the checkpointed run's (identity {saved} vs "
                f"{cfg.identity()}{_changed_keys(run_dir, cfg)}); only step counts, names and "
                "checkpoint settings may change"
            )
        if manifest["backend"] != cfg.run.backend:
            raise ckpt.CheckpointError(
                f"--resume: the checkpoint was written by backend {manifest['backend']!r}, not "
                f"{cfg.run.backend!r}"
            )
        _check_resume_steps(cfg, latest, manifest["run_state"])
        run_id = read_run_id(run_dir)
        if manifest["run_state"].get("run_id") != run_id:
            raise ckpt.CheckpointError(
                f"--resume: checkpoint step {latest} belongs to run "
                f"{manifest['run_state'].get('run_id')!r}, not to this directory's run {run_id!r} "
                f"({run_dir / RUN_FILE}); refusing to load another run's state"
            )
        expected = checkpoint_name(run_id, latest)
        if manifest.get("saved_as") != expected:
            raise ckpt.CheckpointError(
                f"--resume: checkpoint step {latest} names resumable state "
                f"{manifest.get('saved_as')!r}, not this run's {expected!r}: "
                "refusing to load state saved at another step or by another run"
            )
        ckpt.verify_promotable(run_dir, manifest)
        start = latest + 1
    elif not restart and ((ckpt_root / "latest").exists() or (run_dir / "metrics.jsonl").exists()):
        has = (ckpt_root / "latest").exists()
        raise ValueError(
            f"run directory {run_dir} already holds a run: "
            + (
                "pass --resume to continue it or choose another --name"
                if has
                else "it stopped before its first checkpoint; pass --restart to start it over or "
                "choose another --name"
            )
        )
    check_job(job, cfg, start=start)
    sft_pos = job.sft.start() if job.sft is not None else None
    if manifest is not None and job.sft is not None and start <= cfg.sft.steps:
        sft_pos = job.sft.restore(manifest["run_state"].get("data_position"))
    held_out = eval_problems(cfg, job.task) if job.task is not None else None
    owned = trainer is None
    if not owned:  # a received trainer: check it before the run directory is touched
        caps = check_capabilities(cfg, trainer, start=start)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir):
        # Under the lock, the state the checks above saw must still hold (another process may
        # have run in between).
        now = ckpt.latest_step(ckpt_root) if resume else None
        if resume and now != start - 1:
            raise ckpt.CheckpointError(
                f"--resume: the run's latest checkpoint changed to {now} while starting"
            )
        if restart:
            if (ckpt_root / "latest").exists():
                raise ckpt.CheckpointError(f"--restart: {run_dir} got a checkpoint meanwhile")
            _clear_unfinished(run_dir)
        elif not resume and (
            (ckpt_root / "latest").exists() or (run_dir / "metrics.jsonl").exists()
        ):
            raise ValueError(f"run directory {run_dir} already holds a run (written meanwhile)")
        if not resume:
            run_id = new_run_id(run_dir)
        atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        if owned:
            trainer = make_trainer(cfg, run_dir)
            caps = capabilities(trainer)  # probed once, right after it is built
        tracking, ok = Tracking.disabled(), False  # W&B / TensorBoard copies ([log])
        rollouts = None  # the concurrent rollout service (runner._pipeline), from the first RL step
        try:
            if owned:  # (a failed check still closes the trainer, below)
                check_capabilities(cfg, caps, start=start)
            if manifest is not None:
                ckpt.load_resumable(
                    trainer,
                    manifest["resumable"],
                    with_optimizer=True,
                    caps=caps,
                    run_dir=run_dir,
                    expected_name=manifest["saved_as"],
                )
            log = MetricsLog(run_dir / "metrics.jsonl", start - 1 if resume else None)
            from runner.plot import plot_metrics

            if resume and log.records:  # the checkpoint's plot (a kill may have come before it)
                plot_metrics(log.records, run_dir / "plot.png")
            tracking = Tracking.open(
                cfg, run_dir, run_id, log.records, resume=resume, plot=run_dir / "plot.png"
            )
            step_runner = StepRunner(rl_loss(cfg), mode=cfg.rl.mode)
            reference = None
            # The KL reference as the checkpoint recorded it (verified before it is loaded).
            reference_record = (manifest or {}).get("run_state", {}).get("reference")
            total = cfg.total_steps
            last_manifest = manifest

            from runner.progress import Progress  # rich is optional at import time

            def evaluations(step: int) -> dict[str, float]:
                """Held-out reward (step 0, the end of each phase) and SFT eval NLL (step 0,
                every [sft].eval_every SFT steps, the end of SFT)."""
                out = {}
                sft_end = step == cfg.sft.steps
                if held_out is not None and (step == 0 or sft_end or step == total):
                    out["eval_reward"] = evaluate(cfg, trainer, job.task, held_out)
                every = cfg.sft.eval_every
                if job.eval_set is not None and (
                    step == 0 or sft_end or (every and step % every == 0 and step < cfg.sft.steps)
                ):
                    out["sft/eval_nll"] = eval_nll(
                        trainer, job.eval_set.examples, cfg.sft.batch_size
                    )
                return out

            def checkpoint(step: int) -> None:
                nonlocal last_manifest
                run_state = {
                    "step": step,
                    "phase": "sft" if step <= cfg.sft.steps else "rl",
                    "sft_steps": cfg.sft.steps,
                    "config_identity": cfg.identity(),
                    "seed": cfg.run.seed,
                    "data_position": (
                        job.sft.position_state(sft_pos, min(step, cfg.sft.steps))
                        if job.sft is not None
                        else None
                    ),
                    "run_id": run_id,
                }
                if reference is not None:
                    run_state["reference"] = reference_record
                if rollouts is not None:  # the first problem no trained step consumed
                    run_state["rollouts"] = rollouts.durable_state()
                last_manifest = ckpt.write_checkpoint(
                    ckpt_root,
                    trainer,
                    step=step,
                    run_state=run_state,
                    backend=cfg.run.backend,
                    promotable=cfg.checkpoint.save_promotable,
                    caps=caps,
                    prefix=checkpoint_prefix(run_id),
                )
                plot_metrics(log.records, run_dir / "plot.png")
                tracking.commit(log.records, step, run_dir / "plot.png")  # now durable

            step = start
            mode = progress if isinstance(progress, str) else ("bar" if progress else "off")
            with Progress(total=total, start=start - 1, mode=mode) as bar:
                if start == 1:
                    log.append({"step": 0, "phase": "eval", **evaluations(0), "time": time.time()})
                for step in range(start, total + 1):
                    t0 = time.perf_counter()
                    if step <= cfg.sft.steps:
                        examples, sft_pos, data_metrics = job.sft.batch(step, sft_pos)
                        metrics = sft_step(cfg, trainer, examples, job.tokenizer.pad_id)
                        metrics.update(data_metrics)
                        phase = "sft"
                    else:
                        if reference is None and reference_reason(cfg) is not None:
                            reference = _reference_trainer(cfg, trainer, run_dir, reference_record)
                            reference_record = {
                                "path": REFERENCE_FILE,
                                "sha256": tree_digests(run_dir / REFERENCE_FILE, run_dir),
                            }
                        if rollouts is None and cfg.rl.rollout == "concurrent":
                            from runner._pipeline import start_rollouts

                            rollouts = start_rollouts(cfg, trainer, job.task, step, last_manifest)
                        extra = {} if rollouts is None else {"rollouts": rollouts}
                        metrics = rl_step(
                            cfg, trainer, job.task, step, step_runner, reference, **extra
                        )
                        phase = "rl"
                    elapsed = time.perf_counter() - t0
                    metrics["tokens_per_s"] = metrics["tokens"] / max(elapsed, 1e-9)
                    metrics["step_time_s"] = elapsed
                    check_finite(step, metrics)  # before this step's checkpoint
                    metrics.update(evaluations(step))
                    record = {"step": step, "phase": phase, "time": time.time(), **metrics}
                    log.append(record)
                    bar.update(step, record)
                    interval = cfg.checkpoint.interval
                    if (interval and step % interval == 0) or step == total:
                        checkpoint(step)
                    if on_step is not None:
                        on_step(step, record)
            if caps.finalizing:  # a hosted backend's final promotion, then cleanup
                trainer.finalize(run_dir, last_manifest)
            ok = True
            return RunResult(run_dir=run_dir, last_step=total, metrics=log.records)
        except NonFiniteUpdateError as exc:  # the trainer refused the update: name the cause
            raise NonFiniteUpdateError(non_finite_message(cfg, step, str(exc))) from None
        finally:
            tracking.close(ok=ok)
            if rollouts is not None:
                rollouts.close()
            if job.task is not None:
                job.task.cleanup()
            if owned and caps.closing:  # e.g. the Fireworks sampling client/service
                trainer.close()
