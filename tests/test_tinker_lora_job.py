"""The main job with LoRA on a decoder: ``--backend tinker`` against the local server equals
``--backend local``, like with like.

The config is examples/tiny.toml with its ``[model]`` replaced by a random Llama-family decoder
with ``lora_rank = 4`` (alpha 8). The local run trains those adapters in process; the server
serves the same config (``--model lora=<config>``) and the runner's tinker trainer asks for the
same rank (``[tinker].lora_rank``; alpha comes from the served config, the server's rule when
the request has none). Same seed, so the same initialization, rollouts and steps: every
per-step metric agrees within 1e-6, the promotable adapters (PEFT files on both sides) agree
within 1e-6, and the server reports LoRA of that rank and alpha.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

from runner.config import load_config  # noqa: E402
from runner.serve import ServeConfig, ServerThread, parse_model_flags  # noqa: E402
from runner.serve._tinker import parse_tinker_path  # noqa: E402
from runner.train import run  # noqa: E402
from tests.wire_helpers import TINY, assert_same_metrics  # noqa: E402

KEY_ENV = "FOLDLOSS_TEST_TINKER_LORA_KEY"
KEY = f"tml-{uuid.uuid4().hex}"
RANK = 4
TINY_MODEL = """[model]
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64
max_seq_len = 64
"""
LORA_MODEL = """[model]
arch = "llama"
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
d_ff = 64
max_seq_len = 64
lora_rank = 4
lora_alpha = 8.0
"""
STEPS = ["sft.steps=2", "rl.steps=2", "checkpoint.interval=2", "checkpoint.save_promotable=true"]


def _adapters(run_dir: Path, state_dir: Path | None = None) -> dict[str, np.ndarray]:
    """The latest promotable snapshot's PEFT adapter tensors (the run's own directory, or the
    server's ``tinker://`` sampler checkpoint)."""
    from safetensors.numpy import load_file

    from runner import checkpoints as ckpt

    root = run_dir / "checkpoints"
    path = ckpt.read_manifest(root, ckpt.latest_step(root))["promotable"]["snapshot_path"]
    if state_dir is None:
        directory = (run_dir / path).parent  # the snapshot's adapter_model.safetensors
    else:
        ref = parse_tinker_path(path)
        directory = state_dir / "runs" / ref.model_id / "trainer" / "sampler" / ref.name
    assert (directory / "adapter_config.json").is_file(), directory
    return load_file(directory / "adapter_model.safetensors")


def test_lora_main_job_on_tinker_equals_the_local_run(tmp_path, monkeypatch):
    text = TINY.read_text()
    assert TINY_MODEL in text
    config = tmp_path / "lora.toml"
    config.write_text(text.replace(TINY_MODEL, LORA_MODEL))
    out = tmp_path / "runs"
    local = run(
        load_config(config, [f"run.output_dir='{out}'", "run.name='local'", *STEPS]),
        progress=False,
    )
    monkeypatch.setenv(KEY_ENV, KEY)
    state = tmp_path / "state"
    serve = ServeConfig(api_key=KEY, state_dir=str(state), long_poll_s=0.5)
    with ServerThread(serve, parse_model_flags([f"lora={config}"])) as st:
        engine = st.server.engine
        hosted = run(
            load_config(
                config,
                [
                    f"run.output_dir='{out}'",
                    "run.name='tinker'",
                    "run.backend='tinker'",
                    f"tinker.base_url='{st.url}'",
                    "tinker.base_model='lora'",
                    f"tinker.api_key_env='{KEY_ENV}'",
                    f"tinker.lora_rank={RANK}",
                    "tinker.request_timeout_s=60",
                    *STEPS,
                ],
            ),
            progress=False,
        )
        (model,) = engine.models.values()
        assert model.is_lora and model.lora.rank == RANK and model.lora.alpha == 8.0
        assert model.trainer.config.lora is not None
    assert_same_metrics(hosted.run_dir, local.run_dir)
    got, want = _adapters(hosted.run_dir, state), _adapters(local.run_dir)
    assert got.keys() == want.keys() and got
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)
    assert any(np.abs(w).max() > 0 for name, w in want.items() if "lora_B" in name)  # trained
