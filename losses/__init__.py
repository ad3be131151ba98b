"""foldloss `losses`: RL post-training loss terms over per-token logprobs, in pure JAX.

Every term has the signature ``term(logprobs[B, T], batch) -> (loss, metrics)``; compose terms
with `fold`. See docs/conventions.md#data-conventions (and #the-losses-contract) for the data conventions.
"""

from losses._advantages import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    discounted_returns,
    group_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
)
from losses._batch import (
    DATA_FIELDS,
    FIELDS,
    NORMALIZER_FIELDS,
    Batch,
    PerDatum,
    Term,
    Twin,
    UnknownFieldError,
)
from losses._checks import MAX_LOGPROB, any_violation, check_batch
from losses._common import KL_ESTIMATORS, KL_FORMS, SAMPLER_KL_FORMS, ppo_clip_terms
from losses._correction import (
    CORRECTION_KINDS,
    CORRECTION_LEVELS,
    KIND_LEVELS,
    REJECTION_STATISTICS,
    CorrectionChain,
    MismatchCorrection,
    correction_chain,
    importance_weight_mean,
    mismatch_correction,
)
from losses._covariance import clip_cov, kl_cov
from losses._critic import gae, masked_whiten, value_loss
from losses._distill import (
    REVERSE_KL_FORMS,
    TOPK_ENTROPY_APPROX,
    TOPK_RENORMALIZE,
    distillation_advantages,
    reverse_kl_distillation,
    topk_entropy,
    topk_forward_kl,
    topk_jsd,
    topk_reverse_kl,
)
from losses._dppo import DIVERGENCES, dppo, dppo_tv_kl
from losses._env import ENV_NORMALIZATIONS, echo_env, echo_env_weights, observation_mask
from losses._fold import fold
from losses._grpo import grpo
from losses._kl import KL_TARGETS, kl_loss
from losses._per_datum import per_datum_batch
from losses._policy import (
    cispo,
    dapo,
    dro,
    importance_sampling,
    policy_term,
    ppo,
    reinforce,
    sapo,
)
from losses._policy_seq import gmpo, gspo, luspo, vespo
from losses._preference import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    cpo,
    dpo,
    kto,
    kto_kl_baseline,
    orpo,
    simpo,
)
from losses._reductions import REDUCTIONS, active_rows, reduction_weights, term_weights
from losses._registry import TERMS, TermInfo
from losses._sft import sft_cross_entropy, weighted_cross_entropy
from losses._split import row_slices, split_batch, with_normalizers
from losses._twin import builtin_twin

__all__ = [
    "TERMS",
    "TermInfo",
    "Batch",
    "PerDatum",
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
    "REVERSE_KL_FORMS",
    "TOPK_ENTROPY_APPROX",
    "TOPK_RENORMALIZE",
    "distillation_advantages",
    "reverse_kl_distillation",
    "topk_entropy",
    "topk_forward_kl",
    "topk_jsd",
    "topk_reverse_kl",
    "ENV_NORMALIZATIONS",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "KL_FORMS",
    "KL_TARGETS",
    "SAMPLER_KL_FORMS",
    "clip_cov",
    "dppo_tv_kl",
    "kl_cov",
    "kl_loss",
    "luspo",
    "vespo",
    "REDUCTIONS",
    "active_rows",
    "builtin_twin",
    "check_batch",
    "cispo",
    "cpo",
    "CPO_LOSS_TYPES",
    "dpo",
    "DPO_LOSS_TYPES",
    "kto",
    "kto_kl_baseline",
    "KTO_LOSS_TYPES",
    "orpo",
    "simpo",
    "dapo",
    "dppo",
    "dro",
    "echo_env",
    "echo_env_weights",
    "fold",
    "per_datum_batch",
    "gmpo",
    "discounted_returns",
    "gae",
    "group_advantages",
    "masked_whiten",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "value_loss",
    "grpo",
    "gspo",
    "importance_sampling",
    "mismatch_correction",
    "correction_chain",
    "CorrectionChain",
    "importance_weight_mean",
    "KIND_LEVELS",
    "REJECTION_STATISTICS",
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
