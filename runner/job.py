"""What a run trains on — the tokenizer, the task and the SFT data — built and checked before any
work (`build_job`), and the SFT data sources with their resumable positions.

Two SFT sources share one interface (``start``, ``batch``, ``position_state``, ``restore``,
``check``):

* `DemoSource` — the task's ``demonstrations(rng, n)``: the batch of SFT step ``k`` is a pure
  function of ``(seed, k)``, so its position is the step;
* `FileBatches` — ``[sft].data`` (`runner.data.FileSource`): epochs of seeded permutations; the
  position ``(epoch, index)`` after each step is recorded in the checkpoint's run state, with the
  file's sha256, and a resume continues from it exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from runner.chat import Renderer, renderer_for
from runner.data import (
    Dataset,
    Example,
    FileSource,
    Position,
    fit_length,
    load_dataset,
    render_record,
)
from runner.tasks import LoadedTask, load_task
from runner.tokenizers import Tokenizer, load_tokenizer


def build_tokenizer(cfg: Any) -> Tokenizer:
    """The ``[tokenizer]`` (`runner.tokenizers.load_tokenizer`), errors naming the key."""
    try:
        return load_tokenizer(cfg.tokenizer.path, cfg.tokenizer.chat_template)
    except ValueError as exc:
        raise ValueError(f"config {exc}") from None


def build_task(cfg: Any, tokenizer: Tokenizer) -> LoadedTask | None:
    """The ``[task]`` (`runner.tasks.load_task`), or ``None`` for ``factory = ""``."""
    if not cfg.task.factory:
        return None
    return load_task(cfg.task.factory, cfg.task.kwargs, tokenizer)


class DemoSource:
    """SFT batches from the task's demonstrations (batch ``k`` drawn with ``rng(seed, 1, k)``)."""

    def __init__(self, cfg: Any, task: LoadedTask, renderer: Renderer):
        self.cfg, self.task, self.renderer = cfg, task, renderer

    def start(self) -> None:
        return None

    def _rendered(self, step: int) -> list[Example]:
        rng = np.random.default_rng([self.cfg.run.seed, 1, step])
        records = self.task.demonstrations(rng, self.cfg.sft.batch_size)
        return [
            render_record(
                r,
                f"task {self.task.name}: demonstration {i} of SFT step {step}",
                self.renderer,
                train_on=self.cfg.sft.train_on,
            )
            for i, r in enumerate(records)
        ]

    def batch(self, step: int, position: None) -> tuple[list[Example], None, dict[str, Any]]:
        kept, truncated = [], 0
        for ex in self._rendered(step):
            fitted = fit_length(ex, self.cfg.model.max_seq_len, self.cfg.sft.overflow)
            if fitted is not None:
                kept.append(fitted)
                truncated += fitted.truncated
        dropped = self.cfg.sft.batch_size - len(kept)
        if not kept:
            raise ValueError(
                f"task {self.task.name}: every demonstration of SFT step {step} is over "
                f"[model].max_seq_len = {self.cfg.model.max_seq_len} and was dropped"
            )
        return kept, None, {"sft/truncated": float(truncated), "sft/dropped": float(dropped)}

    def position_state(self, position: None, step: int) -> dict[str, Any]:
        return {"source": "task", "task": self.task.name, "step": step}

    def restore(self, state: Any) -> None:
        return None

    def check(self, start: int) -> None:
        """Every demonstration still to train (steps ``start..[sft].steps``) against the length
        policy, before any work.

        Raises:
          ValueError: naming the key, the step and the length the longest one needs
            (``overflow = "error"``), or the policy's own error.
        """
        limit, worst = self.cfg.model.max_seq_len, None
        for step in range(start, self.cfg.sft.steps + 1):
            for i, ex in enumerate(self._rendered(step)):
                need = ex.num_model_input
                if self.cfg.sft.overflow != "error":
                    fit_length(ex, limit, self.cfg.sft.overflow)
                elif need > limit and (worst is None or need > worst[0]):
                    worst = (need, step, i)
        if worst is not None:
            need, step, i = worst
            raise ValueError(
                f"config [model].max_seq_len = {limit} is shorter than SFT demonstrations: step "
                f"{step}, example {i} needs {need} model-input tokens; raise it to at least {need}"
            )


class FileBatches:
    """SFT batches from ``[sft].data`` (`runner.data.FileSource`), by position."""

    def __init__(self, cfg: Any, dataset: Dataset):
        self.dataset = dataset
        self.source = FileSource(
            dataset,
            seed=cfg.run.seed,
            batch_size=cfg.sft.batch_size,
            batch_tokens=cfg.sft.batch_tokens,
            shuffle=cfg.sft.shuffle,
        )

    def start(self) -> Position:
        return Position()

    def batch(
        self, step: int, position: Position
    ) -> tuple[list[Example], Position, dict[str, Any]]:
        picked, after = self.source.next_batch(position)
        examples = [self.dataset.examples[i] for i in picked]
        return (
            examples,
            after,
            {
                "sft/truncated": float(sum(e.truncated for e in examples)),
                "data/dropped": float(self.dataset.dropped),
                "data/epoch": float(position.epoch),
                "data/lines": [self.dataset.lines[i] for i in picked],
            },
        )

    def position_state(self, position: Position, step: int) -> dict[str, Any]:
        return self.source.position_state(position)

    def restore(self, state: Any) -> Position:
        return self.source.restore(state)

    def check(self, start: int) -> None:
        return None  # every record was checked when the file was loaded


@dataclasses.dataclass(frozen=True, eq=False)
class Job:
    """The tokenizer, renderer, task and SFT data of a run (`build_job`).

    Attributes:
      sft: `DemoSource` or `FileBatches`, or ``None`` when the run has no SFT steps.
      eval_set: the ``[sft].eval_data`` records (SFT eval NLL), or ``None``.
    """

    tokenizer: Tokenizer
    renderer: Renderer
    task: LoadedTask | None
    sft: DemoSource | FileBatches | None
    eval_set: Dataset | None


def build_job(cfg: Any) -> tuple[Job, Any]:
    """Builds and checks everything the run trains on, before the run directory is touched
    (then `check_job` with the first step to run).

    Returns ``(job, cfg)``: ``cfg`` with ``[sft].steps`` set from the data when ``[sft].epochs``
    is used.

    Raises:
      ValueError: the tokenizer, the task, a data file or a length check (naming the key, the
        file and line, or the task).
    """
    tokenizer = build_tokenizer(cfg)
    renderer = renderer_for(tokenizer)
    task = build_task(cfg, tokenizer)
    limit = cfg.model.max_seq_len
    if task is not None and task.has_max_prompt_tokens:
        prompt = task.max_prompt_tokens()
        if prompt >= limit + 1:
            raise ValueError(
                f"config [model].max_seq_len = {limit} leaves no room for an action after the "
                f"task's longest prompt ({prompt} tokens); raise it above {prompt - 1}"
            )
    common = dict(train_on=cfg.sft.train_on, max_len=limit, overflow=cfg.sft.overflow)
    sft: DemoSource | FileBatches | None = None
    if cfg.sft.data:
        sft = FileBatches(cfg, load_dataset(cfg.sft.data, renderer, key="[sft].data", **common))
        if cfg.sft.epochs:
            steps = sft.source.steps_for_epochs(cfg.sft.epochs)
            cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=steps))
    elif cfg.sft.steps and task is not None and task.has_demonstrations:
        sft = DemoSource(cfg, task, renderer)
    eval_set = None
    if cfg.sft.eval_data:
        eval_set = load_dataset(cfg.sft.eval_data, renderer, key="[sft].eval_data", **common)
    return Job(tokenizer, renderer, task, sft, eval_set), cfg


def check_job(job: Job, cfg: Any, *, start: int) -> None:
    """The checks that depend on the first step to run: every SFT record still to train fits
    (`DemoSource.check`; file records were checked when loaded)."""
    if job.sft is not None and start <= cfg.sft.steps:
        job.sft.check(start)
