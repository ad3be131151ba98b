"""The main job's configuration: a TOML file with one table per section, every knob explicit.

``examples/default.toml`` holds the defaults; `load_config` reads a file, applies ``--set``
overrides (``section.key=value``) and validates everything eagerly with errors naming the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import losses


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "default"
    output_dir: str = "runs"
    seed: int = 0
    backend: str = "local"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 128


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    max_operand: int = 9
    num_ops: int = 1
    max_turns: int = 4
    max_tokens_per_turn: int = 12


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 70
    batch_size: int = 32
    learning_rate: float = 3e-3


@dataclasses.dataclass(frozen=True)
class RLConfig:
    steps: int = 100
    problems_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    learning_rate: float = 1e-3
    advantage_estimator: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    reduction: str = "token_mean"
    env_coef: float = 0.01
    env_normalization: str = "seq_mean_token_mean"
    mode: str = "auto"
    num_microbatches: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 10
    save_promotable: bool = False


@dataclasses.dataclass(frozen=True)
class FireworksConfig:
    """Hosted-trainer settings (``--backend fireworks``; docs/fireworks.md). The API key is read
    from the environment variable named by ``api_key_env`` and is never stored in the config.
    ``trainer_job_id``/``deployment_id`` empty: the SDK provisions them. ``modality``: ``auto``
    (vision-language models, detected by name, fail closed), ``text`` or ``vision``.
    ``identity_timeout_s``: how long a checkpoint save polls the control plane for its row.
    ``connect_timeout_s``: the bound on reaching ``base_url`` before any SDK call (offline or
    unreachable: one error line within it)."""

    base_model: str = ""
    trainer_job_id: str = ""
    training_shape_id: str = ""
    api_key_env: str = "FIREWORKS_API_KEY"
    base_url: str = "https://api.fireworks.ai"
    output_model_id: str = ""
    max_seq_len: int = 4096
    request_timeout_s: float = 3600.0
    deployment_id: str = ""
    modality: str = "auto"
    delete_trainer_after_promotion: bool = True
    identity_timeout_s: float = 90.0
    connect_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    optim: OptimConfig = OptimConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    fireworks: FireworksConfig = FireworksConfig()

    @property
    def total_steps(self) -> int:
        return self.sft.steps + self.rl.steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> str:
        """A hash of everything that changes the trajectory of a run (not step counts or names).

        Resuming with a different identity would not reproduce the interrupted run, so the
        runner refuses it.
        """
        d = self.to_dict()
        d["run"] = {"seed": d["run"]["seed"], "backend": d["run"]["backend"]}
        d["sft"] = {k: v for k, v in d["sft"].items() if k != "steps"}
        d["rl"] = {k: v for k, v in d["rl"].items() if k != "steps"}
        d.pop("checkpoint")
        d["fireworks"] = {}
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
#: A run name is one path component: letters, digits, '.', '_', '-', not '.' or '..'.
#: Sampling temperatures the runner accepts: logits / T stays finite in float32 for |logits| < 1e35.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
_NAME_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9._-]{1,64}$")


def _section_class(name: str):
    return {
        "run": RunConfig,
        "model": ModelConfig,
        "env": EnvConfig,
        "optim": OptimConfig,
        "sft": SFTConfig,
        "rl": RLConfig,
        "checkpoint": CheckpointConfig,
        "fireworks": FireworksConfig,
    }[name]


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    where = f"config [{section}].{key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {value!r}")
    return value


def from_dict(data: dict[str, Any]) -> Config:
    """Builds and validates a `Config` from nested dicts (unknown sections/keys are errors)."""
    sections = {}
    for section, values in data.items():
        if section not in _SECTIONS:
            raise ValueError(
                f"config: unknown section [{section}]; expected one of {sorted(_SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ValueError(f"config: [{section}] must be a table")
        cls = _section_class(section)
        defaults = cls()
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in values.items():
            if key not in known:
                raise ValueError(
                    f"config: unknown key [{section}].{key}; expected one of {sorted(known)}"
                )
            kwargs[key] = _coerce(section, key, value, getattr(defaults, key))
        sections[section] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _set(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment or "." not in assignment.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {assignment!r}")
    path, raw = assignment.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string
    data.setdefault(section, {})[key] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Reads a TOML config (``None`` = all defaults) and applies ``section.key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {p} is not valid TOML: {exc}") from exc
    for assignment in overrides:
        _set(data, assignment)
    return from_dict(data)


def validate(cfg: Config) -> None:
    """Raises ``ValueError`` naming the key for any invalid value."""

    def positive(section, key, value, allow_zero=False):
        ok = value >= 0 if allow_zero else value > 0
        if not ok:
            raise ValueError(
                f"config [{section}].{key} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}"
            )

    if not _NAME_RE.match(cfg.run.name):
        raise ValueError(
            f"config [run].name must be one path component of 1-64 letters, digits, '.', '_' or "
            f"'-' (not '.' or '..'), got {cfg.run.name!r}"
        )
    if cfg.run.backend not in ("local", "fireworks"):
        raise ValueError(
            f"config [run].backend must be 'local' or 'fireworks', got {cfg.run.backend!r}"
        )
    for key in ("d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
        positive("model", key, getattr(cfg.model, key))
    if cfg.model.d_model % cfg.model.n_heads:
        raise ValueError("config [model].d_model must be divisible by [model].n_heads")
    for key in ("max_operand", "num_ops", "max_turns", "max_tokens_per_turn"):
        positive("env", key, getattr(cfg.env, key))
    positive("sft", "steps", cfg.sft.steps, allow_zero=True)
    positive("sft", "batch_size", cfg.sft.batch_size)
    positive("sft", "learning_rate", cfg.sft.learning_rate)
    positive("rl", "steps", cfg.rl.steps, allow_zero=True)
    positive("rl", "problems_per_step", cfg.rl.problems_per_step)
    if cfg.rl.group_size < 2:
        raise ValueError(f"config [rl].group_size must be >= 2, got {cfg.rl.group_size}")
    positive("rl", "temperature", cfg.rl.temperature)
    positive("rl", "learning_rate", cfg.rl.learning_rate)
    positive("rl", "num_microbatches", cfg.rl.num_microbatches)
    rows = cfg.rl.problems_per_step * cfg.rl.group_size
    if cfg.rl.steps and cfg.rl.num_microbatches > rows:
        raise ValueError(
            f"config [rl].num_microbatches ({cfg.rl.num_microbatches}) exceeds the {rows} "
            "sequences of an RL step ([rl].problems_per_step × [rl].group_size)"
        )
    if not MIN_TEMPERATURE <= cfg.rl.temperature <= MAX_TEMPERATURE:
        raise ValueError(
            f"config [rl].temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
            f"(logits / temperature must stay finite in float32), got {cfg.rl.temperature!r}"
        )
    positive("checkpoint", "interval", cfg.checkpoint.interval, allow_zero=True)
    if cfg.total_steps <= 0:
        raise ValueError("config: [sft].steps + [rl].steps must be > 0")
    if cfg.rl.advantage_estimator not in losses.ESTIMATORS:
        raise ValueError(
            f"config [rl].advantage_estimator must be one of {losses.ESTIMATORS}, got "
            f"{cfg.rl.advantage_estimator!r}"
        )
    if cfg.rl.mode not in ("auto", "client", "builtin", "two_pass"):
        raise ValueError(
            f"config [rl].mode must be auto, client, builtin or two_pass, got {cfg.rl.mode!r}"
        )
    # Let the loss constructors validate their own knobs (clear errors, eagerly).
    try:
        rl_loss(cfg)
    except ValueError as exc:
        raise ValueError(f"config [rl]: {exc}") from exc
    from runner._types import AdamParams

    AdamParams(
        learning_rate=cfg.rl.learning_rate,
        beta1=cfg.optim.beta1,
        beta2=cfg.optim.beta2,
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        grad_clip_norm=cfg.optim.grad_clip_norm,
    )
    if cfg.run.backend == "fireworks":
        from runner.fireworks._validate import validate_static

        validate_static(cfg)


def rl_loss(cfg: Config):
    """``fold(grpo, echo_env)`` from the ``[rl]`` section."""
    rl = cfg.rl
    return losses.fold(
        losses.grpo(
            clip_low=rl.clip_low,
            clip_high=rl.clip_high,
            kl_coef=rl.kl_coef,
            reduction=rl.reduction,
            max_tokens=float(cfg.model.max_seq_len)
            if rl.reduction == "seq_mean_token_sum_norm"
            else None,
        ),
        losses.echo_env(coef=rl.env_coef, normalization=rl.env_normalization),
    )
