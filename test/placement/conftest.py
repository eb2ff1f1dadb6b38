"""Shared fixtures: the real OLMoE / Mixtral router counts shipped with the package."""

from __future__ import annotations

import numpy as np
import pytest

from omniinfer.placement.loads import read_domain_counts


@pytest.fixture(scope="session")
def olmoe() -> dict[str, np.ndarray]:
    return read_domain_counts(model="olmoe")


@pytest.fixture(scope="session")
def mixtral() -> dict[str, np.ndarray]:
    return read_domain_counts(model="mistral")
