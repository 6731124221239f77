"""Shared fixtures and Hypothesis profiles.

Profiles: ``dev`` (the default here: 25 examples, no deadline because a kernel's first call
compiles) and Hypothesis' own ``ci`` (100 derandomised examples, no deadline), which Hypothesis
loads by itself when the ``CI`` environment variable is set. ``HYPOTHESIS_PROFILE=name``
overrides both.
"""
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis._settings import is_in_ci

settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("boundscheck", max_examples=10, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])  # test_boundscheck.py
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if is_in_ci() else "dev"))


@pytest.fixture(scope="session")
def torch():
    """PyTorch, the second oracle; tests that take this fixture skip when it is absent."""
    torch = pytest.importorskip("torch")
    torch.set_default_dtype(torch.float64)
    return torch
