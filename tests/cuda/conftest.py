"""The CUDA test runtimes, shared by the cuda level's tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from profinfer.levels.cuda import workload


@pytest.fixture(scope="session")
def libcuda() -> Path:
    return workload.ensure_libcuda()


@pytest.fixture(scope="session")
def cudart12() -> Path:
    return workload.ensure_cudart12()
