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

#: Seconds of work per test file: each file's test durations summed, from the junit report of a
#: whole-suite run on two workers (2026-12-04, the dev venv on this 2-core machine: 1599 s of
#: test time in 13 min 48 s of wall time; ratios, not CI seconds; `.ci/file_seconds.py` makes
#: the table). Two uses:
#:
#: * order: files are collected heaviest first (and ``--no-loadscope-reorder`` keeps that order),
#:   so that ``--dist loadfile`` hands the long files out first and the two workers finish
#:   together; a file not listed (a new one) counts as 0 s and comes after the listed ones. The
#:   order within a file is unchanged.
#: * the ``slow`` marker: every test of a file in `SLOW_FILES`, the heaviest files that together
#:   take `SLOW_SHARE` of the time. ``pytest -m "not slow"`` is the quick inner loop (a few
#:   minutes); plain ``pytest`` (the README's command, CI) runs everything.
FILE_SECONDS: dict[str, float] = {
    "test_term_properties.py": 147,
    "test_fused_head.py": 123,
    "test_fireworks_main_job.py": 104,
    "test_main_job.py": 98,
    "test_distill.py": 70,
    "test_tinker_main_job.py": 61,
    "test_policy_family.py": 60,
    "test_hf_decoder_vjp.py": 57,
    "test_benchmarks.py": 57,
    "test_local_trainer.py": 57,
    "test_async_rl.py": 55,
    "test_runner_paths.py": 50,
    "test_fireworks.py": 44,
    "test_hf_trainer.py": 40,
    "test_hf_parity.py": 34,
    "test_client_loss.py": 34,
    "test_preference.py": 34,
    "test_batch.py": 32,
    "test_tinker_lora_job.py": 30,
    "test_hosted_tasks.py": 28,
    "test_data.py": 27,
    "test_serve_hf.py": 25,
    "test_tasks.py": 23,
    "test_hf_logprobs.py": 23,
    "test_tinker.py": 22,
    "test_tinker_custom_loss.py": 22,
    "test_critic.py": 19,
    "test_correction.py": 18,
    "test_kernels.py": 18,
    "test_serve.py": 15,
    "test_twin.py": 15,
    "test_advantages.py": 14,
    "test_kl_variants.py": 14,
    "test_echo_env.py": 11,
    "test_hf_lora.py": 11,
    "test_disk_full.py": 10,
    "test_tracking.py": 10,
    "test_echo_study.py": 9,
    "test_gc.py": 9,
    "test_local_checkpoint.py": 8,
    "test_fold.py": 7,
    "test_padding.py": 6,
    "test_serve_fireworks.py": 5,
    "test_fireworks_checkpoints.py": 5,
    "test_tokenizers.py": 5,
    "test_serve_custom_loss.py": 4,
    "test_examples.py": 4,
    "test_calc_env.py": 4,
    "test_api.py": 3,
    "test_docs_examples.py": 3,
    "test_semantics.py": 3,
    "test_fireworks_torch.py": 2,
    "test_per_datum.py": 2,
    "test_grpo.py": 2,
    "test_report.py": 1,
    "test_split.py": 1,
    "test_protocols.py": 0,
    "test_seeds.py": 0,
    "test_hf_loading.py": 0,
    "test_plot.py": 0,
    "test_sft_translation.py": 0,
    "test_catalogue.py": 0,
    "test_atomic.py": 0,
    "test_progress.py": 0,
}
#: The share of `FILE_SECONDS` that the ``slow`` files take together.
SLOW_SHARE = 0.88


def _slow_files() -> frozenset[str]:
    total, acc, slow = sum(FILE_SECONDS.values()), 0.0, set()
    for name, seconds in sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        if acc >= SLOW_SHARE * total:
            break
        slow.add(name)
        acc += seconds
    return frozenset(slow)


SLOW_FILES = _slow_files()


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0.0))  # a stable sort


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
