"""Experiment tracking: the run's records, config and plot, handed to Weights & Biases and
TensorBoard (``[log]``; docs/tracking.md).

``metrics.jsonl`` is the source of truth; a sink is a copy of it. A record reaches the sinks when
the checkpoint that makes it durable is written (`Tracking.commit`), so a sink holds exactly what
a resume keeps: the records a SIGKILL leaves after the last checkpoint are dropped from
``metrics.jsonl`` on ``--resume`` and recomputed, and a sink that had shown them would show those
steps twice (W&B ignores a step it already has: the stale value would stay). The cost is that a
dashboard is up to ``[checkpoint].interval`` steps behind the JSONL.

Each sink records in ``tracking.json`` (run directory) the last step it was given, so a resume (or
a sink switched on at a resume) is first brought up to the checkpoint from ``metrics.jsonl``.
"Given" is "holds" only for a durable sink (TensorBoard flushes its event file in `log`). W&B's
service buffers its run file (written every ~15 s) and uploads asynchronously, so a SIGKILL loses
what it was given last: a resume gives such a sink every record ``metrics.jsonl`` kept, and the
sink skips the steps it reports holding (online, the W&B server's step; offline, none: the new
offline file holds the whole run, and ``wandb sync`` ignores a step that is not past the last).

A sink is an object with `Sink`'s three methods; `SINKS` lists the kinds (the ``[log]`` key that
enables one, the pip extra that provides its library, its factory); `Tracking.open` builds the
enabled ones. Nothing here imports a sink's library until that sink is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from runner._atomic import atomic_write_json

#: Per-sink delivery state in the run directory: ``{sink name: last step given}``.
STATE_FILE = "tracking.json"
#: Record keys that are not logged as scalars (the step is the x axis; the wall time is the
#: TensorBoard event's own time).
NOT_SCALARS = ("step", "time")


class Sink(Protocol):
    """Where a run's durable records are copied (W&B, TensorBoard, ...)."""

    def log(
        self,
        step: int,
        scalars: Mapping[str, float],
        wall_time: float | None,
        images: Mapping[str, Path],
    ) -> None:
        """One step's scalars and PNG files (the plot, at a checkpoint's step); steps arrive in
        increasing order, each once, and a step is complete when this returns."""

    def close(self, *, ok: bool) -> None:
        """Flushes and closes (``ok``: the run ended without an error)."""


def _holds_through(run: Any) -> int:
    """The last step a resumed W&B run already holds (``run.step`` is the next one: the
    server's, online; 0 offline, where nothing is known)."""
    return int(run.step) - 1


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers as floats, without ``step`` and ``time`` (lists and strings such as
    ``data/lines`` and ``phase`` stay in the JSONL only)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in NOT_SCALARS and isinstance(v, int | float)
    }


class WandbSink:
    """A Weights & Biases run (``[log].wandb``), kept under ``<run dir>/wandb``.

    The W&B run id is the foldloss run id (``run.json``), so ``--resume`` continues the same W&B
    run (``resume="allow"``). ``WANDB_MODE=offline`` writes the run to local files only (``wandb
    sync`` uploads them later). The API key is wandb's own business: it reads ``WANDB_API_KEY``
    (or ``wandb login``'s file) itself; the runner never reads, passes, prints or writes it.
    """

    def __init__(self, cfg: Any, run_dir: Path, run_id: str, *, fresh: bool):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.log.wandb_project,
            entity=cfg.log.wandb_entity or None,
            name=cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=cfg.to_dict(),  # again at a resume: the killed run's file may have lost it
            settings=wandb.Settings(console="off", silent=True, disable_git=True, save_code=False),
        )
        self._holds = -1 if fresh else _holds_through(self.run)

    def log(
        self,
        step: int,
        scalars: Mapping[str, float],
        wall_time: float | None,
        images: Mapping[str, Path],
    ) -> None:
        if step <= self._holds:  # a replayed step the W&B run has (it would drop it, warning)
            return
        row: dict[str, Any] = dict(scalars)
        row.update({tag: self._wandb.Image(str(png)) for tag, png in images.items()})
        # commit: W&B otherwise holds a step's row open until a later step arrives, and a
        # SIGKILL before that would lose the checkpoint's own step
        self.run.log(row, step=step, commit=True)

    def close(self, *, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class TensorBoardSink:
    """TensorBoard event files under ``<run dir>/tensorboard`` (``[log].tensorboard``), written
    with the ``tensorboard`` package alone (no TensorFlow, no torch).

    Scalars are ``simple_value`` summaries tagged with the record's keys; the config is a text
    summary at step 0; the plot an image summary. A resume opens a new event file that starts
    with a ``SessionLog.START`` at the first step not yet given: TensorBoard's reader then
    discards any event of that step or later from an earlier file.
    """

    def __init__(self, cfg: Any, run_dir: Path, run_id: str, *, fresh: bool, start: int):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = event_pb2
        self._writer = EventFileWriter(str(run_dir / "tensorboard"), flush_secs=5)
        if not fresh:
            self._writer.add_event(
                event_pb2.Event(
                    step=start, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)
                )
            )
        if fresh:
            self._add(0, self._text("config", json.dumps(cfg.to_dict(), indent=2)), None)

    def _text(self, tag: str, text: str):
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

        meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        )
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        return summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)

    def _add(self, step: int, values, wall_time: float | None) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = values if isinstance(values, list) else [values]
        event = self._pb.Event(step=step, summary=summary_pb2.Summary(value=values))
        if wall_time is not None:
            event.wall_time = wall_time
        self._writer.add_event(event)

    def log(
        self,
        step: int,
        scalars: Mapping[str, float],
        wall_time: float | None,
        images: Mapping[str, Path],
    ) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        for tag, png in images.items():
            data = png.read_bytes()
            width, height = struct.unpack(">II", data[16:24])  # the PNG's IHDR chunk
            image = summary_pb2.Summary.Image(
                height=height, width=width, colorspace=4, encoded_image_string=data
            )
            values.append(summary_pb2.Summary.Value(tag=tag, image=image))
        self._add(step, values, wall_time)
        self._writer.flush()

    def close(self, *, ok: bool) -> None:
        self._writer.close()


@dataclasses.dataclass(frozen=True)
class SinkKind:
    """One kind of sink: enabled by ``[log].<key> = true``, its library from ``pip install
    'foldloss[<extra>]'`` (import name ``module``), built by ``build(cfg, run_dir, run_id, fresh=,
    start=)``. ``durable``: a step is on disk when ``log`` returns; a sink that buffers is given
    every kept record again at a resume (module docstring)."""

    key: str
    extra: str
    module: str
    build: Callable[..., Sink]
    durable: bool


#: Every sink the runner can feed, in the order they are given records.
SINKS: tuple[SinkKind, ...] = (
    SinkKind(
        "wandb",
        "wandb",
        "wandb",
        lambda cfg, run_dir, run_id, *, fresh, start: WandbSink(cfg, run_dir, run_id, fresh=fresh),
        durable=False,
    ),
    SinkKind("tensorboard", "tensorboard", "tensorboard", TensorBoardSink, durable=True),
)


def check_extras(cfg: Any) -> None:
    """Config-load check: every enabled sink's library imports.

    Raises:
      ValueError: one line naming the key and the extra to install.
    """
    for kind in SINKS:
        if not getattr(cfg.log, kind.key):
            continue
        try:
            importlib.import_module(kind.module)
        except ImportError:
            raise ValueError(
                f"config [log].{kind.key} = true needs the {kind.module} package: "
                f"pip install 'foldloss[{kind.extra}]'"
            ) from None


class Tracking:
    """The enabled sinks of one run and what each has been given (``tracking.json``)."""

    def __init__(self, sinks: dict[str, Sink], state_path: Path | None, delivered: int):
        self.sinks = sinks
        self.state_path = state_path
        self.delivered = delivered  # every sink has every record up to this step

    @classmethod
    def disabled(cls) -> Tracking:
        return cls({}, None, -1)

    @classmethod
    def open(
        cls,
        cfg: Any,
        run_dir: Path,
        run_id: str,
        records: Sequence[Mapping[str, Any]],
        *,
        resume: bool,
        plot: Path | None = None,
    ) -> Tracking:
        """Builds the sinks ``[log]`` enables and brings each up to ``records`` (the records
        ``metrics.jsonl`` kept: on ``--resume``, those up to the checkpoint).

        A fresh run's sinks get the config; a resumed run's get what they lack of ``records``
        (all of them for a sink switched on at this resume, which then also gets the config; all
        of them and the config for a sink that is not ``durable``), ``plot`` with the last.
        """
        kinds = [k for k in SINKS if getattr(cfg.log, k.key)]
        if not kinds:
            return cls.disabled()
        state_path = run_dir / STATE_FILE
        state: Any = {}
        if resume and state_path.exists():
            try:
                state = json.loads(state_path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                state = None
            if not isinstance(state, dict) or not all(isinstance(v, int) for v in state.values()):
                raise ValueError(
                    f"--resume: {state_path} is not a JSON object of steps; delete it to give "
                    "the sinks the whole run again"
                )
        last = records[-1]["step"] if records else -1
        sinks: dict[str, Sink] = {}
        tracking = cls(sinks, state_path, last)
        images = {"plot": plot} if plot is not None and plot.exists() else {}
        try:
            for kind in kinds:
                had = state.get(kind.key)
                fresh = had is None
                sink = kind.build(
                    cfg, run_dir, run_id, fresh=fresh, start=(-1 if fresh else had) + 1
                )
                sinks[kind.key] = sink
                after = -1 if fresh or not kind.durable else had
                _deliver(sink, records, after=after, through=last, images=images)
            tracking._save()
        except BaseException:
            tracking.close(ok=False)
            raise
        return tracking

    def commit(
        self, records: Sequence[Mapping[str, Any]], step: int, plot: Path | None = None
    ) -> None:
        """The checkpoint of ``step`` is written: every sink gets the records after the last
        commit up to ``step``, then the plot at ``step``."""
        if not self.sinks:
            return
        images = {"plot": plot} if plot is not None and plot.exists() else {}
        for sink in self.sinks.values():
            _deliver(sink, records, after=self.delivered, through=step, images=images)
        self.delivered = step
        self._save()

    def _save(self) -> None:
        atomic_write_json(self.state_path, {name: self.delivered for name in self.sinks})

    def close(self, *, ok: bool = True) -> None:
        """Closes every sink (all of them, even when one raises)."""
        sinks, self.sinks = list(self.sinks.values()), {}
        error = None
        for sink in sinks:
            try:
                sink.close(ok=ok)
            except Exception as exc:  # the others still close; the first error is raised
                error = error or exc
        if error is not None:
            raise error


def _deliver(
    sink: Sink,
    records: Sequence[Mapping[str, Any]],
    *,
    after: int,
    through: int,
    images: Mapping[str, Path] | None = None,
) -> None:
    """Gives ``sink`` the records with ``after < step <= through``, ``images`` with the record of
    step ``through`` (scanning back from the end: a commit costs the records it sends, not the
    run's length)."""
    start = len(records)
    while start > 0 and records[start - 1]["step"] > after:
        start -= 1
    for r in records[start:]:
        if r["step"] > through:
            break
        t = r.get("time")
        wall = t if isinstance(t, float) and math.isfinite(t) else None
        sink.log(r["step"], scalars(r), wall, (images or {}) if r["step"] == through else {})
