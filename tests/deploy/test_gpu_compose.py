"""The GPU override gives the verifier and the drafter one GPU each (two by default, one shared
when DSPARK_DRAFTER_GPU names the verifier's), never every GPU to both (a static check: no GPU
and no docker here)."""

from __future__ import annotations

import re

import yaml

from dspark.serving.local_stack import REPO_ROOT


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and "count" not in devices[0], devices
    return devices[0]["device_ids"]


def default_of(value: str) -> str:
    match = re.fullmatch(r"\$\{(\w+):-(\w+)\}", value)
    assert match, value
    return match.group(2)


def test_verifier_and_drafter_get_one_gpu_each():
    services = yaml.safe_load((REPO_ROOT / "deploy" / "docker-compose.gpu.yml").read_text())["services"]
    verifier, drafter = gpu_ids(services["verifier"]), gpu_ids(services["drafter"])
    assert len(verifier) == len(drafter) == 1
    assert "DSPARK_VERIFIER_GPU" in verifier[0] and "DSPARK_DRAFTER_GPU" in drafter[0]
    assert default_of(verifier[0]) != default_of(drafter[0])
    assert services["verifier"]["environment"]["DSPARK_VERIFIER_DEVICE"] == "cuda"
    assert services["drafter"]["environment"]["DSPARK_DRAFTER_DEVICE"] == "cuda"
