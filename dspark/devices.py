"""Which torch device a command runs its models on, and what that device's defaults are.

Every command that runs a model takes `--device auto|cpu|cuda|cuda:N` (`add_device_argument`)
and resolves it here (`resolve_device`), once: `auto` is the first CUDA device when
`torch.cuda.is_available()`, else the CPU. Asking for CUDA where there is none fails at once
with a message instead of at the first tensor.

KV cache size by device (`default_kv_cache_tokens`, `kv_cache_tokens_for`): on a CPU the
caller's own CPU default (16,384 tokens for a runner, 65,536 for the verifier service); on CUDA
the tokens that KV_CACHE_FREE_FRACTION of the device's free memory holds once the weights are
there (the checkpoint's size in the run's dtype is subtracted before they load), at
2 * layers * kv_heads * head_dim * dtype bytes per token, at most CUDA_MAX_KV_CACHE_TOKENS.
"""

from __future__ import annotations

import argparse

import torch

DEVICE_HELP = ("auto (CUDA when torch.cuda.is_available(), else cpu), cpu, cuda or cuda:N "
               "(docs/gpu.md)")

KV_CACHE_FREE_FRACTION = 0.5
"""The share of a CUDA device's free memory (after the weights) the KV cache takes by default:
the rest is for activations, logits of wide batches and the drafter when it shares the GPU."""
CUDA_MAX_KV_CACHE_TOKENS = 1 << 20


def resolve_device(device: str | torch.device = "auto") -> str:
    """`auto` -> "cuda:0" when CUDA is available, else "cpu"; "cuda" -> "cuda:0"; a device
    torch does not know, or CUDA where there is none, raises ValueError."""
    spec = str(device).strip().lower()
    if spec == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: expected {DEVICE_HELP}") from e
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch has no CUDA device "
                             f"(torch {torch.__version__}; docs/gpu.md installs the CUDA build)")
        index = parsed.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        return f"cuda:{index}"
    return str(parsed)


def add_device_argument(parser: argparse.ArgumentParser, default: str = "auto",
                        help_suffix: str = "") -> None:
    """The one `--device` flag of every command that runs a model."""
    parser.add_argument("--device", default=default,
                        help=f"torch device: {DEVICE_HELP}{help_suffix}")


def device_kind(device: str | torch.device) -> str:
    """What a cost table measured on this device is valid for: "cpu", or "cuda-<GPU name>"
    (a table from an H100 is not an A10's)."""
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(d)
        return "cuda-" + "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
    return d.type


def default_kv_cache_tokens(device: str | torch.device, *, num_layers: int, num_kv_heads: int,
                            head_dim: int, dtype: torch.dtype, cpu_tokens: int,
                            reserved_bytes: int = 0) -> int:
    """The KV cache capacity in tokens a runner on `device` gets unless told (module doc);
    `reserved_bytes`: memory still to be taken by weights that are not loaded yet."""
    d = torch.device(device)
    if d.type != "cuda":
        return cpu_tokens
    free, _ = torch.cuda.mem_get_info(d)
    per_token = 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    usable = max(0, free - reserved_bytes) * KV_CACHE_FREE_FRACTION
    return max(1024, min(CUDA_MAX_KV_CACHE_TOKENS, int(usable) // per_token))


def kv_cache_tokens_for(device: str, model_dir, dtype: torch.dtype, cpu_tokens: int) -> int:
    """default_kv_cache_tokens for the Hugging Face checkpoint in `model_dir`, before it loads."""
    import json
    from pathlib import Path

    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    bits = torch.finfo(dtype).bits
    weights = on_disk * bits // 32 if on_disk else 0  # checkpoints are float32 or narrower
    return default_kv_cache_tokens(device, num_layers=config["num_hidden_layers"],
                                   num_kv_heads=config.get("num_key_value_heads", heads),
                                   head_dim=head_dim, dtype=dtype, cpu_tokens=cpu_tokens,
                                   reserved_bytes=max(weights, on_disk // 2))
