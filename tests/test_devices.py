"""The one device resolver every command uses, and the device kind in the cost table's name."""

from __future__ import annotations

import argparse

import pytest
import torch

from dspark.cost_table import cost_table_name, default_cost_table_path
from dspark.devices import add_device_argument, default_kv_cache_tokens, device_kind, resolve_device


def test_auto_is_cuda_only_where_cuda_is():
    assert resolve_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu" and resolve_device("CPU") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_cuda_fails_at_once_with_a_message(spec):
    with pytest.raises(ValueError, match="no CUDA device.*docs/gpu.md"):
        resolve_device(spec)


def test_an_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="auto .* cpu, cuda or cuda:N"):
        resolve_device("tpu7")


def test_every_command_flag_defaults_to_auto():
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    assert parser.parse_args([]).device == "auto"
    assert parser.parse_args(["--device", "cuda:1"]).device == "cuda:1"


def test_a_cpu_table_is_never_read_for_another_device_dtype_or_model(tmp_path):
    cpu = default_cost_table_path(tmp_path, "smollm2", "float32", "cpu")
    assert cpu.name == "cost_table_smollm2_float32_cpu.json"
    names = {cpu.name, cost_table_name("smollm2", "bfloat16", "cpu"),
             cost_table_name("smollm2", "float32", "cuda-nvidia-h100-80gb-hbm3"),
             cost_table_name("other", "float32", "cpu")}
    assert len(names) == 4
    assert device_kind("cpu") == "cpu"


def test_the_cpu_keeps_its_kv_cache_default():
    assert default_kv_cache_tokens("cpu", num_layers=30, num_kv_heads=3, head_dim=64,
                                   dtype=torch.float32, cpu_tokens=16384) == 16384
