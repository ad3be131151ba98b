"""Architecture configuration of the Llama / Qwen2 / Qwen3 decoders, and its ``config.json`` form.

`DecoderConfig` is frozen and hashable (a static argument of the jitted model functions). It
is read from and written to a Hugging Face ``config.json`` by `from_hf_config` / `to_hf_config`
(docs/hf-models.md#configjson): both layouts are accepted — transformers 5's ``rope_parameters``
and the legacy top-level ``rope_theta`` + ``rope_scaling`` — and every key is either used,
checked to hold the one value implemented, or known to be metadata; anything else fails with a
``ValueError`` naming the file and the key (fail closed: an unknown key may change numerics).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

#: ``model_type`` → the ``architectures`` entry of a causal LM of that family.
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: RoPE variants implemented (`runner.local.models._rope`).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
#: transformers' class defaults that matter when a key is missing (``LlamaConfig``,
#: ``Qwen2Config``, ``Qwen3Config`` in 5.24; docs/hf-models.md#configjson).
_CLASS_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False),
    "qwen2": dict(
        rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, kv_heads=32
    ),
    "qwen3": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        kv_heads=32,
        head_dim=128,
    ),
}
_DEFAULT_THETA = 10000.0

#: Keys that carry no numerics for a causal LM forward (PretrainedConfig bookkeeping, token ids,
#: generation and init settings); read by nobody here.
_METADATA_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "transformers_version",
        "use_cache",
        "initializer_range",
        "dtype",
        "torch_dtype",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "max_length",
        "pruned_heads",
        "torchscript",
        "tf_legacy_loss",
        "use_bfloat16",
        "pretraining_tp",  # in LlamaConfig, unused by transformers 5's modeling (docs/hf-models.md#architecture)
        "is_llama_config",  # SmolLM2 extra, ignored by transformers
        "model_type",
        "max_window_layers",  # only meaningful with use_sliding_window (checked)
        "sliding_window",  # idem
    }
)
_ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "partial_rotary_factor",
    }
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding (docs/hf-models.md#architecture; ``modeling_rope_utils.py``).

    Attributes:
      rope_type: ``default`` | ``linear`` | ``dynamic`` | ``llama3`` | ``yarn``.
      theta: the base θ (``rope_theta``).
      factor: scaling factor (every type but ``default``; yarn may derive it).
      low_freq_factor, high_freq_factor: llama3 band edges.
      original_max_position_embeddings: pretraining context (llama3, yarn).
      attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate: yarn knobs
        (``None`` = transformers' defaults).
    """

    rope_type: str = "default"
    theta: float = _DEFAULT_THETA
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RopeConfig.rope_type {self.rope_type!r} is not implemented; expected one of "
                f"{ROPE_TYPES}"
            )
        if not (_is_number(self.theta) and self.theta > 1):
            raise ValueError(f"RopeConfig.theta must be a number > 1, got {self.theta!r}")
        needs = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            "yarn": ("original_max_position_embeddings",),
        }.get(self.rope_type, ())
        for key in needs:
            if getattr(self, key) is None:
                raise ValueError(f"RopeConfig: rope_type {self.rope_type!r} needs {key}")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
            v = getattr(self, key)
            if v is not None and not (_is_number(v) and v > 0):
                raise ValueError(f"RopeConfig.{key} must be a number > 0, got {v!r}")
        if (
            self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor  # type: ignore[operator]
        ):
            raise ValueError(
                "RopeConfig: llama3 needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        omp = self.original_max_position_embeddings
        if omp is not None and not (_is_int(omp) and omp > 0):
            raise ValueError(
                f"RopeConfig.original_max_position_embeddings must be a positive int, got {omp!r}"
            )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A Llama-family / Qwen2 / Qwen3 dense decoder (docs/hf-models.md#architecture; frozen, hashable).

    Attributes:
      family: ``llama`` | ``qwen2`` | ``qwen3`` (the ``model_type``).
      vocab_size: V.
      hidden_size: H.
      intermediate_size: I (SwiGLU width).
      num_layers: L.
      num_heads: query heads n_h.
      num_kv_heads: key/value heads n_kv (divides n_h); ``None`` = n_h.
      head_dim: d; ``None`` = H / n_h (which must then divide). Qwen3 usually has d ≠ H / n_h.
      rms_norm_eps: ε of every RMSNorm.
      rope: the `RopeConfig`.
      max_position_embeddings: the model's context (dynamic/yarn scaling reads it).
      tie_word_embeddings: the unembedding is the token embedding (no ``lm_head.weight``).
      attention_bias: q/k/v/o biases (llama, qwen3); Qwen2 always has q/k/v biases and no o bias.
      mlp_bias: gate/up/down biases (llama only).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"DecoderConfig.family {self.family!r} is not supported; expected one of "
                f"{tuple(FAMILIES)}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "max_position_embeddings",
        ):
            v = getattr(self, key)
            if not (_is_int(v) and v > 0):
                raise ValueError(f"DecoderConfig.{key} must be a positive int, got {v!r}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if not (_is_int(self.num_kv_heads) and self.num_kv_heads > 0):
            raise ValueError(
                f"DecoderConfig.num_kv_heads must be a positive int, got {self.num_kv_heads!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"DecoderConfig.hidden_size={self.hidden_size} must be divisible by "
                    f"num_heads={self.num_heads} when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not (_is_int(self.head_dim) and self.head_dim > 0 and self.head_dim % 2 == 0):
            raise ValueError(
                f"DecoderConfig.head_dim must be a positive even int (RoPE rotates halves), got "
                f"{self.head_dim!r}"
            )
        if not (_is_number(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ValueError(f"DecoderConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not isinstance(self.rope, RopeConfig):
            raise ValueError(f"DecoderConfig.rope must be a RopeConfig, got {self.rope!r}")
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"DecoderConfig.{key} must be a bool, got {getattr(self, key)!r}")
        if self.family == "qwen2" and self.attention_bias:
            raise ValueError(
                "DecoderConfig.attention_bias: qwen2 always has q/k/v biases and no o_proj bias; "
                "leave attention_bias False"
            )
        if self.family != "llama" and self.mlp_bias:
            raise ValueError(f"DecoderConfig.mlp_bias: {self.family} has no MLP biases")

    # -- derived flags (docs/hf-models.md#architecture) ----------------------------------------------------

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.family != "qwen2" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def num_rep(self) -> int:
        """Query heads per key/value head (``num_key_value_groups``)."""
        return self.num_heads // self.num_kv_heads  # type: ignore[operator]


# -- config.json --------------------------------------------------------------------------------


def _rope_from_hf(raw: Mapping[str, Any], where: str, max_pos: int) -> RopeConfig:
    params = raw.get("rope_parameters")
    legacy = raw.get("rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"{where}: 'rope_parameters' must be an object, got {params!r}")
    if legacy is not None and not isinstance(legacy, Mapping):
        raise ValueError(f"{where}: 'rope_scaling' must be an object or null, got {legacy!r}")
    merged: dict[str, Any] = {}
    if params:
        if any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(
                f"{where}: 'rope_parameters' nested by layer type is not supported (one RoPE "
                "for every layer is implemented)"
            )
        merged.update(params)
    elif legacy:
        merged.update(legacy)
    section = "rope_parameters" if params else "rope_scaling"
    for key in merged:
        if key not in _ROPE_KEYS:
            raise ValueError(f"{where}: unsupported key '{section}.{key}'")
    theta = merged.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA))
    if theta is None:
        theta = _DEFAULT_THETA
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{where}: '{section}.rope_type' = {rope_type!r} is not implemented (supported: "
            f"{', '.join(ROPE_TYPES)})"
        )
    prf = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise ValueError(
            f"{where}: 'partial_rotary_factor' = {prf!r} is not supported (RoPE over the whole "
            "head_dim only)"
        )
    omp = merged.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and omp is None:
        omp = raw.get("original_max_position_embeddings", max_pos)  # standardize_rope_params
    truncate = merged.get("truncate", True)
    try:
        return RopeConfig(
            rope_type=rope_type,
            theta=float(theta) if _is_number(theta) else theta,
            factor=merged.get("factor"),
            low_freq_factor=merged.get("low_freq_factor"),
            high_freq_factor=merged.get("high_freq_factor"),
            original_max_position_embeddings=omp,
            attention_factor=merged.get("attention_factor"),
            beta_fast=merged.get("beta_fast"),
            beta_slow=merged.get("beta_slow"),
            mscale=merged.get("mscale"),
            mscale_all_dim=merged.get("mscale_all_dim"),
            truncate=bool(truncate),
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {section}: {exc}") from None


def from_hf_config(raw: Mapping[str, Any], where: str = "config.json") -> DecoderConfig:
    """A `DecoderConfig` from a Hugging Face ``config.json`` object.

    Args:
      raw: the parsed JSON object.
      where: the file, for error messages.

    Returns:
      The `DecoderConfig` (class defaults of transformers 5.24 fill missing keys: rope θ 10000,
      Qwen3 ``head_dim`` 128 and ``num_key_value_heads`` 32, ...).

    Raises:
      ValueError: naming ``where`` and the key — no or unknown ``model_type``, an
        ``architectures`` entry that is not the family's causal LM, a missing size, an
        unsupported value (``hidden_act`` ≠ silu, a sliding window, an unimplemented rope type,
        dropout, quantization, ...) or an unknown key.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    family = raw.get("model_type")
    if family is None:
        raise ValueError(f"{where}: no 'model_type' key (expected one of {tuple(FAMILIES)})")
    if family not in FAMILIES:
        raise ValueError(
            f"{where}: 'model_type' = {family!r} is not a supported architecture (supported: "
            f"{', '.join(FAMILIES)})"
        )
    archs = raw.get("architectures")
    if archs is not None and list(archs) != [FAMILIES[family]]:
        raise ValueError(
            f"{where}: 'architectures' = {archs!r}: only {FAMILIES[family]} (a causal LM) is "
            "supported"
        )
    defaults = _CLASS_DEFAULTS[family]
    handled = set(_METADATA_KEYS)

    def take(key: str, default: Any = dataclasses.MISSING) -> Any:
        handled.add(key)
        if key in raw and raw[key] is not None:
            return raw[key]
        if default is dataclasses.MISSING:
            raise ValueError(f"{where}: missing required key '{key}'")
        return default

    def require(key: str, allowed: tuple, default: Any) -> None:
        value = take(key, default)
        if value not in allowed:
            raise ValueError(
                f"{where}: '{key}' = {value!r} is not supported (supported: {allowed!r})"
            )

    sizes = {
        k: take(k)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
    }
    kv = take("num_key_value_heads", defaults.get("kv_heads", sizes["num_attention_heads"]))
    head_dim = take("head_dim", defaults.get("head_dim"))  # Qwen2 reads it too (getattr)
    max_pos = take("max_position_embeddings", defaults["max_position_embeddings"])
    require("hidden_act", ("silu",), "silu")
    require("attention_dropout", (0, 0.0), 0.0)
    require("use_sliding_window", (False,), False)
    require("rope_interleaved", (False,), False)
    if family != "llama":
        require("mlp_bias", (False,), False)
    if family == "qwen2":
        require("attention_bias", (False,), False)
    eps = take("rms_norm_eps", defaults["rms_norm_eps"])
    tie = take("tie_word_embeddings", defaults["tie_word_embeddings"])
    attention_bias = take("attention_bias", False)
    mlp_bias = take("mlp_bias", False)
    layer_types = take("layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{where}: 'layer_types' = {layer_types!r}: only full_attention layers are supported"
        )
    for key in (
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "original_max_position_embeddings",
    ):
        handled.add(key)
    unknown = sorted(k for k in raw if k not in handled)
    if unknown:
        raise ValueError(
            f"{where}: unsupported key(s) {unknown} (not implemented by the local trainer's "
            f"{family} decoder; refusing to guess their effect)"
        )
    try:
        return DecoderConfig(
            family=family,
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=sizes["num_attention_heads"],
            num_kv_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=float(eps) if _is_number(eps) else eps,
            rope=_rope_from_hf(raw, where, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=tie,
            attention_bias=attention_bias,
            mlp_bias=mlp_bias,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    """The transformers-5 ``rope_parameters`` object of a `RopeConfig`."""
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    for f in dataclasses.fields(RopeConfig):
        if f.name in ("rope_type", "theta", "truncate"):
            continue
        v = getattr(rope, f.name)
        if v is not None:
            out[f.name] = v
    if rope.rope_type == "yarn" and not rope.truncate:
        out["truncate"] = False
    return out


def to_hf_config(cfg: DecoderConfig, *, dtype: str, extra: Mapping[str, Any] | None = None) -> dict:
    """The ``config.json`` object of ``cfg`` in transformers 5's layout (loadable by
    ``AutoModelForCausalLM.from_pretrained``).

    Args:
      cfg: the architecture.
      dtype: the stored weights' dtype (``"float32"``, ``"bfloat16"``, ...), written as ``dtype``.
      extra: metadata keys to keep from a source ``config.json`` (token ids, ...); keys that
        describe the architecture are always rewritten from ``cfg``.
    """
    out: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if key in _METADATA_KEYS and key not in ("dtype", "torch_dtype", "model_type"):
            out[key] = value
    out.update(
        model_type=cfg.family,
        architectures=[FAMILIES[cfg.family]],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope_to_hf(cfg.rope),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        attention_dropout=0.0,
        dtype=dtype,
    )
    out["head_dim"] = cfg.head_dim
    if cfg.family != "qwen2":
        out["attention_bias"] = cfg.attention_bias
    if cfg.family == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if cfg.family != "llama":
        out["use_sliding_window"] = False
    return out


def to_dict(cfg: DecoderConfig) -> dict[str, Any]:
    """A JSON-able dict of ``cfg`` (for checkpoint metadata); `from_dict` inverts it."""
    return dataclasses.asdict(cfg)


def from_dict(d: Mapping[str, Any]) -> DecoderConfig:
    """Inverse of `to_dict`."""
    d = dict(d)
    d["rope"] = RopeConfig(**d.get("rope", {}))
    return DecoderConfig(**d)
