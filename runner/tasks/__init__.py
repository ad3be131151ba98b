"""Tasks: the protocol a user's environment implements, and the shipped tasks.

* `Task`, `Env`, `StepResult` — the protocol (`runner.tasks._protocol`);
* `load_task` — ``[task] factory = "package.module:function"`` (`LoadedTask`: checked once);
* `rollout`, `Episode`, `episode_to_seq` — the runner's side (`runner.tasks._rollout`);
* shipped: `runner.tasks.calc` (the calculator tool, default), `runner.tasks.qa` (single-turn
  questions from a JSONL file), `runner.tasks.lookup` (a key-value lookup tool).
"""

from runner.tasks._load import LoadedTask, check_task, load_task
from runner.tasks._protocol import Env, RecoverableError, StepResult, Task
from runner.tasks._rollout import (
    STOP_REASONS,
    Episode,
    episode_to_seq,
    rollout,
    rollout_metrics,
    turn_seed,
)

__all__ = [
    "STOP_REASONS",
    "Env",
    "Episode",
    "LoadedTask",
    "RecoverableError",
    "StepResult",
    "Task",
    "check_task",
    "episode_to_seq",
    "load_task",
    "rollout",
    "rollout_metrics",
    "turn_seed",
]
