import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "nojit", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("nojit" if os.environ.get("NUMBA_DISABLE_JIT") == "1" else "ci")


@pytest.fixture
def rng():
    return np.random.default_rng(0)
