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


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tests run torch on one thread: the tiny models gain nothing from two, and on a shared
    machine two OpenMP threads per process can spin against each other and run many times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
