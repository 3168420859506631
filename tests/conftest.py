"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import FAMILIES, build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {fam: build_model(fam, str(root / fam)) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]
