"""foldloss `losses`: RL post-training loss terms over per-token logprobs, in pure JAX.

Every term has the signature ``term(logprobs[B, T], batch) -> (loss, metrics)``; compose terms
with `fold`. See DESIGN.md §3-4 for the data conventions.
"""

from losses._advantages import ESTIMATORS, group_advantages
from losses._batch import Batch, Term
from losses._checks import check_batch
from losses._common import KL_ESTIMATORS
from losses._env import ENV_NORMALIZATIONS, echo_env, echo_env_weights, observation_mask
from losses._fold import fold
from losses._grpo import grpo, ppo_clip_terms
from losses._policy import cispo, dro, importance_sampling, policy_term, ppo
from losses._reductions import REDUCTIONS, active_rows, reduction_weights, term_weights
from losses._sft import sft_cross_entropy, weighted_cross_entropy
from losses._split import row_slices, split_batch, with_normalizers

__all__ = [
    "Batch",
    "Term",
    "ENV_NORMALIZATIONS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "REDUCTIONS",
    "active_rows",
    "check_batch",
    "cispo",
    "dro",
    "echo_env",
    "echo_env_weights",
    "fold",
    "group_advantages",
    "grpo",
    "importance_sampling",
    "observation_mask",
    "policy_term",
    "ppo",
    "ppo_clip_terms",
    "reduction_weights",
    "row_slices",
    "sft_cross_entropy",
    "split_batch",
    "term_weights",
    "weighted_cross_entropy",
    "with_normalizers",
]
