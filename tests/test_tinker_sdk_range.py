"""The Tinker backend on another tinker SDK version against ``python -m runner serve``.

SkyRL tx pins ``tinker>=0.25,<0.26``; the venv has 0.38. ``.ci/tinker-compat`` installs 0.25.x
into a directory that shadows the venv's SDK (``PYTHONPATH``) and runs this module with
``FOLDLOSS_TINKER_SDK`` naming the version it expects; without that variable the module is
skipped (the main suite tests 0.38 in depth: tests/test_tinker*.py). The server runs in its own
process on the venv's SDK (a server is its own product); the runner, in this process, uses the
SDK under test: the main job equals the local run, a state saved through it loads back, and a
server that normalises ``cross_entropy`` differently is refused in one line.
"""

from __future__ import annotations

import importlib.metadata
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

WANTED = os.environ.get("FOLDLOSS_TINKER_SDK", "")
if not WANTED:
    pytest.skip("run by .ci/tinker-compat (FOLDLOSS_TINKER_SDK unset)", allow_module_level=True)
tinker = pytest.importorskip("tinker")
pytest.importorskip("aiohttp")

from runner import AdamParams, Seq  # noqa: E402
from runner import __main__ as cli  # noqa: E402
from runner.config import load_config  # noqa: E402
from runner.tinker import make_trainer  # noqa: E402
from tests.wire_helpers import (  # noqa: E402
    TINY,
    ServeProcess,
    assert_same_metrics,
    one_error_line,
    subprocess_env,
)

MODEL = "foldloss/tiny"
KEY_ENV = "FOLDLOSS_TEST_TINKER_RANGE_KEY"
KEY = f"tml-{uuid.uuid4().hex}"


@pytest.fixture(scope="module", params=["", "skyrl"])
def server(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    extra = ["--test-cross-entropy", request.param] if request.param else []
    proc = ServeProcess(
        tmp / "state",
        subprocess_env(tmp, {KEY_ENV: KEY}),
        tmp / "serve.log",
        models=[f"{MODEL}=examples/tiny.toml"],
        key_envs=[KEY_ENV],
        extra=extra,
    )
    yield request.param, proc.url
    proc.stop()


def _tinker_sets(url: str) -> list[str]:
    sets = [
        "run.backend='tinker'",
        f"tinker.base_url='{url}'",
        f"tinker.base_model='{MODEL}'",
        f"tinker.api_key_env='{KEY_ENV}'",
        "tinker.lora_rank=8",
        "tinker.request_timeout_s=120.0",
    ]
    return [a for s in sets for a in ("--set", s)]


def _train(out: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--output-dir", str(out), "--no-progress", *extra]


def test_the_sdk_under_test_is_the_one_asked_for():
    assert importlib.metadata.version("tinker").startswith(WANTED)
    assert tinker.__version__.startswith(WANTED)


def test_the_main_job_equals_the_local_run(server, tmp_path, monkeypatch, capsys):
    mode, url = server
    if mode:
        pytest.skip("the conforming server's")
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    assert cli.main(_train(tmp_path / "local")) == 0
    assert cli.main(_train(tmp_path / "tinker", *_tinker_sets(url))) == 0
    capsys.readouterr()
    assert_same_metrics(tmp_path / "tinker" / "tiny", tmp_path / "local" / "tiny")


def test_a_saved_state_loads_back(server, monkeypatch):
    mode, url = server
    if mode:
        pytest.skip("the conforming server's")
    monkeypatch.setenv(KEY_ENV, KEY)
    overrides = [a for a in _tinker_sets(url) if a != "--set"]
    trainer = make_trainer(load_config(TINY, overrides))
    try:
        seq = Seq(np.arange(1, 9), {"weights": np.full(7, 1 / 7)})
        trainer.forward_backward([seq], "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=1e-2))
        want = trainer.forward([seq])[0]
        record = trainer.save_resumable("range-a")
        assert record["identity_resolved"]
        trainer.forward_backward([seq], "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=1e-2))
        assert not np.array_equal(trainer.forward([seq])[0], want)
        trainer.load_resumable(record)
        np.testing.assert_array_equal(trainer.forward([seq])[0], want)
        (sample,) = trainer.sample([[1, 2, 3]], num_samples=1, max_tokens=4, seed=5)[0:1]
        assert len(sample) == 1
    finally:
        trainer.close()


def test_a_skyrl_normalising_server_is_refused_in_one_line(server, tmp_path, monkeypatch, capsys):
    mode, url = server
    if not mode:
        pytest.skip("the skyrl server's")
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    args = ["sft", "--config", str(TINY), "--output-dir", str(tmp_path), "--no-progress"]
    capsys.readouterr()
    assert cli.main([*args, *_tinker_sets(url)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "cross_entropy is not the token sum" in line and url in line
