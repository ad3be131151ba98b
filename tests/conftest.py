"""Test configuration: float64 JAX, strict rank promotion, hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE``): ``default`` (CI, ~25 examples per property), ``thorough``
(200 examples) and ``quick`` (8). Every profile disables the deadline: the first example of a
new shape pays a jit compilation.
"""

import os

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False)
settings.register_profile("default", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=200, **_common)
settings.register_profile("quick", max_examples=8, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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
