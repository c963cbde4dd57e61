"""RunnerConfig.weights resolution: q4 only where the folder has its GGUF (and a CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from dspark.models.runner import RunnerConfig, TargetRunner, choose_weights


def test_folder_without_gguf_is_dense(tiny_target):
    folder, _ = tiny_target
    assert TargetRunner(folder, RunnerConfig(kv_cache_tokens=64)).weights == "dense"
    assert choose_weights(RunnerConfig(), folder, torch.device("cpu"), torch.float32) == "dense"


def test_q4_asked_where_it_does_not_apply_raises(tiny_target):
    folder, _ = tiny_target
    with pytest.raises(ValueError, match="no GGUF"):
        TargetRunner(folder, RunnerConfig(weights="q4", kv_cache_tokens=64))
    with pytest.raises(ValueError, match="float32 only"):
        choose_weights(RunnerConfig(weights="q4"), folder, torch.device("cpu"), torch.bfloat16)


def test_unknown_mode_rejected():
    with pytest.raises(ValueError, match="weights must be one of"):
        RunnerConfig(weights="int4")
