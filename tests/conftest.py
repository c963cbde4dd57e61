"""Shared fixtures: the demo target (prepared once per machine) and the eval prompt files."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder (`dspark fetch-model`; cached across runs)."""
    from dspark.fetch import ensure_model

    return ensure_model()


@pytest.fixture(scope="session")
def eval_dir() -> Path:
    """../shared/data/eval beside the repository (CI clones the repo with shared/ next to it)."""
    path = (REPO_ROOT / ".." / "shared" / "data" / "eval").resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"eval prompts not found at {path}")
    return path
