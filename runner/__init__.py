"""foldloss `runner`: drive `losses` terms against a trainer.

Where things are:

* the trainer protocol and its capabilities (`runner._protocols`), sequences and results
  (`runner._types`), the builtin-kernel table (`runner._kernels`);
* the step planner and the client-loss adapter (`runner._step`, `runner._client_loss`);
* the backends, one registry (`runner.backends`): the embedded JAX trainer (`runner.local`),
  Tinker (`runner.tinker`) and Fireworks (`runner.fireworks`) through their SDKs;
* the local training server behind both SDKs (`runner.serve`);
* the main job: config (`runner.config`), tasks and rollouts (`runner.tasks`), SFT data
  (`runner.data`, `runner.sft`), the run loop and checkpoints (`runner.train`,
  `runner.checkpoints`), tracking and reports (`runner.tracking`, `runner.report`), the CLI
  (``python -m runner``).
"""

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
