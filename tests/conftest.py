"""Test configuration: float64 JAX, strict rank promotion, hypothesis profiles, one persistent
compilation cache per test session, the shared reference run, and the order of the test files.

Profiles (``HYPOTHESIS_PROFILE``): ``default`` (CI, ~25 examples per property), ``thorough``
(200 examples) and ``quick`` (8). Every profile disables the deadline: the first example of a
new shape pays a jit compilation.

The compilation cache: the session's first process (the xdist controller, or the only process)
creates a temporary directory and exports it as ``JAX_COMPILATION_CACHE_DIR`` (with both size
and time thresholds at 0) before any worker or child starts, so that the workers and every
``python -m runner`` child of the session reuse each other's XLA executables; it is removed at
the end of the session. A directory already in the environment is used as it is.
"""

import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False)
settings.register_profile("default", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=200, **_common)
settings.register_profile("quick", max_examples=8, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

from tests import reference_run  # noqa: E402

#: The test files with the most work (CI's ``--durations`` report, 2026-12-01), heaviest first.
#: They are collected before the rest, so that ``--dist loadfile`` hands them out first and the
#: two workers finish together; collected alphabetically, a heavy file could start last and run
#: alone for minutes. The order within a file, and among the other files, is unchanged.
HEAVY_FILES_FIRST = (
    "test_fireworks_main_job.py",
    "test_main_job.py",
    "test_fused_head.py",
    "test_benchmarks.py",
    "test_tinker_main_job.py",
    "test_hf_trainer.py",
    "test_hf_decoder_vjp.py",
    "test_client_loss.py",
    "test_runner_paths.py",
    "test_tasks.py",
    "test_data.py",
    "test_tinker_lora_job.py",
    "test_hosted_tasks.py",
    "test_serve_hf.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


# -- one compilation cache per session -----------------------------------------------------------

_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: it inherited the controller's cache
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        cache = tempfile.mkdtemp(prefix="foldloss-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    for name, value in _CACHE_ENV.items():
        os.environ.setdefault(name, value)
    # This process imported jax before the variables were set (a worker reads them at import).
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes",
        int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
    )


# -- the shared reference run ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory) -> tuple[Path, str]:
    """``(run directory, stdout)`` of examples/tiny.toml's reference run
    (`tests.reference_run.tiny_reference_args`), made once per test session and shared by the
    xdist workers."""
    base = tmp_path_factory.getbasetemp()
    # A worker's basetemp is a folder of the controller's, which every worker sees.
    session = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return reference_run.tiny_reference_run(session / "tiny-reference")
