"""Shared test setup: one thread (reproducible timings on small CI machines), a hypothesis profile, the lab.

A source checkout whose lab is not installed gets it from ``lab/src`` (:mod:`lab_source`).
"""

import os

from lab_source import use_lab_sources

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
use_lab_sources()

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


def native_required() -> bool:
    """``ROPEKIT_REQUIRE_NATIVE`` set to anything but empty or 0 (CI sets it)."""
    return os.environ.get("ROPEKIT_REQUIRE_NATIVE", "") not in ("", "0")


def _xdist_controller(config) -> bool:
    """This process hands the tests to ``pytest -n N`` workers (pytest-xdist), and runs none itself."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def _warm_shared_caches() -> None:
    """Build what the workers would otherwise build at the same moment: the C++ kernel, the SmolLM2 example.

    Both are written all-or-nothing, so two workers building one at once would each succeed, but a
    worker could read the example's directory while another swaps in its own copy. A failure here
    (no network, no compiler) is left to the tests that need them, which skip or fail with the reason.
    """
    from ropekit import ops

    ops.available()  # loads (and builds once) the C++ kernel
    try:
        from ropekit_lab.smollm2_cache import smollm2_hf_dir

        smollm2_hf_dir(quiet=True)
    except Exception:  # noqa: BLE001 - the tests report it
        pass


def pytest_sessionstart(session):
    """With ``ROPEKIT_REQUIRE_NATIVE=1``, a session whose C++ CPU kernel cannot load fails at once.

    Otherwise the ~150 cases that need the kernel skip (``"cpu" not in ops.available()``) and a
    run where the extension does not build would pass: CI must see that as a failure. Under
    ``pytest -n N`` the controlling process first builds the caches the workers share.
    """
    if _xdist_controller(session.config):
        _warm_shared_caches()
    if not native_required():
        return
    from ropekit import ops
    from ropekit.ops import dispatch

    if "cpu" not in ops.available():
        reason = getattr(dispatch._builtin("cpu"), "error", None) or "no C++ backend registered"
        pytest.exit(f"ROPEKIT_REQUIRE_NATIVE is set but ropekit's C++ CPU kernel is unavailable: {reason}",
                    returncode=3)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Tests that draw from torch's global generator see the same numbers on every run."""
    torch.manual_seed(0)
    yield
