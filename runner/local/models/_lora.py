"""LoRA adapters for the decoders, and their PEFT files (docs/hf-models.md#lora-and-peft-files).

For a targeted projection ``W[out, in]``: ``y = x Wᵀ + s · (x Aᵀ) Bᵀ`` with ``A[r, in]``,
``B[out, r]`` and ``s = alpha / r`` (``alpha / √r`` with rsLoRA; Hu et al. 2021,
arXiv:2106.09685; Kalajdzievski 2023, arXiv:2312.03732). Initialization as PEFT's default
(``init_lora_weights=True``): ``A ~ U(-1/√in, 1/√in)`` (kaiming-uniform with a=√5), ``B = 0``,
so the adapted model starts exactly at the base model. The merged weight is
``W' = W + s · B A`` (PEFT ``get_delta_weight``), computed in float32 or wider.

PEFT layout (``get_peft_model(...).save_pretrained``): ``adapter_config.json`` and
``adapter_model.safetensors`` with tensors
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`` ``[r, in]`` and
``….lora_B.weight`` ``[out, r]``; the header carries ``{"format": "pt"}`` and the tensors' sha256.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runner._atomic import atomic_path, atomic_write_text
from runner._digests import IntegrityError, check_finite
from runner.local.checkpoint import tensors_digest
from runner.local.models import _decoder, _hf_io
from runner.local.models._config import DecoderConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's ``"all-linear"`` for these families (every projection, not the output embedding).
ALL_LINEAR = _decoder.PROJECTIONS
#: adapter_config.json fields that must keep PEFT's default for the adapter to mean what this
#: module computes (key: the accepted values).
_FIXED = {
    "bias": ("none",),
    "fan_in_fan_out": (False,),
    "use_dora": (False,),
    "lora_bias": (False,),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layers_to_transform": (None,),
    "layers_pattern": (None,),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
    "exclude_modules": (None,),
    "layer_replication": (None,),
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA settings (frozen, hashable).

    Attributes:
      rank: r ≥ 1.
      alpha: scaling numerator; ``None`` = ``rank`` (s = 1).
      targets: projections to adapt (subset of ``q_proj k_proj v_proj o_proj gate_proj up_proj
        down_proj``) or ``"all-linear"`` (all of them; the default, as Tinker's attention + MLP).
      use_rslora: ``s = alpha / √r``.
      seed: initialization seed of the A matrices.
    """

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] | str = "all-linear"
    use_rslora: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be an int >= 1, got {self.rank!r}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(self.rank))
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float):
            raise ValueError(f"LoraConfig.alpha must be a number > 0, got {self.alpha!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraConfig.alpha must be a number > 0, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        targets = self.targets
        if targets == "all-linear":
            targets = ALL_LINEAR
        if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets:
            raise ValueError(
                f"LoraConfig.targets must be 'all-linear' or a non-empty list of {ALL_LINEAR}, "
                f"got {self.targets!r}"
            )
        bad = [t for t in targets if t not in ALL_LINEAR]
        if bad:
            raise ValueError(f"LoraConfig.targets: unknown module(s) {bad}; expected {ALL_LINEAR}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"LoraConfig.targets has duplicates: {list(targets)}")
        object.__setattr__(self, "targets", tuple(t for t in ALL_LINEAR if t in targets))
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"LoraConfig.use_rslora must be a bool, got {self.use_rslora!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"LoraConfig.seed must be an int, got {self.seed!r}")

    @property
    def scale(self) -> float:
        """``alpha / r`` (``alpha / √r`` with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)  # type: ignore[operator]


def lora_shapes(cfg: DecoderConfig, lora: LoraConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{proj: {"lora_A": [L, r, in], "lora_B": [L, out, r]}}``."""
    out = {}
    for name in lora.targets:
        o, i = _decoder.proj_shape(cfg, name)
        out[name] = {
            "lora_A": (cfg.num_layers, lora.rank, i),
            "lora_B": (cfg.num_layers, o, lora.rank),
        }
    return out


def init_lora(cfg: DecoderConfig, lora: LoraConfig, *, dtype: Any) -> dict[str, Any]:
    """Initial adapters (numpy): A ~ U(-1/√in, 1/√in) from ``default_rng(lora.seed)``, B = 0."""
    rng = np.random.default_rng(lora.seed)
    dt = np.dtype(dtype)
    out = {}
    for name, shapes in lora_shapes(cfg, lora).items():
        bound = 1.0 / math.sqrt(shapes["lora_A"][2])
        out[name] = {
            "lora_A": rng.uniform(-bound, bound, shapes["lora_A"]).astype(dt),
            "lora_B": np.zeros(shapes["lora_B"], dt),
        }
    return out


def merge(params: Mapping[str, Any], adapters: Mapping[str, Any], scale: float) -> dict:
    """Base weights with ``W' = W + scale · B A`` on every adapted projection (numpy)."""
    layers = dict(params["layers"])
    for name, ab in adapters.items():
        w = np.asarray(layers[name])
        acc = np.promote_types(w.dtype, np.float32)
        a = np.asarray(ab["lora_A"], acc)
        b = np.asarray(ab["lora_B"], acc)
        delta = np.einsum("lor,lri->loi", b, a) * acc.type(scale)
        layers[name] = (w.astype(acc) + delta).astype(w.dtype)
    return dict(params, layers=layers)


def _peft_name(name: str, i: int, which: str) -> str:
    module = "self_attn" if name in _decoder._ATTN else "mlp"
    return f"base_model.model.model.layers.{i}.{module}.{name}.{which}.weight"


def adapter_config(lora: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """The ``adapter_config.json`` object (PEFT's fields for a plain LoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": list(lora.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": lora.use_rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "lora_bias": False,
        "base_model_name_or_path": base_model,
    }


def save_peft(
    directory: str | os.PathLike,
    cfg: DecoderConfig,
    lora: LoraConfig,
    adapters: Mapping[str, Any],
    *,
    base_model: str = "",
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Writes a PEFT adapter directory (atomically replaced if it exists); returns its path."""
    from safetensors.numpy import save_file

    tensors = {}
    for name, ab in adapters.items():
        for which in ("lora_A", "lora_B"):
            stacked = np.asarray(ab[which])
            for i in range(cfg.num_layers):
                tensors[_peft_name(name, i, which)] = np.ascontiguousarray(stacked[i])
    header = {"format": "pt", "data_sha256": tensors_digest(tensors), **(metadata or {})}
    text = json.dumps(adapter_config(lora, base_model), indent=2, sort_keys=True) + "\n"

    def write(tmp: Path) -> None:
        with atomic_path(tmp / ADAPTER_WEIGHTS) as t:
            save_file(tensors, t, metadata=header)
        atomic_write_text(tmp / ADAPTER_CONFIG, text)

    _hf_io.write_dir_atomically(Path(directory), write)
    return Path(directory)


def read_adapter_config(path: Path) -> LoraConfig:
    """A `LoraConfig` from ``adapter_config.json``; unsupported PEFT settings are errors."""
    raw = _hf_io._read_json(path, "adapter config")
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{path}: 'peft_type' = {raw.get('peft_type')!r}; only LORA is supported")
    for key, allowed in _FIXED.items():
        if raw.get(key) not in allowed:
            raise ValueError(
                f"{path}: '{key}' = {raw.get(key)!r} is not supported (supported: {allowed})"
            )
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = "all-linear" if targets == "all-linear" else [targets]
    try:
        return LoraConfig(
            rank=raw.get("r"),
            alpha=raw.get("lora_alpha"),
            targets=tuple(targets) if isinstance(targets, list) else targets,
            use_rslora=bool(raw.get("use_rslora", False)),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_peft(
    directory: str | os.PathLike, cfg: DecoderConfig, *, dtype: Any
) -> tuple[LoraConfig, dict[str, Any]]:
    """Reads a PEFT adapter directory for the architecture ``cfg``.

    Raises:
      FileNotFoundError: no directory or file; ValueError: unsupported adapter config (naming
        the key), missing / unexpected / misshapen tensors (naming them); `IntegrityError`: a
        file written by `save_peft` whose digest differs.
    """
    from safetensors import safe_open

    directory = Path(directory)
    lora = read_adapter_config(directory / ADAPTER_CONFIG)
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path}: adapter weights not found")
    shapes = lora_shapes(cfg, lora)
    expected = {
        _peft_name(name, i, which): (name, which, i, shape[1:])
        for name, ab in shapes.items()
        for which, shape in ab.items()
        for i in range(cfg.num_layers)
    }
    dt = np.dtype(dtype)
    out = {n: {w: np.empty(s, dt) for w, s in ab.items()} for n, ab in shapes.items()}
    try:
        f = safe_open(str(path), framework="numpy")
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
    with f:
        recorded = (f.metadata() or {}).get("data_sha256")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if recorded is not None and tensors_digest(tensors) != recorded:
        raise IntegrityError(
            f"{path} is corrupted or was modified: its tensors' sha256 differs from the one "
            "recorded when it was written"
        )
    for key, arr in tensors.items():
        plain = key.replace(".lora_A.default.weight", ".lora_A.weight").replace(
            ".lora_B.default.weight", ".lora_B.weight"
        )
        if plain not in expected:
            raise ValueError(f"{path}: unexpected tensor {key!r} for this adapter config")
        name, which, i, shape = expected.pop(plain)
        check_finite(arr, f"{path}: tensor {key!r}")
        if tuple(arr.shape) != shape:
            raise ValueError(
                f"{path}: tensor {key!r} has shape {list(arr.shape)}, expected {list(shape)}"
            )
        out[name][which][i] = arr.astype(dt)
    if expected:
        raise ValueError(f"{path}: missing tensor(s) {sorted(expected)[:8]}")
    return lora, out
