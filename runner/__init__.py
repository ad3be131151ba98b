"""foldloss `runner`: drive `losses` terms against a trainer (local JAX or Fireworks)."""

from runner import env
from runner._client_loss import ClientLoss, PassCounter
from runner._kernels import KERNEL_NAMES as BUILTIN_LOSSES
from runner._padding import normalizers
from runner._protocols import (
    Capabilities,
    Checkpointing,
    Closing,
    Finalizing,
    LoadsWeights,
    RichCheckpoints,
    Sampling,
    Trainer,
    capabilities,
    require,
)
from runner._step import MODES, Plan, StepRunner, plan_step
from runner._types import (
    NORMALIZATIONS,
    AdamParams,
    ForwardBackwardResult,
    NonFiniteUpdateError,
    Sample,
    Seq,
    make_seq,
    validate_seqs,
)

__all__ = [
    "MODES",
    "ClientLoss",
    "PassCounter",
    "Plan",
    "StepRunner",
    "normalizers",
    "plan_step",
    "BUILTIN_LOSSES",
    "NORMALIZATIONS",
    "AdamParams",
    "ForwardBackwardResult",
    "NonFiniteUpdateError",
    "Sample",
    "Seq",
    "Trainer",
    "Capabilities",
    "Checkpointing",
    "Closing",
    "Finalizing",
    "LoadsWeights",
    "RichCheckpoints",
    "Sampling",
    "capabilities",
    "require",
    "make_seq",
    "validate_seqs",
    "env",
    "collate_sft",
    "translate_sft_batch",
    "LocalTrainer",
    "LocalTrainerConfig",
]

from runner.local import LocalTrainer, LocalTrainerConfig  # noqa: E402
from runner.sft import collate_sft, translate_sft_batch  # noqa: E402
