"""foldloss `losses`: RL post-training loss terms over per-token logprobs, in pure JAX.

Every term has the signature ``term(logprobs[B, T], batch) -> (loss, metrics)``; compose terms
with `fold`. See DESIGN.md §3-4 for the data conventions.
"""

from losses._advantages import ESTIMATORS, group_advantages
from losses._batch import (
    DATA_FIELDS,
    FIELDS,
    NORMALIZER_FIELDS,
    Batch,
    Term,
    Twin,
    UnknownFieldError,
)
from losses._checks import MAX_LOGPROB, any_violation, check_batch
from losses._common import KL_ESTIMATORS, ppo_clip_terms
from losses._correction import (
    CORRECTION_KINDS,
    CORRECTION_LEVELS,
    MismatchCorrection,
    mismatch_correction,
)
from losses._env import ENV_NORMALIZATIONS, echo_env, echo_env_weights, observation_mask
from losses._fold import fold
from losses._grpo import grpo
from losses._policy import (
    DIVERGENCES,
    cispo,
    dapo,
    dppo,
    dro,
    importance_sampling,
    policy_term,
    ppo,
    reinforce,
    sapo,
)
from losses._policy_seq import gmpo, gspo
from losses._reductions import REDUCTIONS, active_rows, reduction_weights, term_weights
from losses._sft import sft_cross_entropy, weighted_cross_entropy
from losses._split import row_slices, split_batch, with_normalizers
from losses._twin import builtin_twin

__all__ = [
    "Batch",
    "DATA_FIELDS",
    "FIELDS",
    "MAX_LOGPROB",
    "NORMALIZER_FIELDS",
    "Twin",
    "UnknownFieldError",
    "any_violation",
    "MismatchCorrection",
    "Term",
    "CORRECTION_KINDS",
    "CORRECTION_LEVELS",
    "DIVERGENCES",
    "ENV_NORMALIZATIONS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "REDUCTIONS",
    "active_rows",
    "builtin_twin",
    "check_batch",
    "cispo",
    "dapo",
    "dppo",
    "dro",
    "echo_env",
    "echo_env_weights",
    "fold",
    "gmpo",
    "group_advantages",
    "grpo",
    "gspo",
    "importance_sampling",
    "mismatch_correction",
    "observation_mask",
    "policy_term",
    "ppo",
    "ppo_clip_terms",
    "reduction_weights",
    "reinforce",
    "row_slices",
    "sapo",
    "sft_cross_entropy",
    "split_batch",
    "term_weights",
    "weighted_cross_entropy",
    "with_normalizers",
]
