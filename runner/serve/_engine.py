"""The server's compute: served base models, training models on `LocalTrainer`, their
checkpoints on disk, sampling sessions and the sampling batcher (flavour-independent).

Every method here that touches JAX or the disk is blocking: flavours call them through
`runner.serve._core.Server.run_blocking` (ordered training work through a model's
`OrderedQueue`).

**Base models** (`BaseModel`): a name served by the server and the `LocalTrainerConfig` it
builds — the ``[model]`` section of a main-job config (the character tokenizer's vocabulary,
the config's ``[run].seed`` as the initialization seed; `base_model_from_config`), or a Hugging
Face checkpoint directory (Llama / Qwen2 / Qwen3; `base_model_from_checkpoint`).
**Training models** (`TrainingModel`): one `LocalTrainer` each. ``create_model`` with a LoRA
rank > 0 (`LoraRequest`) trains LoRA adapters of that rank on a decoder base (its weights
frozen; `resolve_lora` gives the rule for alpha and the targets); the GPT-2-style toy has no
LoRA and trains every weight whatever rank was asked for (`TrainingModel.is_lora` is False and
the flavours report it).

**Checkpoints** live under ``<state_dir>/runs/<model_id>/``: ``run.json`` (the base model, the
LoRA settings trained, the initialization seed) and the trainer's own layout
(``trainer/state/<name>``; sampler weights ``trainer/sampler/<name>.safetensors`` for the toy,
``trainer/sampler/<name>/`` — a transformers directory, or a PEFT adapter with LoRA — for a
decoder; `runner.local.checkpoint`), so a restarted server loads a checkpoint saved before the
restart. A `CheckpointRef` names one ``(model_id, kind, name)``; flavours format it
(``tinker://...``).

**Sampling**: a sampling session (`SamplerEntry`) is a frozen copy of some weights. Requests
arrive one prompt at a time; `SampleBatcher` coalesces those that arrive together with the same
parameters into one `LocalTrainer.sample` call, each prompt at its random-stream row
(`decode_seed`), so the runner's one ``sample`` call over N prompts (N requests) reproduces the
local backend's single call exactly. A LoRA model's sampler samples as the trainer does (the
frozen base plus the adapters, unmerged).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runner._atomic import atomic_write_json, make_dirs
from runner._kernels import KERNELS, check_kernel_inputs, resolve_config
from runner._seeds import decode_wire_seed
from runner._types import NORMALIZATIONS, AdamParams, Sample, Seq, validate_seqs
from runner.serve._core import ServeError, over_limit, user_error

log = logging.getLogger("runner.serve")

#: Model ids the server hands out: ``<session_id>:train:<model_seq_id>`` (the id the tinker
#: SDK derives itself on create-via-load, docs/wire.md#client-architecture).
MODEL_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}:train:\d{1,9}$")
CHECKPOINT_KINDS = ("state", "sampler")


def decode_seed(seed: int | None) -> tuple[int, int]:
    """``(base seed, row)`` of a wire sampling seed (None: a fresh random base).

    A seed ``s`` samples its request's completions with the local trainer's random streams of
    rows ``s % 2^12, s % 2^12 + 1, …`` of a call seeded ``s // 2^12`` (`runner._seeds`): the
    runner's int32 per-prompt (Tinker) and per-completion (Fireworks) seeds reproduce its local
    backend's single call exactly.
    """
    if seed is None:
        return secrets.randbits(32), 0
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise user_error(f"sampling_params.seed must be a non-negative integer, got {seed!r}")
    base, index = decode_wire_seed(seed)
    if base >= 2**32:
        raise user_error(f"sampling_params.seed {seed} is too large (at most {2**44 - 1})")
    return base, index


#: LoRA alpha when neither the request nor the served config sets one: Tinker pins alpha to 32
#: whatever the rank (the ``fireworks-ai`` SDK's ``DEFAULT_LORA_ALPHA``, which it sends for the
#: same reason); tinker's ``LoraConfig`` has no alpha field.
DEFAULT_LORA_ALPHA = 32.0
#: The projections ``train_attn`` / ``train_mlp`` select (`runner.local.models.PROJECTIONS`).
ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """A served base model: its name, the trainer config it builds, where it came from.

    Attributes:
      name: the served name (``create_model(base_model=name)``).
      config: the `LocalTrainerConfig` of a new model (no LoRA: `resolve_lora` adds it).
      source: the config file or checkpoint directory it came from.
      lora_alpha: the served config's ``[model].lora_alpha`` (``None``: unset).
      lora_targets: the served config's ``[model].lora_targets`` (``None``: all-linear).
    """

    name: str
    config: Any  # LocalTrainerConfig
    source: str = ""
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] | None = None

    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_seq_len)

    @property
    def supports_lora(self) -> bool:
        """Whether ``create_model`` with a rank trains LoRA adapters (decoders only)."""
        return self.config.decoder is not None


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        raise ValueError(f"served model name must be non-empty without spaces, got {name!r}")


def base_model_from_config(name: str, path: str | Path) -> BaseModel:
    """A main-job TOML config's local model as a base model.

    The trainer config is the one ``--backend local`` builds from that file
    (`runner.backends.local_trainer_config_of`: its ``[model]``, its tokenizer's vocabulary,
    ``[run].seed`` as the initialization seed), so a served model starts where a local run of
    the config starts.
    Its ``[model].lora_rank`` is not used (the client's ``create_model`` rank decides); its
    ``lora_alpha`` and ``lora_targets`` are the LoRA defaults of the models created from it.
    """
    from runner.backends import local_trainer_config_of
    from runner.config import load_config

    _check_name(name)
    cfg = load_config(path, ["run.backend='local'"])
    config = dataclasses.replace(local_trainer_config_of(cfg, None), lora=None)
    targets = None
    if config.decoder is not None and cfg.model.lora_targets != "all-linear":
        targets = tuple(t.strip() for t in cfg.model.lora_targets.split(",") if t.strip())
        bad = [t for t in targets if t not in (*ATTN_PROJECTIONS, *MLP_PROJECTIONS)]
        if bad or not targets:
            raise ValueError(
                f"config [model].lora_targets: unknown module(s) {bad or targets}; expected "
                f"'all-linear' or some of {[*ATTN_PROJECTIONS, *MLP_PROJECTIONS]}"
            )
    return BaseModel(
        name=name,
        config=config,
        source=str(path),
        lora_alpha=float(cfg.model.lora_alpha) if cfg.model.lora_alpha else None,
        lora_targets=targets,
    )


def base_model_from_checkpoint(name: str, path: str | Path) -> BaseModel:
    """A Hugging Face checkpoint directory (Llama / Qwen2 / Qwen3: ``config.json`` and
    ``model.safetensors`` or a sharded index) as a base model: `LocalTrainer.from_pretrained`'s
    model (float32, ``max_seq_len = min(max_position_embeddings, 4096)``, seed 0). The weights
    are read once here, so a bad checkpoint fails at startup.

    Raises:
      ValueError: naming the file and the problem (no ``config.json``, an unsupported
        architecture, missing or misshapen tensors).
    """
    from runner.local import LocalTrainer, LocalTrainerConfig

    _check_name(name)
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = LocalTrainerConfig.from_pretrained(directory)
        LocalTrainer(config)  # reads and checks the weights
    except (OSError, ValueError) as exc:
        raise ValueError(str(exc).splitlines()[0]) from None
    return BaseModel(name=name, config=config, source=str(directory))


def load_base_model(name: str, path: str | Path) -> BaseModel:
    """``--model NAME=PATH``: a Hugging Face checkpoint directory or a main-job config file.

    Raises:
      ValueError: naming ``--model NAME=PATH`` and the problem (no such path, a directory that
        is not a supported checkpoint, a config that does not validate).
    """
    where = f"--model {name}={path}"
    p = Path(path)
    try:
        if p.is_dir():
            return base_model_from_checkpoint(name, p)
        if not p.exists():
            raise ValueError(
                f"{p} does not exist (give a main-job config .toml or a Hugging Face checkpoint "
                "directory)"
            )
        return base_model_from_config(name, p)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class LoraRequest:
    """The LoRA a client asked for in ``create_model`` (flavour-independent).

    Attributes:
      rank: the rank; 0 = full weights.
      alpha: the scaling numerator asked for (``None``: `resolve_lora`'s rule).
      train_attn / train_mlp: adapt the attention (q/k/v/o) / MLP (gate/up/down) projections.
      train_unembed: adapt the unembedding (not supported: a user error on a decoder).
      default_alpha: alpha when neither ``alpha`` nor the served config gives one.
    """

    rank: int
    alpha: float | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    default_alpha: float = DEFAULT_LORA_ALPHA


def resolve_lora(base: BaseModel, request: LoraRequest | None, seed: int) -> Any:
    """The `runner.local.models.LoraConfig` a model of ``base`` trains (``None``: full weights).

    - rank 0 (or no request): full weights; the GPT-2-style toy (no LoRA) also trains every
      weight, whatever rank was asked for.
    - targets: q/k/v/o_proj with ``train_attn``, gate/up/down_proj with ``train_mlp``, within
      the served config's ``[model].lora_targets`` when it sets them; ``train_unembed`` is a
      user error (the local trainer's LoRA adapts the projections only).
    - alpha: the request's, else the served config's ``[model].lora_alpha``, else
      ``request.default_alpha`` (`DEFAULT_LORA_ALPHA`, 32: Tinker's fixed alpha).
    - the A matrices are initialized from ``seed`` (the model's initialization seed).

    Raises:
      ServeError: a user error naming the field.
    """
    from runner.local.models import LoraConfig

    if request is None:
        return None
    rank = request.rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise user_error(f"create_model: lora rank must be an integer >= 0, got {rank!r}")
    if rank == 0 or not base.supports_lora:
        return None
    dec = base.config.decoder
    width = min(dec.hidden_size, dec.intermediate_size)
    if rank > width:
        raise user_error(
            f"create_model: lora rank {rank} exceeds the base model's layer width {width} "
            "(min(hidden_size, intermediate_size)): use a rank <= it"
        )
    if request.train_unembed:
        raise user_error(
            "create_model: train_unembed=True is not supported: the local trainer's LoRA adapts "
            "the attention and MLP projections only (pass train_unembed=False)"
        )
    wanted = [
        *(ATTN_PROJECTIONS if request.train_attn else ()),
        *(MLP_PROJECTIONS if request.train_mlp else ()),
    ]
    if base.lora_targets is not None:
        wanted = [t for t in wanted if t in base.lora_targets]
    if not wanted:
        allowed = "" if base.lora_targets is None else f" within {list(base.lora_targets)}"
        raise user_error(
            f"create_model: train_attn={request.train_attn}, train_mlp={request.train_mlp} "
            f"leave no projection to adapt{allowed}"
        )
    alpha = request.alpha
    if alpha is None:
        alpha = base.lora_alpha if base.lora_alpha is not None else request.default_alpha
    try:
        return LoraConfig(rank=rank, alpha=alpha, targets=tuple(wanted), seed=int(seed))
    except ValueError as exc:
        raise user_error(f"create_model: {exc}") from None


def _lora_record(lora: Any) -> dict[str, Any] | None:
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}


def _lora_from_record(record: Any, seed: int) -> Any:
    from runner.local.models import LoraConfig

    if record is None:
        return None
    return LoraConfig(
        rank=int(record["rank"]),
        alpha=float(record["alpha"]),
        targets=tuple(record["targets"]),
        seed=seed,
    )


def _sampling_config(cfg: Any) -> Any:
    """The config a sampling engine of ``cfg``'s weights is built with: no checkpoint
    directory, and a seed only where it determines frozen weights (a random-init decoder's
    LoRA base); `Engine.run_samples` replaces the trainable parameters."""
    seed = cfg.seed if cfg.lora is not None and cfg.pretrained is None else 0
    lora = None if cfg.lora is None else dataclasses.replace(cfg.lora, seed=0)
    return dataclasses.replace(cfg, seed=seed, lora=lora, checkpoint_dir=None)


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    """One saved checkpoint: the model that saved it, ``"state"`` or ``"sampler"``, its name."""

    model_id: str
    kind: str
    name: str


@dataclasses.dataclass
class TrainingModel:
    """One training model: a `LocalTrainer` and what the flavours report about it.

    ``lora_rank`` is the rank the client asked for; `lora` is what the trainer trains (None:
    every weight).
    """

    model_id: str
    base: BaseModel
    trainer: Any  # LocalTrainer
    lora_rank: int | None = None
    flavour: str = ""

    @property
    def lora(self) -> Any:
        """The trained `runner.local.models.LoraConfig` (``None``: full weights)."""
        return self.trainer.config.lora

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    @property
    def sampling_base(self) -> BaseModel:
        """The base model of a sampler of this model's weights: the served base, its config
        the one the weights belong to (a LoRA model's adapters)."""
        return dataclasses.replace(self.base, config=_sampling_config(self.trainer.config))


@dataclasses.dataclass
class SamplerEntry:
    """A sampling session: frozen weights of one base model.

    ``base.config`` is the trainer config the weights ``params`` belong to (a LoRA model's
    sampler: the adapters, with the base's frozen weights; `TrainingModel.sampling_base`).
    """

    sampler_id: str
    base: BaseModel
    params: Any
    model_path: str | None = None


def _frozen(config: Mapping[str, Any]) -> tuple:
    return tuple(sorted(config.items()))


class Engine:
    """Base models, training models and samplers over `LocalTrainer` (blocking methods).

    Args:
      base_models: the served base models, by name.
      state_dir: the checkpoint root (``runs/<model_id>/...``).
    """

    def __init__(self, base_models: Mapping[str, BaseModel], state_dir: str | Path) -> None:
        if not base_models:
            raise ValueError("the server needs at least one base model")
        self.base_models = dict(base_models)
        self.state_dir = Path(state_dir)
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        self._engines: dict[Any, Any] = {}  # sampling config -> LocalTrainer
        self._engine_params: dict[Any, Any] = {}  # sampling config -> the params it holds
        self._initial_params: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._value_fns: dict[tuple, Any] = {}
        #: The server's per-request bounds (a `ServeConfig`, set by `make_server`); None: none.
        self.limits: Any = None
        self.cross_entropy_mode = ""  # test only: ServeConfig.test_cross_entropy

    # -- base models --------------------------------------------------------------------------

    def base(self, name: Any) -> BaseModel:
        base = self.base_models.get(name) if isinstance(name, str) else None
        if base is None:
            raise user_error(
                f"unknown base model {name!r}; this server serves {sorted(self.base_models)}"
            )
        return base

    # -- training models ----------------------------------------------------------------------

    def run_dir(self, model_id: str) -> Path:
        if not isinstance(model_id, str) or not MODEL_ID_RE.match(model_id):
            raise user_error(f"malformed model id {model_id!r}")
        return self.state_dir / "runs" / model_id

    def model(self, model_id: Any) -> TrainingModel:
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        if model is None:
            raise user_error(f"unknown model_id {model_id!r} (not loaded on this server)", 404)
        return model

    def create_model(
        self,
        model_id: str,
        base_name: str,
        *,
        seed: int | None = None,
        lora: LoraRequest | None = None,
        lora_rank: int | None = None,
        flavour: str = "",
    ) -> TrainingModel:
        """A new training model from a base model's initialization (``seed`` overrides it).

        Args:
          lora: the LoRA asked for (`resolve_lora`); or ``lora_rank`` alone (the defaults).
        """
        base = self.base(base_name)
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
                raise user_error(f"seed must be an integer in [0, 2**31), got {seed!r}")
        if lora is None and lora_rank is not None:
            lora = LoraRequest(rank=lora_rank)
        effective_seed = base.config.seed if seed is None else int(seed)
        trained = resolve_lora(base, lora, effective_seed)
        return self._create(
            model_id, base, effective_seed, trained, lora.rank if lora else None, flavour
        )

    def _create(
        self,
        model_id: str,
        base: BaseModel,
        seed: int,
        lora: Any,
        requested_rank: int | None,
        flavour: str,
    ) -> TrainingModel:
        from runner.local import LocalTrainer

        run_dir = self.run_dir(model_id)
        config = dataclasses.replace(
            base.config, seed=seed, lora=lora, checkpoint_dir=str(run_dir / "trainer")
        )
        make_dirs(run_dir)
        atomic_write_json(
            run_dir / "run.json",
            {
                "model_id": model_id,
                "base_model": base.name,
                "lora_rank": requested_rank,
                "lora": _lora_record(lora),
                "seed": seed,
                "created": time.time(),
            },
        )
        model = TrainingModel(model_id, base, LocalTrainer(config), requested_rank, flavour)
        self.models[model_id] = model
        return model

    def _run_record(self, model_id: str) -> dict[str, Any]:
        path = self.run_dir(model_id) / "run.json"
        try:
            record = json.loads(path.read_text())
            str(record["base_model"])
        except (OSError, ValueError, KeyError, TypeError):
            raise user_error(f"no training run {model_id!r} on this server") from None
        return record

    def recorded_base(self, model_id: str) -> str:
        """The base model a (possibly earlier) server recorded for ``model_id``."""
        return str(self._run_record(model_id)["base_model"])

    def recorded_config(self, model_id: str) -> tuple[BaseModel, Any]:
        """``(base model, trainer config)`` a recorded run trains: its base, its LoRA (none in a
        record written before the server had LoRA) and its initialization seed."""
        record = self._run_record(model_id)
        base = self.base(str(record["base_model"]))
        seed = record.get("seed")
        seed = base.config.seed if not isinstance(seed, int) else seed
        try:
            lora = _lora_from_record(record.get("lora"), seed)
        except (KeyError, TypeError, ValueError) as exc:
            raise user_error(f"training run {model_id!r}: unreadable LoRA record ({exc})") from None
        if lora is not None and not base.supports_lora:
            raise user_error(
                f"training run {model_id!r} trained LoRA adapters, but base model {base.name!r} "
                "is now served without LoRA support"
            )
        return base, dataclasses.replace(base.config, seed=seed, lora=lora)

    def create_from_checkpoint(
        self,
        model_id: str,
        ref: CheckpointRef,
        *,
        optimizer: bool,
        base_override: str | None = None,
        flavour: str = "",
    ) -> TrainingModel:
        """A new model with a checkpoint's weights (and optimizer state) — create-via-load.

        The new model trains what the checkpoint's model trained (its LoRA, its seed)."""
        base, config = self.recorded_config(ref.model_id)
        if base_override and base_override != base.name:
            raise user_error(
                f"base_model {base_override!r} differs from the checkpoint's base model "
                f"{base.name!r}"
            )
        requested = self._run_record(ref.model_id).get("lora_rank")
        model = self._create(model_id, base, config.seed, config.lora, requested, flavour)
        try:
            self.load(model, ref, optimizer=optimizer)
        except BaseException:
            self.models.pop(model_id, None)
            raise
        return model

    def unload(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    # -- checkpoints --------------------------------------------------------------------------

    def _state_path(self, ref: CheckpointRef) -> Path:
        """A state's directory, or a sampler checkpoint's safetensors file: the toy's
        ``sampler/<name>.safetensors``, a decoder's inside ``sampler/<name>/`` (its
        ``model.safetensors``, or ``adapter_model.safetensors`` with LoRA)."""
        from runner.local import checkpoint

        checkpoint.check_name(ref.name)
        root = self.run_dir(ref.model_id) / "trainer"
        if ref.kind == "state":
            return root / "state" / ref.name
        return _sampler_file(root / "sampler", ref.name)

    def sampler_dir(self, ref: CheckpointRef) -> Path | None:
        """A decoder's sampler checkpoint directory (a transformers directory, or a PEFT
        adapter with LoRA); ``None`` for the toy's single safetensors file."""
        path = self._state_path(ref)
        flat = self.run_dir(ref.model_id) / "trainer" / "sampler" / f"{ref.name}.safetensors"
        return None if ref.kind != "sampler" or path == flat else path.parent

    def exists(self, ref: CheckpointRef) -> bool:
        from runner.local import checkpoint

        path = self._state_path(ref)
        if ref.kind == "sampler":
            return path.is_file()
        return ref.name in checkpoint.list_states(path.parent.parent)

    def save(self, model: TrainingModel, kind: str, name: str, *, overwrite: bool = True):
        """Saves resumable state or sampler weights under ``name``; returns its ref."""
        from runner.local import checkpoint

        try:
            checkpoint.check_name(name)
        except ValueError as exc:
            raise user_error(str(exc)) from None
        ref = CheckpointRef(model.model_id, kind, name)
        if not overwrite and self.exists(ref):
            raise user_error(f"checkpoint {kind} {name!r} of {model.model_id} already exists")
        if kind == "state":
            model.trainer.save_state(name)
        else:
            model.trainer.save_weights_for_sampler(name)
        return ref

    def load(self, model: TrainingModel, ref: CheckpointRef, *, optimizer: bool) -> None:
        """Loads a checkpoint into a model (sampler weights: weights only)."""
        path = self._state_path(ref)
        if ref.kind == "sampler":
            if optimizer:
                raise user_error(
                    "sampler weights hold no optimizer state: load with optimizer=false"
                )
            if not path.is_file():
                raise user_error(f"no sampler weights {ref.name!r} for {ref.model_id}")
            model.trainer.load_weights(str(path))
            return
        try:
            model.trainer.load_state(str(path), with_optimizer=optimizer)
        except FileNotFoundError:
            raise user_error(f"no saved state {ref.name!r} for {ref.model_id}") from None

    def params_of(self, ref: CheckpointRef) -> tuple[BaseModel, Any]:
        """A checkpoint's base model and weights (for a sampling session; a LoRA checkpoint's
        base carries its LoRA config: `TrainingModel.sampling_base`)."""
        from runner.local import LocalTrainer

        base, config = self.recorded_config(ref.model_id)
        scratch = LocalTrainer(config)
        probe = TrainingModel(ref.model_id, base, scratch)
        self.load(probe, ref, optimizer=False)
        return probe.sampling_base, scratch.params

    def list_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        """``{kind, name, time (UTC datetime), size_bytes}`` of each checkpoint, oldest first."""
        from runner.local import checkpoint

        root = self.run_dir(model_id) / "trainer"
        rows = []
        for name in checkpoint.list_states(root):
            base = root / "state" / name
            rows.append(_row("state", name, base / "CURRENT", _tree_size(base)))
        sampler = root / "sampler"
        if sampler.is_dir():
            for path in sorted(sampler.iterdir()):
                if path.name.startswith("."):
                    continue
                if path.is_file() and path.name.endswith(".safetensors"):
                    rows.append(_row("sampler", path.name[: -len(".safetensors")], path, None))
                elif path.is_dir() and _sampler_file(sampler, path.name).is_file():
                    rows.append(_row("sampler", path.name, _sampler_file(sampler, path.name), None))
        return sorted(rows, key=lambda r: r["time"])

    # -- training -----------------------------------------------------------------------------

    @staticmethod
    def check_inputs(base: BaseModel, seqs: Sequence[Seq], loss_fn: str, config: Any) -> dict:
        """The kernel's full config after every input rule (raises ``ValueError``)."""
        if loss_fn not in KERNELS:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; this server runs {tuple(KERNELS)}")
        full = resolve_config(loss_fn, config)
        kernel = KERNELS[loss_fn]
        validate_seqs(
            seqs,
            required=kernel.inputs,
            vocab_size=base.config.vocab_size,
            max_len=base.config.max_seq_len,
        )
        check_kernel_inputs(seqs, kernel.inputs, loss_fn)
        return full

    def forward_backward(
        self, model: TrainingModel, seqs: Sequence[Seq], loss_fn: str, config: Any
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        if self.cross_entropy_mode == "skyrl":
            seqs = _skyrl_normalised(seqs, loss_fn)
        result = model.trainer.forward_backward(seqs, loss_fn, config)  # (its own input rules)
        metrics = dict(result.metrics)
        if self.cross_entropy_mode == "skyrl":
            metrics.pop("loss:sum", None)  # SkyRL tx reports none
        return list(result.logprobs), metrics

    def forward(
        self, model: TrainingModel, seqs: Sequence[Seq], loss_fn: str, config: Any
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Logprobs at the current weights and the kernel's ``loss:sum`` (no gradient)."""
        full = self.check_inputs(model.base, seqs, loss_fn, config)
        logprobs = list(model.trainer.forward([s.with_inputs() for s in seqs]))
        return logprobs, {"loss:sum": self._kernel_value(loss_fn, full, seqs, logprobs)}

    def _kernel_value(self, loss_fn, full, seqs, logprobs) -> float:
        import jax

        import losses
        from runner.local import kernels

        key = (loss_fn, _frozen(full))
        fn = self._value_fns.get(key)
        if fn is None:
            term = KERNELS[loss_fn].term(full)
            fn = self._value_fns[key] = jax.jit(lambda lp, b: term.fn(lp, b)[0])
        from runner._padding import bucket, pad_ragged, row_bucket

        width = bucket(max(s.num_targets for s in seqs))
        rows = row_bucket(len(seqs), 1, 1)
        fields = kernels.build_batch(KERNELS[loss_fn], seqs, rows, width, np.float32)
        lp = pad_ragged(logprobs, width, rows, np.float32)
        return float(fn(lp, losses.Batch(**fields)))

    @staticmethod
    def optim_step(
        model: TrainingModel, adam: AdamParams, normalization: str | None = None
    ) -> dict[str, float]:
        if normalization not in (None, *NORMALIZATIONS):
            raise ValueError(f"unknown normalization {normalization!r}")
        return model.trainer.optim_step(adam, normalization)

    # -- samplers -----------------------------------------------------------------------------

    def new_sampler(
        self, sampler_id: str, base: BaseModel, params: Any, model_path: str | None = None
    ) -> SamplerEntry:
        entry = SamplerEntry(sampler_id, base, params, model_path)
        self.samplers[sampler_id] = entry
        return entry

    def base_params(self, base: BaseModel) -> Any:
        """A base model's initial weights (its config's seed)."""
        with self._lock:
            params = self._initial_params.get(base.name)
            if params is None:
                from runner.local import LocalTrainer

                trainer = LocalTrainer(base.config)
                params = self._initial_params[base.name] = trainer.params
                self._engines.setdefault(_sampling_config(base.config), trainer)
            return params

    def sampler(self, sampler_id: Any) -> SamplerEntry:
        entry = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if entry is None:
            raise user_error(f"unknown sampling session {sampler_id!r}", 404)
        return entry

    def _sampling_engine(self, entry: SamplerEntry):
        """The `LocalTrainer` that samples ``entry`` (one per sampling config), its parameters
        set to the entry's."""
        key = _sampling_config(entry.base.config)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                from runner.local import LocalTrainer

                engine = self._engines[key] = LocalTrainer(key)
                # each request is bounded by the server (`check_sample`); a batch merges them
                engine.max_sample_rows = engine.max_sample_tokens = sys.maxsize
        if self._engine_params.get(key) is not entry.params:
            engine.set_params(entry.params)
            self._engine_params[key] = entry.params
        return engine

    def run_samples(self, entry: SamplerEntry, jobs: Sequence[SampleJob]) -> list[list[Sample]]:
        """One `LocalTrainer.sample` call for jobs that share their parameters (`SampleJob.key`)."""
        engine = self._sampling_engine(entry)
        first = jobs[0]
        return engine.sample(
            [j.prompt for j in jobs],
            num_samples=first.num_samples,
            max_tokens=first.max_tokens,
            temperature=first.temperature,
            seed=first.base_seed,
            stop_token_ids=first.stops,
            row_offsets=[j.index for j in jobs],
        )

    def prompt_logprobs(self, entry: SamplerEntry, prompt: np.ndarray) -> np.ndarray:
        """float32[len(prompt)]: NaN at position 0, then each prompt token's logprob."""
        out = np.full((prompt.shape[0],), np.nan, np.float32)
        if prompt.shape[0] >= 2:
            engine = self._sampling_engine(entry)
            (lp,) = engine.forward([Seq(prompt.astype(np.int64))])
            out[1:] = np.asarray(lp, np.float32)
        return out

    def check_sample(self, entry: SamplerEntry, job: SampleJob) -> None:
        """One job's own rules, before it is batched with others (raises a user error)."""
        cfg = entry.base.config
        p = job.prompt
        if p.ndim != 1 or p.shape[0] < 1:
            raise user_error("prompt must hold at least one token")
        if p.min() < 0 or p.max() >= cfg.vocab_size:
            raise user_error(f"prompt token outside the vocabulary [0, {cfg.vocab_size})")
        if p.shape[0] + job.max_tokens - 1 > cfg.max_seq_len:
            raise user_error(
                f"prompt length {p.shape[0]} + max_tokens {job.max_tokens} - 1 exceeds the "
                f"model's max_seq_len={cfg.max_seq_len}"
            )
        bad = [t for t in job.stops if not 0 <= t < cfg.vocab_size]
        if bad:
            raise user_error(f"stop token {bad[0]} is outside the vocabulary")
        if job.num_samples < 1 or job.max_tokens < 1:
            raise user_error("num_samples and max_tokens must be >= 1")
        if self.limits is not None:  # the server's bounds on one request (`ServeConfig`)
            over_limit(self.limits, "max_samples", "num_samples", job.num_samples)
            over_limit(
                self.limits,
                "max_sample_tokens",
                f"prompt + num_samples x max_tokens ({p.shape[0]} + {job.num_samples} x "
                f"{job.max_tokens})",
                p.shape[0] + job.num_samples * job.max_tokens,
            )
        if not (np.isfinite(job.temperature) and job.temperature >= 0):
            raise user_error(f"temperature must be finite and >= 0, got {job.temperature}")

    def close(self) -> None:
        self.models.clear()
        self.samplers.clear()


def _skyrl_normalised(seqs: Sequence[Seq], loss_fn: str) -> list[Seq]:
    """Test only (`ServeConfig.test_cross_entropy`): the datums that give SkyRL tx's loss from
    our token-sum kernels. SkyRL divides each datum's token-sum loss by ``max(Σw, 1e-9)`` (its
    ``weights``; all ones for the policy kernels, which get none) and averages over datums; our
    kernels are linear in ``weights`` / ``advantages``, so that scale is folded into them."""
    out = []
    for s in seqs:
        inputs = dict(s.inputs)
        if loss_fn == "cross_entropy":
            w = np.asarray(inputs["weights"], np.float64)
            inputs["weights"] = w / max(float(w.sum()), 1e-9) / len(seqs)
        elif "advantages" in inputs:
            inputs["advantages"] = np.asarray(inputs["advantages"]) / s.num_targets / len(seqs)
        out.append(Seq(s.tokens, inputs))
    return out


def _sampler_file(sampler: Path, name: str) -> Path:
    """The safetensors file of sampler checkpoint ``name`` under ``sampler/`` (the toy's
    ``<name>.safetensors``; a decoder's ``<name>/model.safetensors`` or, with LoRA,
    ``<name>/adapter_model.safetensors``); the toy's path when none exists."""
    flat = sampler / f"{name}.safetensors"
    directory = sampler / name
    if not flat.is_file() and directory.is_dir():
        for fname in ("adapter_model.safetensors", "model.safetensors"):
            if (directory / fname).is_file():
                return directory / fname
    return flat


def _row(kind: str, name: str, stamp: Path, size: int | None) -> dict[str, Any]:
    try:
        stat = stamp.stat()
    except OSError:
        mtime, nbytes = 0.0, None
    else:
        mtime, nbytes = stat.st_mtime, stat.st_size
    return {
        "kind": kind,
        "name": name,
        "time": datetime.datetime.fromtimestamp(mtime, tz=datetime.UTC),
        "size_bytes": size if size is not None else nbytes,
    }


def _tree_size(base: Path) -> int | None:
    try:
        return sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    except OSError:
        return None


# -- sampling batcher ---------------------------------------------------------------------------


@dataclasses.dataclass
class SampleJob:
    """One sampling request (one prompt) waiting to be batched.

    ``index`` is the random-stream row of its first completion in its call (`decode_seed`).

    ``done(samples, prompt_logprobs)`` or ``failed(error)`` is called on the server's loop
    (the submitting flavour sets them).
    """

    sampler_id: str
    prompt: np.ndarray
    num_samples: int
    max_tokens: int
    temperature: float
    base_seed: int
    index: int
    stops: tuple[int, ...]
    prompt_logprobs: bool = False
    done: Callable[[list[Sample], np.ndarray | None], None] = lambda samples, plp: None
    failed: Callable[[ServeError], None] = lambda error: None

    @property
    def key(self) -> tuple:
        """Jobs with the same key run in one `LocalTrainer.sample` call."""
        return (
            self.sampler_id,
            self.base_seed,
            self.num_samples,
            self.max_tokens,
            float(self.temperature),
            self.stops,
        )


class SampleBatcher:
    """Coalesces sampling jobs that arrive together into batched `LocalTrainer.sample` calls.

    Jobs with the same `SampleJob.key` form a group, run as one call with its prompts in
    random-stream-row order (the order of the client's own call). A group is *complete* when
    its rows are ``0, n, 2n, …`` (``n`` = its ``num_samples``) without a hole: the runner
    submits a call's last prompt first (`runner.tinker.TinkerTrainer.sample`; the Fireworks
    backend its last completion), so a group becomes complete exactly when its last request
    arrives, and the batch — shapes included — is the one the local backend samples.
    Pending groups run once no new job has arrived for ``quiet_s`` and all are complete, or for
    ``incomplete_quiet_s`` otherwise (a client whose seeds are not a call's indices), and at
    the latest ``max_wait_s`` after the first job. One sampling call runs at a time.
    """

    def __init__(
        self,
        engine: Engine,
        run_blocking: Callable[..., Any],
        *,
        quiet_s: float = 0.002,
        incomplete_quiet_s: float = 0.1,
        max_wait_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.run_blocking = run_blocking
        self.quiet_s = quiet_s
        self.incomplete_quiet_s = incomplete_quiet_s
        self.max_wait_s = max_wait_s
        self._pending: list[SampleJob] = []
        self._last_arrival = 0.0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.calls = 0  # LocalTrainer.sample calls made (tests read it)

    def submit(self, job: SampleJob) -> None:
        self._pending.append(job)
        self._last_arrival = time.monotonic()
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        assert self._wake is not None
        self._wake.set()

    @staticmethod
    def _groups(jobs: Sequence[SampleJob]) -> dict[tuple, list[SampleJob]]:
        groups: dict[tuple, list[SampleJob]] = {}
        for job in jobs:
            groups.setdefault(job.key, []).append(job)
        return groups

    @staticmethod
    def complete(items: Sequence[SampleJob]) -> bool:
        """Whether a group's rows are ``0, n, 2n, …`` with no hole (``n``: its num_samples)."""
        n = items[0].num_samples
        rows = sorted({j.index for j in items})
        return rows == list(range(0, n * len(rows), n))

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            start = time.monotonic()
            while True:
                await asyncio.sleep(self.quiet_s)
                now = time.monotonic()
                groups = self._groups(self._pending)
                done = all(self.complete(items) for items in groups.values())
                quiet = now - self._last_arrival
                if (done and quiet >= self.quiet_s) or quiet >= self.incomplete_quiet_s:
                    break
                if now - start >= self.max_wait_s:
                    break
            log.debug(
                "batch after %.1f ms: %d jobs, complete=%s, quiet %.1f ms",
                1e3 * (now - start),
                len(self._pending),
                done,
                1e3 * quiet,
            )
            jobs, self._pending = self._pending, []
            self._wake.clear()
            for items in self._groups(jobs).values():
                items.sort(key=lambda j: j.index)
                await self._run_group(items)

    async def _run_group(self, items: list[SampleJob]) -> None:
        try:
            entry = self.engine.sampler(items[0].sampler_id)
            t0 = time.perf_counter()
            samples = await self.run_blocking(self.engine.run_samples, entry, items)
            self.calls += 1
            log.debug(
                "sampled %d prompts in one call (%.1f ms)",
                len(items),
                1e3 * (time.perf_counter() - t0),
            )
            for job, out in zip(items, samples, strict=True):
                plp = None
                if job.prompt_logprobs:
                    plp = await self.run_blocking(self.engine.prompt_logprobs, entry, job.prompt)
                job.done(out, plp)
        except ServeError as err:
            for job in items:
                job.failed(err)
        except ValueError as exc:
            for job in items:
                job.failed(user_error(str(exc).splitlines()[0]))
        except Exception as exc:  # noqa: BLE001 - a server bug: fail the jobs, keep serving
            log.exception("sampling failed")
            err = ServeError(f"internal error: {type(exc).__name__}", category="server")
            for job in items:
                job.failed(err)
