"""Shared test setup: one thread (reproducible timings on small CI machines) and a hypothesis profile."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(1)

settings.register_profile(
    "ropekit",
    deadline=None,
    max_examples=25,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# HYPOTHESIS_PROFILE=thorough for a long randomized bug hunt (not for CI)
settings.register_profile("thorough", parent=settings.get_profile("ropekit"), max_examples=1000, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ropekit"))


@pytest.fixture(autouse=True)
def _seed_torch():
    """Tests that draw from torch's global generator see the same numbers on every run."""
    torch.manual_seed(0)
    yield
