"""Hugging Face checkpoint directories, offline: ``config.json`` + safetensors (single or sharded).

Reading (`load_pretrained`): ``config.json`` (`from_hf_config`), then ``model.safetensors`` or
``model.safetensors.index.json`` with its shards (docs/hf-models.md#tensors-and-files). Every tensor the
architecture needs must be present with its exact shape; any other tensor is an error, except
the non-persistent rotary buffers older exports carry (``…rotary_emb.inv_freq``) and an
``lm_head.weight`` equal to the embedding of a tied model. Errors name the file and the tensor.
Weights are cast to the requested dtype (float32 by default, whatever the stored dtype).

Writing (`save_pretrained`): transformers 5's layout (``config.json`` with ``rope_parameters``
and ``dtype``; ``lm_head.weight`` omitted when tied; shards plus an index above
``max_shard_bytes``), loadable by ``AutoModelForCausalLM.from_pretrained``. Every safetensors
header carries ``{"format": "pt"}`` and the sha256 of its tensors (``data_sha256``,
`runner.local.checkpoint.tensors_digest`) plus that of ``config.json`` (``config_sha256``);
`load_pretrained` verifies both whenever they are present. The directory is built under a
temporary name and published with one rename (an existing directory is replaced only after
the new one is complete).

Nothing here downloads anything: paths are local directories.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runner._atomic import atomic_path, atomic_write_text, make_dirs, publish_dir
from runner._digests import IntegrityError, bytes_digest, check_finite
from runner.local.checkpoint import tensors_digest
from runner.local.models import _decoder
from runner.local.models._config import DecoderConfig, from_hf_config, to_hf_config

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Storage dtypes read (safetensors names) and written.
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}

_LAYER_NAMES = {
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
for _p in _decoder.PROJECTIONS:
    _mod = "self_attn" if _p in _decoder._ATTN else "mlp"
    _LAYER_NAMES[_p] = f"{_mod}.{_p}.weight"
    _LAYER_NAMES[f"{_p}_bias"] = f"{_mod}.{_p}.bias"
_TOP_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


def hf_names(cfg: DecoderConfig) -> dict[str, tuple[str, int | None, tuple[int, ...]]]:
    """``{HF tensor name: (param key, layer index or None, shape)}`` of an architecture."""
    shapes = _decoder.param_shapes(cfg)
    out: dict[str, tuple[str, int | None, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        if key != "layers":
            out[_TOP_NAMES[key]] = (key, None, shape)
    for key, shape in shapes["layers"].items():
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{_LAYER_NAMES[key]}"] = (key, i, shape[1:])
    return out


def to_hf_tensors(cfg: DecoderConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Flat ``{HF name: array}`` of a parameter pytree (views of the stacked layers)."""
    out = {}
    for name, (key, i, _) in hf_names(cfg).items():
        arr = params[key] if i is None else params["layers"][key][i]
        out[name] = np.ascontiguousarray(np.asarray(arr))
    return out


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {what} is not valid JSON: {exc}") from None


def read_config(directory: str | os.PathLike) -> tuple[DecoderConfig, dict[str, Any]]:
    """``(DecoderConfig, raw config.json)`` of a checkpoint directory."""
    path = Path(directory) / CONFIG
    raw = _read_json(path, "model config")
    return from_hf_config(raw, where=str(path)), raw


def _weight_files(directory: Path) -> dict[str, list[str]]:
    """``{shard file name: [tensor names]}`` from the index, or the single file's names."""
    from safetensors import safe_open

    index = directory / INDEX
    single = directory / SINGLE
    if index.is_file():
        data = _read_json(index, "safetensors index")
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise ValueError(f"{index}: no 'weight_map' object")
        files: dict[str, list[str]] = {}
        for tensor, fname in wmap.items():
            if not isinstance(fname, str) or Path(fname).name != fname:
                raise ValueError(f"{index}: tensor {tensor!r} maps to an invalid file {fname!r}")
            files.setdefault(fname, []).append(tensor)
        for fname, names in files.items():
            if not (directory / fname).is_file():
                raise FileNotFoundError(
                    f"{index}: shard {fname} (holding e.g. {names[0]!r}) is missing from "
                    f"{directory}"
                )
        return files
    if single.is_file():
        try:
            with safe_open(str(single), framework="numpy") as f:
                return {SINGLE: list(f.keys())}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{single}: not a readable safetensors file: {exc}") from None
    others = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    hint = ""
    if any(n.endswith(".bin") or n.endswith(".pt") or n.endswith(".pth") for n in others):
        hint = " (only safetensors weights are read; convert pickled .bin/.pt weights first)"
    raise FileNotFoundError(f"{directory}: no {SINGLE} or {INDEX}{hint}; found {others[:20]}")


def load_pretrained(
    directory: str | os.PathLike, *, dtype: str = "float32"
) -> tuple[DecoderConfig, dict[str, Any], dict[str, Any]]:
    """Reads a local Hugging Face checkpoint directory.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` or a sharded index.
      dtype: the returned arrays' dtype (``float32``, ``float64`` or ``bfloat16``).

    Returns:
      ``(config, params, raw config.json)``; params are numpy arrays in the layout of
      `runner.local.models._decoder`.

    Raises:
      FileNotFoundError: no directory, ``config.json``, weights or shard (naming it).
      ValueError: unsupported config (naming the key), missing / unexpected / misshapen tensors
        (naming the tensor and file), a tied ``lm_head.weight`` that differs from the
        embedding; `IntegrityError`: a file written by `save_pretrained` whose digest differs.
    """
    from safetensors import safe_open

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    cfg, raw = read_config(directory)
    config_digest = bytes_digest([(directory / CONFIG).read_bytes()])
    files = _weight_files(directory)
    expected = hf_names(cfg)
    dt = np.dtype(dtype)
    shapes = _decoder.param_shapes(cfg)
    params: dict[str, Any] = {k: np.empty(s, dt) for k, s in shapes.items() if k != "layers"}
    params["layers"] = {k: np.empty(s, dt) for k, s in shapes["layers"].items()}
    seen: set[str] = set()
    spare_lm_head = None
    for fname, names in sorted(files.items()):
        path = directory / fname
        try:
            f = safe_open(str(path), framework="numpy")
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
        with f:
            meta = f.metadata() or {}
            recorded = meta.get("config_sha256")
            if recorded is not None and recorded != config_digest:
                raise IntegrityError(
                    f"{path} was written with a different {CONFIG} (its config_sha256 differs "
                    f"from {directory / CONFIG}'s): the checkpoint's files do not belong together"
                )
            in_file = set(f.keys())
            for name in names:
                if name not in in_file:
                    raise ValueError(f"{path}: tensor {name!r} (named by the index) is missing")
            verify = meta.get("data_sha256")
            if (
                verify is not None
                and tensors_digest({k: f.get_tensor(k) for k in in_file}) != verify
            ):
                raise IntegrityError(
                    f"{path} is corrupted or was modified: its tensors' sha256 differs from the "
                    "one recorded when it was written"
                )
            for name in names:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # non-persistent buffer in older exports; recomputed from config
                if name not in expected:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        spare_lm_head = (path, f.get_tensor(name))
                        continue
                    raise ValueError(
                        f"{path}: unexpected tensor {name!r} for a {cfg.family} model with this "
                        f"{CONFIG} (layers={cfg.num_layers}, tie_word_embeddings="
                        f"{cfg.tie_word_embeddings}, attention_bias={cfg.attention_bias})"
                    )
                key, i, shape = expected[name]
                got = tuple(f.get_slice(name).get_shape())
                if got != shape:
                    raise ValueError(
                        f"{path}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                        f"from {CONFIG}"
                    )
                if f.get_slice(name).get_dtype() not in _DTYPES:
                    raise ValueError(
                        f"{path}: tensor {name!r} has dtype {f.get_slice(name).get_dtype()}; "
                        f"supported: {sorted(_DTYPES)}"
                    )
                arr = f.get_tensor(name)
                check_finite(arr, f"{path}: tensor {name!r}")
                target = params[key] if i is None else params["layers"][key][i]
                target[...] = arr.astype(dt)
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(
            f"{directory}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"required by {CONFIG} ({cfg.family}, tie_word_embeddings={cfg.tie_word_embeddings})"
        )
    if spare_lm_head is not None:
        path, head = spare_lm_head
        if not np.array_equal(head.astype(dt), params["embed"]):
            raise ValueError(
                f"{path}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' but "
                f"{CONFIG} has tie_word_embeddings=true (transformers would not tie them); fix "
                "the flag or the tensor"
            )
    return cfg, params, raw


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int | None) -> list[list[str]]:
    names = sorted(tensors)
    if max_bytes is None:
        return [names]
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].nbytes
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    return groups


def write_dir_atomically(final: Path, write) -> None:
    """Builds a directory with ``write(tmp_dir)`` under a temporary sibling, then publishes it
    as ``final`` (an existing ``final`` is moved aside and removed only once the new one is in
    place)."""
    final = Path(final)
    make_dirs(final.parent)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        write(tmp)
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:12]}")
            os.replace(final, old)
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_pretrained(
    directory: str | os.PathLike,
    cfg: DecoderConfig,
    params: Mapping[str, Any],
    *,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    extra_config: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Writes a Hugging Face checkpoint directory (module docstring); returns its path.

    Args:
      directory: the checkpoint directory (replaced atomically if it exists).
      cfg: the architecture.
      params: the weights (numpy or jax arrays, layout of `runner.local.models._decoder`).
      dtype: stored dtype (default: the params' dtype).
      max_shard_bytes: shard above this many bytes (``model-0000k-of-0000N.safetensors`` plus
        ``model.safetensors.index.json``); ``None`` = one file.
      extra_config: metadata keys of a source ``config.json`` to keep (token ids, ...).
      metadata: extra safetensors header entries (strings).
    """
    from safetensors.numpy import save_file

    if max_shard_bytes is not None and not (
        isinstance(max_shard_bytes, int) and max_shard_bytes > 0
    ):
        raise ValueError(
            f"save_pretrained: max_shard_bytes must be an int > 0, got {max_shard_bytes!r}"
        )
    tensors = to_hf_tensors(cfg, params)
    store = np.dtype(dtype) if dtype is not None else tensors[_TOP_NAMES["embed"]].dtype
    tensors = {k: np.ascontiguousarray(v.astype(store)) for k, v in tensors.items()}
    config_text = json.dumps(
        to_hf_config(cfg, dtype=str(store), extra=extra_config), indent=2, sort_keys=True
    )
    config_text += "\n"
    config_digest = bytes_digest([config_text.encode()])
    groups = _shards(tensors, max_shard_bytes)

    def write(tmp: Path) -> None:
        n = len(groups)
        weight_map = {}
        for k, names in enumerate(groups, 1):
            fname = SINGLE if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
            part = {name: tensors[name] for name in names}
            header = {"format": "pt", "data_sha256": tensors_digest(part)}
            header["config_sha256"] = config_digest
            header.update(metadata or {})
            with atomic_path(tmp / fname) as t:
                save_file(part, t, metadata=header)
            weight_map.update(dict.fromkeys(names, fname))
        if n > 1:
            index = {
                "metadata": {
                    "total_size": int(sum(v.nbytes for v in tensors.values())),
                    "total_parameters": int(sum(v.size for v in tensors.values())),
                },
                "weight_map": dict(sorted(weight_map.items())),
            }
            atomic_write_text(tmp / INDEX, json.dumps(index, indent=2) + "\n")
        atomic_write_text(tmp / CONFIG, config_text)

    write_dir_atomically(Path(directory), write)
    return Path(directory)
