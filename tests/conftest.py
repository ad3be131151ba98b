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
