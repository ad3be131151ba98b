"""Environments for the runner: a character-level tokenizer and a multi-turn calculator task.

See `runner.env.calc` for the text protocol and the mask conventions.
"""

from runner.env import tokenizer
from runner.env.calc import (
    STOP_TOKEN_IDS,
    CalcEnv,
    CalcError,
    Observation,
    Problem,
    Segment,
    StepResult,
    Trajectory,
    evaluate,
    expert_actions,
    expert_sft_example,
    expert_trajectory,
    rollout,
    tool_output,
    trajectory_to_seq,
)

__all__ = [
    "STOP_TOKEN_IDS",
    "CalcEnv",
    "CalcError",
    "Observation",
    "Problem",
    "Segment",
    "StepResult",
    "Trajectory",
    "evaluate",
    "expert_actions",
    "expert_sft_example",
    "expert_trajectory",
    "rollout",
    "tokenizer",
    "tool_output",
    "trajectory_to_seq",
]
