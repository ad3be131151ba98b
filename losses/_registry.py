"""The one registry of term constructors: `TERMS`, what the loss catalogue is generated from.

Each `TermInfo` names a public constructor of `losses` and records the facts about it that are
not computable from a built term: its formula (quoted from the constructor's docstring), its
source and whether `losses.split_batch` micro-batches are exact for it. What *is* computable —
the batch fields it reads, its argument, its builtin kernel — is read from the term the
constructor builds (`TermInfo.example`), never restated here.

``python docs/gen_catalogue.py`` writes ``docs/catalogue.md`` from this table (adding which
backends run each builtin kernel); ``tests/test_catalogue.py`` fails when the two disagree, when
a public constructor is missing here, or when a formula is not in its docstring.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

from losses._batch import Term
from losses._covariance import clip_cov, kl_cov
from losses._critic import value_loss
from losses._distill import reverse_kl_distillation, topk_forward_kl, topk_jsd, topk_reverse_kl
from losses._dppo import dppo, dppo_tv_kl
from losses._env import echo_env
from losses._fold import fold
from losses._grpo import grpo
from losses._kl import kl_loss
from losses._policy import cispo, dapo, dro, importance_sampling, ppo, reinforce, sapo
from losses._policy_seq import gmpo, gspo, luspo, vespo
from losses._preference import cpo, dpo, kto, orpo, simpo
from losses._sft import sft_cross_entropy, weighted_cross_entropy

#: The values of `TermInfo.microbatch_exact`: ``"yes"``; ``"no"``; ``"whole pairs"`` (exact when
#: every micro-batch holds whole preference pairs); ``"conditional"`` (`TermInfo.exact_note`
#: says when).
MICROBATCH_EXACT = ("yes", "no", "whole pairs", "conditional")
#: The families, in catalogue order.
FAMILIES = (
    "policy",
    "objectives",
    "KL",
    "preference",
    "distillation",
    "critic",
    "cross-entropy",
    "composition",
)


@dataclasses.dataclass(frozen=True)
class TermInfo:
    """One public term constructor and the facts of its catalogue row.

    Attributes:
      constructor: the public constructor (``losses.<name>``).
      family: one of `FAMILIES`.
      formula: the per-token (or per-row, per-pair) loss as the constructor's docstring writes
        it; a test checks that the docstring contains it (whitespace aside).
      source: the paper or system it comes from (the docstring has the details).
      microbatch_exact: one of `MICROBATCH_EXACT`: whether the micro-batches of
        `losses.split_batch` sum to the full batch's loss and gradient.
      exact_note: when ``microbatch_exact`` is ``"conditional"`` or ``"no"``, why.
      example: keyword arguments of the term whose reads, argument and builtin kernel the
        catalogue shows (chosen so that a kernel shows where one exists); the defaults when
        empty.
      example_args: positional arguments of that term (`fold`'s parts).
    """

    constructor: Callable[..., Term]
    family: str
    formula: str
    source: str
    microbatch_exact: str = "yes"
    exact_note: str = ""
    example: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    example_args: tuple[Term, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"TermInfo {self.name!r}: family must be one of {FAMILIES}")
        if self.microbatch_exact not in MICROBATCH_EXACT:
            raise ValueError(
                f"TermInfo {self.name!r}: microbatch_exact must be one of {MICROBATCH_EXACT}"
            )
        if self.microbatch_exact in ("conditional", "no") and not self.exact_note:
            raise ValueError(f"TermInfo {self.name!r}: say why in exact_note")

    @property
    def name(self) -> str:
        """The constructor's public name."""
        return self.constructor.__name__

    def build(self) -> Term:
        """The example term, ``constructor(*example_args, **example)``."""
        return self.constructor(*self.example_args, **self.example)

    @property
    def example_call(self) -> str:
        """The example as Python source, e.g. ``dro(reduction='token_sum')``."""
        args = [f"{a.kind}()" for a in self.example_args]
        args += [f"{k}={v!r}" for k, v in self.example.items()]
        return f"{self.name}({', '.join(args)})"


_I = TermInfo
TERMS: tuple[TermInfo, ...] = (
    # -- the policy family ----------------------------------------------------------------------
    _I(
        grpo,
        "policy",
        "ℓ = -min(r·A, clip(r, lo, hi)·A)",
        "GRPO (Shao et al. 2024), PPO clip (Schulman et al. 2017); dual clip, DAPO clip-higher, TRL delta",
    ),
    _I(
        ppo,
        "policy",
        "ℓ = -min(r·A, clip(r, lo, hi)·A)",
        "Tinker/Fireworks `ppo` (absolute ratio thresholds)",
    ),
    _I(importance_sampling, "policy", "ℓ = -r·A", "Tinker/Fireworks `importance_sampling`"),
    _I(dapo, "policy", "ℓ = min(ℓ, -eps_clip_c·A)", "DAPO (Yu et al. 2025); Fireworks `dapo`"),
    _I(cispo, "policy", "ℓ = -sg(clip(r, lo, hi))·A·p", "CISPO (MiniMax-M1, arXiv:2506.13585)"),
    _I(
        dro,
        "policy",
        "ℓ = -(p·A - ½·β·(p - q)²)",
        "Tinker/Fireworks `dro`",
        example={"reduction": "token_sum"},
    ),
    _I(
        gspo,
        "policy",
        "ℓ_t = -min(s_it·A_t, clip(s_it, lo, hi)·A_t)",
        "GSPO / GSPO-token (Zheng et al. 2025, arXiv:2507.18071)",
    ),
    _I(gmpo, "policy", "ℓ_i = -Ā_i·ρ_i", "GMPO (verl `geo_mean`)"),
    _I(dppo, "policy", "ℓ = -r·A·sg(M)", "DPPO (SkyRL `dppo`); Fireworks `dppo`"),
    _I(
        reinforce,
        "policy",
        "ℓ = -sg(ω)·A·p",
        "REINFORCE (Williams 1992), GPG (verl `gpg`)",
        example={"ratio_weight": True},
    ),
    _I(sapo, "policy", "ℓ = -g(r; τ)·A", "SAPO (verl / SkyRL / TRL `sapo`)"),
    # -- newer objectives ----------------------------------------------------------------------
    _I(
        clip_cov,
        "objectives",
        "ℓ_t = max(-A·r, -A·clip(r, lo, hi))",
        "Clip-Cov (Cui et al. 2025; verl `compute_policy_loss_clip_cov`)",
        "no",
        "covariance statistics and the selected tokens are the call's",
    ),
    _I(
        kl_cov,
        "objectives",
        "ℓ_t = -A·r + 1[t ∈ K]·κ·|p - q|",
        "KL-Cov (Cui et al. 2025; verl `compute_policy_loss_kl_cov`)",
        "conditional",
        "only with kl_cov_ratio = 1 (the selection is the call's)",
    ),
    _I(vespo, "objectives", "ℓ_t = -sg(φ_it)·A_t·p_t", 'VESPO (TRL `loss_type="vespo"`)'),
    _I(luspo, "objectives", "L = (1/N) Σ_i N_i·ℓ_i", 'LUSPO (TRL `loss_type="luspo"`)'),
    _I(
        dppo_tv_kl,
        "objectives",
        "ℓ_t = -(1 - drop_t)·adv_tau·A·r + kl_tau·(log r)²",
        "prime-rl `default_loss_fn`",
    ),
    # -- KL -------------------------------------------------------------------------------------
    _I(
        kl_loss,
        "KL",
        "L = coef·Σ_{i,t} w_{i,t}·[r·] k(p, target)_{i,t}",
        "k1/k2/k3 (Schulman), DeepSeek-V3.2 / TRL importance-weighted KL, rLLM KL to the sampler",
    ),
    # -- preference -----------------------------------------------------------------------------
    _I(
        dpo,
        "preference",
        "−(1−ε)·logσ(x) − ε·logσ(−x)",
        "DPO (Rafailov et al. 2023) and TRL's loss types",
        "conditional",
        "whole pairs per micro-batch; aot / aot_unpaired only with one micro-batch",
    ),
    _I(
        simpo,
        "preference",
        "−(1−ε)·logσ(β·(ℓ_c − ℓ_r) − γ) − ε·logσ(−(β·(ℓ_c − ℓ_r) − γ))",
        "SimPO (Meng et al. 2024)",
        "whole pairs",
    ),
    _I(
        cpo,
        "preference",
        "−(1−ε)·logσ(β·z) − ε·logσ(−β·z)",
        "CPO (TRL `CPOTrainer`), AlphaPO rewards",
        "whole pairs",
    ),
    _I(
        orpo,
        "preference",
        "ℓ_pair = NLL_c − β·logσ(lor)",
        "ORPO (TRL `odds_ratio_loss`, fw-ai cookbook)",
        "whole pairs",
    ),
    _I(
        kto,
        "preference",
        "desirable ℓ_i = w_d·(1 − σ(β·(u_i − z0)))",
        "KTO (TRL `KTOTrainer`)",
        "conditional",
        "with the KL baseline z0 computed over the optimizer batch (kto_kl_baseline) as data",
    ),
    # -- distillation ---------------------------------------------------------------------------
    _I(
        reverse_kl_distillation,
        "distillation",
        "ℓ = -r·A",
        "tinker-cookbook on-policy distillation; verl k2/k3; prime-rl `ref_kl_loss_fn`",
    ),
    _I(
        topk_forward_kl,
        "distillation",
        "max(Σ_k q_k (t_k - s_k), 0)",
        "verl `forward_kl_topk`, TRL server distillation, tinker-cookbook sdft",
        example={"renormalize": "none"},
    ),
    _I(
        topk_reverse_kl,
        "distillation",
        "ℓ = Σ_k p̂_k (log p̂_k - log q̂_k)",
        "top-K reverse KL (TRL GKD family)",
    ),
    _I(topk_jsd, "distillation", "ℓ = β·KL(T‖M) + (1-β)·KL(S‖M)", "TRL GKD (generalized JSD)"),
    # -- critic ---------------------------------------------------------------------------------
    _I(
        value_loss,
        "critic",
        "L = ½·Σ w·max((v − R)², (v_clip − R)²)",
        "PPO clipped value loss (verl, OpenRLHF)",
    ),
    # -- cross-entropy --------------------------------------------------------------------------
    _I(
        echo_env,
        "cross-entropy",
        "L = Σ_{i,t} w_{i,t}·(-logp_{i,t})",
        "ECHO (Shrivastava et al. 2026, arXiv:2605.24517)",
    ),
    _I(
        sft_cross_entropy,
        "cross-entropy",
        "L = Σ_{i,t} w_{i,t}·(-logp_{i,t})",
        "supervised next-token cross-entropy",
    ),
    _I(
        weighted_cross_entropy,
        "cross-entropy",
        "L = Σ_{i,t} w_{i,t}·(-logp_{i,t})",
        "the server `cross_entropy` kernel",
    ),
    # -- composition ----------------------------------------------------------------------------
    _I(
        fold,
        "composition",
        "L = Σ_k L_k",
        "this package",
        "conditional",
        "when every part is",
        example_args=(grpo(), echo_env()),
    ),
)
del _I
#: Constructor name → `TermInfo` (read-only).
BY_NAME: Mapping[str, TermInfo] = types.MappingProxyType({t.name: t for t in TERMS})
assert len(BY_NAME) == len(TERMS), "duplicate TermInfo names"
