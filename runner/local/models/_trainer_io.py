"""The local trainer's decoder-specific state handling: initial parameters, the model identity
recorded in checkpoints, and the promotable (sampler) weights.

Promotable weights of a decoder are written in the Hugging Face formats under
``checkpoint_dir/sampler/<name>/``:

- full fine-tuning: a transformers checkpoint directory (``config.json`` +
  ``model.safetensors``; `runner.local.models._hf_io.save_pretrained`), loadable by
  ``AutoModelForCausalLM.from_pretrained``;
- LoRA: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

The reference `LocalTrainer.save_weights_for_sampler` returns is the safetensors file. Its header
records, beside ``format: pt`` and the tensors' sha256, ``foldloss_kind`` and ``foldloss_model``
(the model identity, `arch_meta`), so the file alone — e.g. copied as the main job's KL
reference — is verified and checked against the loading trainer before any tensor is used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from runner._digests import IntegrityError, check_finite
from runner.local import checkpoint
from runner.local.models import _decoder, _hf_io, _lora
from runner.local.models._config import DecoderConfig, to_dict

SAMPLER_KIND = "foldloss.local.sampler.hf"


def _check_tree(got: Any, shapes: Mapping[str, Any], where: str) -> None:
    if not isinstance(got, Mapping):
        raise ValueError(f"{where}: expected a dict of arrays, got {type(got).__name__}")
    missing = sorted(set(shapes) - set(got))
    extra = sorted(set(got) - set(shapes))
    if missing or extra:
        raise ValueError(f"{where}: missing keys {missing}, unexpected keys {extra}")
    for key, shape in shapes.items():
        if isinstance(shape, Mapping):
            _check_tree(got[key], shape, f"{where}.{key}")
        elif tuple(np.shape(got[key])) != tuple(shape):
            raise ValueError(
                f"{where}.{key}: shape {tuple(np.shape(got[key]))}, expected {tuple(shape)}"
            )


def initial_params(cfg, weights: Any, lp_dtype: np.dtype) -> tuple[Any, Any, dict]:
    """``(trainable, frozen, source)`` of a new trainer (``cfg``: a LocalTrainerConfig).

    GPT-2 default: random `runner.local.model.init_params`, nothing frozen. Decoder: ``weights``
    (checked against the architecture's shapes, cast to ``cfg.dtype``), else the checkpoint
    ``cfg.pretrained`` (whose architecture must equal ``cfg.decoder``), else a random init; with
    LoRA the weights are frozen and the trainable adapters start at B = 0 (in ``lp_dtype``,
    float32 for a bfloat16 base). ``source``: ``{"path", "config"}`` of the checkpoint read
    (``{}`` otherwise), whose metadata keys are kept when the model is saved back.
    """
    from runner.local import model as gpt2

    if cfg.decoder is None:
        if weights is not None:
            raise ValueError(
                "LocalTrainer(weights=...) applies to decoders (LocalTrainerConfig.decoder); the "
                "GPT-2-style default initializes its own"
            )
        return gpt2.init_params(cfg), {}, {}
    dt = np.dtype(cfg.jnp_dtype)
    source: dict[str, Any] = {}
    if weights is None and cfg.pretrained is not None:
        got, weights, raw = _hf_io.load_pretrained(cfg.pretrained, dtype=dt.name)
        if got != cfg.decoder:
            raise ValueError(
                f"{Path(cfg.pretrained) / _hf_io.CONFIG}: architecture differs from "
                f"LocalTrainerConfig.decoder: {got} vs {cfg.decoder}"
            )
        source = {"path": cfg.pretrained, "config": raw}
    if weights is None:
        base = _decoder.init_params(cfg.decoder, seed=cfg.seed, dtype=dt, init_std=cfg.init_std)
    else:
        _check_tree(weights, _decoder.param_shapes(cfg.decoder), "LocalTrainer(weights=...)")
        base = jax.tree.map(lambda x: np.asarray(x).astype(dt, copy=False), weights)
    if cfg.lora is None:
        return base, {}, source
    return _lora.init_lora(cfg.decoder, cfg.lora, dtype=lp_dtype), base, source


def base_digest(frozen: Any) -> str:
    """sha256 of the frozen LoRA base (its flattened tensors), recorded in checkpoints."""
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(frozen))[0]
    }
    return checkpoint.tensors_digest(flat)


def arch_meta(cfg, digest: str | None) -> dict[str, Any]:
    """The model identity of a decoder trainer (JSON-normalized), checked on every load."""
    meta = {
        "decoder": to_dict(cfg.decoder),
        "dtype": cfg.dtype,
        "lora": None,
    }
    if cfg.lora is not None:
        lora = cfg.lora
        meta["lora"] = {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "targets": list(lora.targets),
            "use_rslora": lora.use_rslora,
        }
        meta["base_sha256"] = digest
    return json.loads(json.dumps(meta))


def full_weights(cfg, params: Any, frozen: Any) -> dict[str, Any]:
    """The decoder's inference weights as numpy (the adapters merged in with LoRA)."""
    params = jax.device_get(params)
    if cfg.lora is None:
        return params
    return _lora.merge(jax.device_get(frozen), params, cfg.lora.scale)


def save_sampler(
    root: Path,
    name: str,
    cfg,
    params: Any,
    meta: Mapping[str, Any],
    *,
    source: Mapping[str, Any],
) -> str:
    """Writes ``root/sampler/<name>/`` (module docstring); returns the safetensors path."""
    checkpoint.check_name(name)
    directory = Path(root) / "sampler" / name
    header = {
        "foldloss_kind": SAMPLER_KIND,
        "foldloss_model": json.dumps(meta["model"], sort_keys=True),
        "foldloss_step": str(meta.get("step", 0)),
    }
    if cfg.lora is not None:
        _lora.save_peft(
            directory,
            cfg.decoder,
            cfg.lora,
            jax.device_get(params),
            base_model=str(source.get("path", "")),
            metadata=header,
        )
        return str(directory / _lora.ADAPTER_WEIGHTS)
    _hf_io.save_pretrained(
        directory,
        cfg.decoder,
        jax.device_get(params),
        extra_config=source.get("config"),
        metadata=header,
    )
    return str(directory / _hf_io.SINGLE)


def resolve_sampler(root: Path | None, ref: Any) -> Path:
    """A file or directory from a path, or a name under ``root/sampler``."""
    if not isinstance(ref, str | Path) or not str(ref):
        raise ValueError(f"weights reference must be a non-empty string, got {ref!r}")
    path = Path(ref)
    if path.exists():
        return path
    if root is not None and isinstance(ref, str) and "/" not in ref:
        named = Path(root) / "sampler" / ref
        if named.exists():
            return named
    raise FileNotFoundError(f"no sampler weights at {str(ref)!r} (checkpoint_dir={root})")


def _read_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise IntegrityError(f"sampler weights {path} are unreadable or corrupted: {exc}") from None
    return tensors, meta


def load_sampler(path: Path, cfg, model_meta: Mapping[str, Any], lp_dtype: np.dtype) -> Any:
    """The trainable parameters (numpy) stored at ``path``, for a trainer of config ``cfg``
    whose model identity is ``model_meta``.

    ``path``: a file written by `save_sampler` (verified: kind, sha256, model identity), or a
    directory — a PEFT adapter (LoRA trainers) or a transformers checkpoint (full fine-tuning)
    whose architecture must equal the trainer's.

    Raises:
      FileNotFoundError, ValueError (naming the file / field), `IntegrityError`.
    """
    dec: DecoderConfig = cfg.decoder
    want_dtype = lp_dtype if cfg.lora is not None else np.dtype(cfg.jnp_dtype)
    if path.is_dir():
        if cfg.lora is not None:
            lora, adapters = _lora.load_peft(path, dec, dtype=want_dtype)
            if lora.rank != cfg.lora.rank or lora.targets != cfg.lora.targets:
                raise ValueError(
                    f"{path}: adapter (r={lora.rank}, targets={list(lora.targets)}) differs from "
                    f"this trainer's LoRA (r={cfg.lora.rank}, targets={list(cfg.lora.targets)})"
                )
            if lora.scale != cfg.lora.scale:
                raise ValueError(
                    f"{path}: adapter scale {lora.scale} (lora_alpha={lora.alpha}) differs from "
                    f"this trainer's {cfg.lora.scale}"
                )
            return adapters
        if (path / _lora.ADAPTER_CONFIG).is_file():
            raise ValueError(
                f"{path} is a LoRA adapter, but this trainer trains every weight (no "
                "LocalTrainerConfig.lora)"
            )
        got, params, _ = _hf_io.load_pretrained(path, dtype=want_dtype.name)
        if got != dec:
            raise ValueError(
                f"{path / _hf_io.CONFIG}: architecture differs from this trainer's: {got} vs {dec}"
            )
        return params
    tensors, meta = _read_file(path)
    if meta.get("foldloss_kind") != SAMPLER_KIND:
        raise ValueError(
            f"{path}: not a sampler file written by the local trainer (no foldloss_kind "
            f"{SAMPLER_KIND!r} in its header); pass the checkpoint directory instead"
        )
    recorded = meta.get("data_sha256")
    if not recorded or checkpoint.tensors_digest(tensors) != recorded:
        raise IntegrityError(
            f"sampler weights {path} are corrupted or were modified: their tensors' sha256 "
            "differs from the one recorded when they were written"
        )
    for name, arr in tensors.items():
        check_finite(arr, f"sampler weights {path}: tensor {name!r}")
    try:
        saved = json.loads(meta.get("foldloss_model", "null"))
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"sampler weights {path}: corrupted metadata: {exc}") from None
    mine = json.loads(json.dumps(dict(model_meta)))
    if saved != mine:
        diff = {
            k: (saved.get(k) if isinstance(saved, dict) else None, v)
            for k, v in mine.items()
            if not isinstance(saved, dict) or saved.get(k) != v
        }
        raise ValueError(
            f"{path}: checkpoint model differs from this trainer's (field: (checkpoint, "
            f"trainer)): {diff}"
        )
    if cfg.lora is not None:
        out = {}
        for name, shapes in _lora.lora_shapes(dec, cfg.lora).items():
            out[name] = {}
            for which, shape in shapes.items():
                stacked = np.empty(shape, want_dtype)
                for i in range(dec.num_layers):
                    stacked[i] = tensors[_lora._peft_name(name, i, which)]
                out[name][which] = stacked
        return out
    names = _hf_io.hf_names(dec)
    if set(names) != set(tensors):
        raise ValueError(
            f"{path}: tensors differ from the architecture's (missing "
            f"{sorted(set(names) - set(tensors))[:5]}, unexpected "
            f"{sorted(set(tensors) - set(names))[:5]})"
        )
    shapes = _decoder.param_shapes(dec)
    params: dict[str, Any] = {
        k: np.empty(s, want_dtype) for k, s in shapes.items() if k != "layers"
    }
    params["layers"] = {k: np.empty(s, want_dtype) for k, s in shapes["layers"].items()}
    for hf_name, (key, i, _) in names.items():
        target = params[key] if i is None else params["layers"][key][i]
        target[...] = tensors[hf_name]
    return params
