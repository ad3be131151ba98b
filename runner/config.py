"""The main job's configuration: a TOML file with one table per section, every knob explicit.

``examples/default.toml`` holds the defaults; `load_config` reads a file, applies ``--set``
overrides (``section.key=value``) and validates everything eagerly with errors naming the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import losses
from runner.backends import NAMES, backend


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "default"
    output_dir: str = "runs"
    seed: int = 0
    backend: str = "local"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The local backend's model (`runner.local._from_config`): ``arch = "gpt2"`` (the default
    toy) or a random ``llama`` / ``qwen2`` / ``qwen3`` decoder of these sizes, or ``path`` = a
    Hugging Face checkpoint directory (its ``config.json`` gives the architecture; the sizes are
    then unused). ``lora_rank > 0`` trains LoRA adapters (``lora_alpha`` 0 = the rank;
    ``lora_targets``: ``all-linear`` or ``q_proj,v_proj,...``) on a decoder, whose weights stay
    frozen; ``dtype`` (float32 | bfloat16), ``logprob_chunk`` (tokens per chunk of the
    memory-bounded logprobs, 0 = materialized) and ``unroll_layers`` (unroll the layer loop
    instead of scanning it: about as fast, compile time growing with depth) apply to decoders."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 128
    arch: str = "gpt2"
    path: str = ""
    n_kv_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    dtype: str = "float32"
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: str = "all-linear"
    logprob_chunk: int = 256
    unroll_layers: bool = False


#: The default task and its knobs (``[task.kwargs]`` of the calculator, `runner.tasks.calc`).
DEFAULT_TASK = "runner.tasks.calc:make_task"
DEFAULT_TASK_KWARGS = {"max_operand": 9, "num_ops": 1, "max_turns": 4, "max_tokens_per_turn": 12}


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What RL trains on (`runner.tasks`): ``factory`` is ``"package.module:function"``, called as
    ``function(tokenizer=<the configured tokenizer>, **kwargs)``; ``""`` = no task (SFT on
    ``[sft].data`` only, no reward evaluations). ``kwargs`` default to the calculator's knobs with
    the default factory, and to ``{}`` with any other."""

    factory: str = DEFAULT_TASK
    kwargs: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(DEFAULT_TASK_KWARGS))


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """``path = ""``: the built-in character tokenizer; else a Hugging Face ``tokenizer.json``
    file or model directory, read offline (`runner.tokenizers`). ``chat_template``: a ``.jinja``
    file overriding the directory's template, ``"none"`` for no template, ``""`` = the
    directory's."""

    path: str = ""
    chat_template: str = ""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The SFT phase (`runner.data`): on ``data`` (JSONL) when set, else on the task's
    demonstrations. ``epochs > 0`` (with ``data``, and ``steps = 0``) sets the step count from the
    data; ``batch_tokens > 0`` batches by a token budget instead of ``batch_size`` records;
    ``train_on``: ``all_assistant`` | ``last_assistant``; ``overflow`` (records over
    ``[model].max_seq_len``): ``error`` | ``truncate`` | ``drop``; ``eval_every``: SFT steps
    between evaluations of the NLL on ``eval_data`` (0: at step 0 and the end of SFT only)."""

    steps: int = 70
    batch_size: int = 32
    learning_rate: float = 3e-3
    data: str = ""
    eval_data: str = ""
    epochs: int = 0
    batch_tokens: int = 0
    shuffle: bool = True
    train_on: str = "all_assistant"
    overflow: str = "error"
    eval_every: int = 0


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
    loss: str = ""
    loss_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Asynchronous RL (docs/async.md; checked by runner._pipeline.validate_async).
    rollout: str = "lockstep"
    env_workers: int = 64
    sample_batch_ms: float = 5.0
    max_off_policy_steps: int = 0
    max_concurrent_rollouts: int = 0
    env_timeout_s: float = 0.0
    min_group_size: int = 0
    drop_uniform_groups: bool = False
    max_fill_rounds: int = 1
    pipeline_chunks: int = 1
    anchor: str = "sampler"


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
class TinkerConfig:
    """Tinker API settings (``--backend tinker``; docs/tinker.md): hosted Tinker, a self-hosted
    Tinker-API engine, or the local server (``python -m runner serve``). The API key is read from
    the environment variable named by ``api_key_env`` and never stored in the config.
    ``lora_rank``: the LoRA rank asked for (on the local server: adapters on a decoder; the
    GPT-2-style toy trains full weights and says so). ``train_unembed``: adapt the unembedding
    too (Tinker's own default is true; false here, like the local backend's LoRA, so a run
    compares with ``--backend local``; the local server refuses true).
    ``request_timeout_s``: how long to wait for any one result. ``connect_timeout_s``: the bound
    on reaching ``base_url`` before any SDK call (offline or unreachable: one error line)."""

    base_url: str = "https://tinker.thinkingmachines.dev/services/tinker-prod"
    base_model: str = ""
    lora_rank: int = 32
    train_unembed: bool = False
    api_key_env: str = "TINKER_API_KEY"
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Experiment tracking (`runner.tracking`; docs/tracking.md): copies of ``metrics.jsonl``,
    the config and the plot in Weights & Biases (``wandb``; ``pip install 'foldloss[wandb]'``)
    and TensorBoard event files under the run directory (``tensorboard``; the ``tensorboard``
    extra). ``wandb_entity`` empty: the account's default entity."""

    wandb: bool = False
    wandb_project: str = "foldloss"
    wandb_entity: str = ""
    tensorboard: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    task: TaskConfig = TaskConfig()
    optim: OptimConfig = OptimConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    fireworks: FireworksConfig = FireworksConfig()
    tinker: TinkerConfig = TinkerConfig()
    log: LogConfig = LogConfig()

    @property
    def total_steps(self) -> int:
        return self.sft.steps + self.rl.steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> str:
        """A hash of everything that changes the trajectory of a run (not step counts or names).

        Resuming with a different identity would not reproduce the interrupted run, so the
        runner refuses it. Only settings that differ from their defaults are hashed
        (`identity_of`), so a key added in a later release -- whose default keeps the old
        behaviour -- leaves the identity of a run saved before it unchanged, and the run resumes.
        """
        return identity_of(identity_settings(self.to_dict()), Config().to_dict())


def identity_settings(d: dict[str, Any]) -> dict[str, Any]:
    """The part of a `Config.to_dict` that `Config.identity` hashes (a new dict)."""
    d = {k: dict(v) for k, v in d.items() if isinstance(v, Mapping)}
    d["run"] = {"seed": d["run"]["seed"], "backend": d["run"]["backend"]}
    d["sft"] = {k: v for k, v in d["sft"].items() if k != "steps"}
    d["rl"] = {k: v for k, v in d["rl"].items() if k != "steps"}
    d.pop("checkpoint", None)
    d.pop("log", None)  # where copies of the metrics go
    # where the service is (a resume may use another URL), not what it computes
    d["fireworks"] = {}
    d["tinker"] = {}
    return d


def identity_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``[section].key = old -> new`` for each hashed setting that differs between two
    `Config.to_dict` records (a missing key reads as its default)."""
    defaults = identity_settings(Config().to_dict())
    a, b = identity_settings(dict(old)), identity_settings(dict(new))
    out = []
    for section in sorted(set(a) | set(b) | set(defaults)):
        base = defaults.get(section, {})
        sa, sb = a.get(section, {}), b.get(section, {})
        for key in sorted(set(sa) | set(sb)):
            va, vb = sa.get(key, base.get(key)), sb.get(key, base.get(key))
            if va != vb:
                out.append(f"[{section}].{key} = {va!r} -> {vb!r}")
    return out


def identity_of(settings: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """16 hex digits of the sha256 of ``settings`` without the entries equal to ``defaults``.

    ``settings`` and ``defaults`` map section → key → value; a section whose every kept key
    has its default drops out, so adding a key at its default to both changes nothing.
    """
    kept = {}
    for section, values in settings.items():
        base = defaults.get(section, {})
        diff = {k: v for k, v in values.items() if k not in base or base[k] != v}
        if diff:
            kept[section] = diff
    blob = json.dumps(kept, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
#: The trainer backends (``[run].backend``): `runner.backends` is the registry.
BACKENDS = NAMES
#: A run name is one path component: letters, digits, '.', '_', '-', not '.' or '..'.
#: Sampling temperatures the runner accepts: logits / T stays finite in float32 for |logits| < 1e35.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
_NAME_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9._-]{1,64}$")


def _section_class(name: str):
    return {
        "run": RunConfig,
        "model": ModelConfig,
        "tokenizer": TokenizerConfig,
        "task": TaskConfig,
        "optim": OptimConfig,
        "sft": SFTConfig,
        "rl": RLConfig,
        "checkpoint": CheckpointConfig,
        "fireworks": FireworksConfig,
        "tinker": TinkerConfig,
        "log": LogConfig,
    }[name]


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    where = f"config [{section}].{key}"
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a table, got {value!r}")
        return dict(value)
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
        if section == "env" and section not in _SECTIONS:
            raise ValueError(
                "config: [env] is now [task.kwargs] (the calculator task's knobs: "
                f"{', '.join(DEFAULT_TASK_KWARGS)}); rename the section"
            )
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
        if cls is TaskConfig:  # the calculator's knobs belong to its factory only
            if kwargs.get("factory", DEFAULT_TASK) == DEFAULT_TASK:
                kwargs["kwargs"] = {**DEFAULT_TASK_KWARGS, **kwargs.get("kwargs", {})}
            else:
                kwargs.setdefault("kwargs", {})
        sections[section] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _set(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment or "." not in assignment.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {assignment!r}")
    path, raw = assignment.split("=", 1)
    section, *keys = path.strip().split(".")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string
    table = data.setdefault(section, {})
    for key in keys[:-1]:  # a table key: --set task.kwargs.max_turns=3
        if not isinstance(table.get(key, {}), dict):
            raise ValueError(f"--set {path.strip()}: [{section}].{key} is not a table")
        table = table.setdefault(key, {})
    table[keys[-1]] = value


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
        if not ok or not math.isfinite(value):
            raise ValueError(
                f"config [{section}].{key} must be a finite number "
                f"{'>= 0' if allow_zero else '> 0'}, got {value!r}"
            )

    if not _NAME_RE.match(cfg.run.name):
        raise ValueError(
            f"config [run].name must be one path component of 1-64 letters, digits, '.', '_' or "
            f"'-' (not '.' or '..'), got {cfg.run.name!r}"
        )
    chosen = backend(cfg.run.backend)
    for key in ("d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
        positive("model", key, getattr(cfg.model, key))
    for key in ("n_kv_heads", "head_dim", "lora_rank", "logprob_chunk"):
        positive("model", key, getattr(cfg.model, key), allow_zero=True)
    if cfg.model.d_model % cfg.model.n_heads and not cfg.model.head_dim:
        raise ValueError("config [model].d_model must be divisible by [model].n_heads")
    if chosen.in_process:  # the [model] section builds a model here: its rules now
        from runner.local import local_trainer_config

        local_trainer_config(cfg.model, vocab_size=2, seed=0, checkpoint_dir=None)
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
    if cfg.log.wandb and not cfg.log.wandb_project:
        raise ValueError("config [log].wandb_project must be set when [log].wandb = true")
    from runner.tracking import check_extras

    check_extras(cfg)  # a sink's library is installed (one line naming the extra)
    _validate_data(cfg)
    if cfg.total_steps <= 0 and not cfg.sft.epochs:
        raise ValueError("config: [sft].steps + [rl].steps must be > 0")
    if cfg.rl.advantage_estimator not in losses.ESTIMATORS:
        raise ValueError(
            f"config [rl].advantage_estimator must be one of {losses.ESTIMATORS}, got "
            f"{cfg.rl.advantage_estimator!r}"
        )
    from runner._step import MODES  # the step runner's one list

    if cfg.rl.mode not in MODES:
        raise ValueError(
            f"config [rl].mode must be {', '.join(MODES[:-1])} or {MODES[-1]}, got {cfg.rl.mode!r}"
        )
    if cfg.rl.loss_kwargs and not cfg.rl.loss:
        raise ValueError(
            f"config [rl].loss_kwargs {sorted(cfg.rl.loss_kwargs)} needs [rl].loss (the keyword "
            "arguments of which loss factory?); the default loss takes its knobs from [rl]"
        )
    # Let the loss constructors validate their own knobs (clear errors, eagerly).
    try:
        term = rl_loss(cfg)
    except ValueError as exc:
        raise ValueError(exc.args[0] if cfg.rl.loss else f"config [rl]: {exc}") from exc
    if cfg.rl.steps and cfg.rl.mode in ("builtin", "two_pass"):
        from runner._kernels import KERNEL_NAMES
        from runner._step import plan_step

        try:  # with every kernel of the table: the backend's own subset is checked when built
            plan_step(term, supported=KERNEL_NAMES, mode=cfg.rl.mode)
        except ValueError as exc:
            raise ValueError(f"config [rl].mode = {cfg.rl.mode!r}: {exc}") from None
    _validate_task(cfg)
    from runner._pipeline import validate_async

    validate_async(cfg)
    from runner._types import AdamParams

    AdamParams(
        learning_rate=cfg.rl.learning_rate,
        beta1=cfg.optim.beta1,
        beta2=cfg.optim.beta2,
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        grad_clip_norm=cfg.optim.grad_clip_norm,
    )
    chosen.validate(cfg)  # a hosted backend's own rules (no SDK import)


def _validate_data(cfg: Config) -> None:
    """``[sft]`` data knobs and ``[tokenizer]`` paths (the files are read by `runner.job`)."""
    from runner.chat import TRAIN_ON
    from runner.data import OVERFLOW

    sft = cfg.sft
    for key in ("epochs", "batch_tokens", "eval_every"):
        if getattr(sft, key) < 0:
            raise ValueError(f"config [sft].{key} must be >= 0, got {getattr(sft, key)!r}")
    if sft.train_on not in TRAIN_ON:
        raise ValueError(f"config [sft].train_on must be one of {TRAIN_ON}, got {sft.train_on!r}")
    if sft.overflow not in OVERFLOW:
        raise ValueError(f"config [sft].overflow must be one of {OVERFLOW}, got {sft.overflow!r}")
    for key in ("data", "eval_data"):
        path = getattr(sft, key)
        if path and not Path(path).is_file():
            raise ValueError(f"config [sft].{key}: file not found: {path}")
    if sft.epochs:
        if not sft.data:
            raise ValueError("config [sft].epochs needs [sft].data (the epochs of which file?)")
        if sft.steps:
            raise ValueError(
                f"config [sft].epochs = {sft.epochs} sets the SFT step count from the data: set "
                f"[sft].steps = 0 (got {sft.steps}), or use [sft].steps without epochs"
            )
    if sft.eval_every and not sft.eval_data:
        raise ValueError("config [sft].eval_every needs [sft].eval_data")
    if cfg.tokenizer.path and not Path(cfg.tokenizer.path).exists():
        raise ValueError(f"config [tokenizer].path: not found: {cfg.tokenizer.path}")


def _validate_task(cfg: Config) -> None:
    """Builds the tokenizer and the task once (their own errors, eagerly) and checks that the
    phases have what they train on."""
    from runner.job import build_task, build_tokenizer

    tokenizer = build_tokenizer(cfg)
    if cfg.model.path and backend(cfg.run.backend).in_process:
        from runner.local import local_trainer_config

        model = local_trainer_config(
            cfg.model, vocab_size=tokenizer.vocab_size, seed=0, checkpoint_dir=None
        ).decoder
        # a checkpoint's own tokenizer may have fewer ids than its (padded) embedding, as
        # Qwen3's does; the built-in character tokenizer never matches a foreign checkpoint
        if model.vocab_size > tokenizer.vocab_size and not cfg.tokenizer.path:
            raise ValueError(
                f"config [model].path: the checkpoint's vocab_size {model.vocab_size} is larger "
                f"than the tokenizer's {tokenizer.vocab_size}: the ids it can sample beyond the "
                "tokenizer's cannot be decoded; set [tokenizer].path to the model's own tokenizer"
            )
    task = build_task(cfg, tokenizer)
    if task is None and cfg.rl.steps:
        raise ValueError(
            f"config [rl].steps = {cfg.rl.steps} needs a task: [task].factory is empty"
        )
    if cfg.sft.steps and not cfg.sft.data and not (task and task.has_demonstrations):
        what = "is empty" if task is None else f"{task.name} has no demonstrations(rng, n)"
        raise ValueError(
            f"config [sft].steps = {cfg.sft.steps} needs SFT data: [sft].data is empty and the "
            f"task {what}"
        )


def reference_reason(cfg: Config) -> str | None:
    """Why the run needs a frozen reference model (its RL loss reads ``ref_logprobs``), as the
    config says it — ``"[rl].kl_coef > 0"`` or ``"[rl].loss = '...' (reads ref_logprobs)"`` —
    or ``None``. A custom loss that does not declare what it reads (``Term.reads`` is None) is
    taken not to need one (its own error names the missing field)."""
    if "ref_logprobs" not in (getattr(rl_loss(cfg), "reads", None) or ()):
        return None
    if cfg.rl.loss:
        return f"[rl].loss = {cfg.rl.loss!r} (reads ref_logprobs)"
    return "[rl].kl_coef > 0"


def rl_loss(cfg: Config):
    """The RL loss term: ``[rl].loss`` (``"package.module:function"``, called with
    ``[rl].loss_kwargs``) when set, else ``fold(grpo, echo_env)`` from the ``[rl]`` knobs."""
    rl = cfg.rl
    if rl.loss:
        from runner._plugins import call_factory, resolve_callable

        fn = resolve_callable(rl.loss, "[rl].loss")
        term = call_factory(fn, rl.loss, "[rl].loss", **rl.loss_kwargs)
        if not callable(term):
            raise ValueError(
                f"config [rl].loss = {rl.loss!r} returned {type(term).__name__}, not a loss term "
                "(a callable (logprobs, batch) -> (loss, metrics), e.g. a losses.fold)"
            )
        from runner._client_loss import require_logprob_term

        require_logprob_term(term, f"config [rl].loss = {rl.loss!r}")
        return term
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
