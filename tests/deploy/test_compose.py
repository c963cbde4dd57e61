"""`docker compose up` for real: deploy/compose_check.sh builds the images, starts the stack in
containers and checks it (exact outputs over REST and gRPC against the embedded engine, the
drafter killed mid-stream, the scheduler restarted with stored requests, down and up again; see
deploy/compose_check.py). It runs wherever a Docker daemon answers and docker-compose is
installed, with debootstrap or ready base images (`.ci/run` installs Debian's docker.io,
docker-compose and debootstrap and starts dockerd); 7.5 minutes cold on a 2-core EPYC, base
images and wheelhouse included. Skipped with the reason otherwise, or when DSPARK_TEST_COMPOSE=0.

Also: the compose files are valid for docker-compose, keys are on by default, every internal
service gets the internal token file, and nothing runs as root (static checks, no daemon needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from dspark.serving.local_stack import REPO_ROOT

CHECK_TIMEOUT_SECONDS = 2700  # a cold run also makes the base images, builds and prepares the model


def docker_daemon_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def compose_services() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]


def merged_services(override: str) -> dict:
    """The services of docker-compose.yml with `override` layered over it, as docker-compose
    merges them (`docker-compose config`)."""
    done = subprocess.run(["docker-compose", "-f", "docker-compose.yml", "-f", override, "config"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "TORCH_INDEX_URL": "https://example.org"})
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)["services"]


def test_keys_on_and_nothing_as_root_by_default():
    services = compose_services()
    assert "DSPARK_API_KEYS" in services["secrets"]["environment"]
    assert "secrets" in services["scheduler"]["depends_on"] or \
        "secrets" in services["fetch-model"]["depends_on"]
    assert any("dspark-secrets" in v for v in services["scheduler"]["volumes"])
    assert "DSPARK_SCHEDULER_API_KEYS" not in services["scheduler"]["environment"]
    redis_command = " ".join(services["redis"]["command"])
    assert "redis.conf" in redis_command and "--maxmemory" in redis_command
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and users[-1] != "root" and users[-1] != "0"
    redis_dockerfile = (REPO_ROOT / "deploy" / "redis" / "Dockerfile").read_text().splitlines()
    assert [line for line in redis_dockerfile if line.startswith("USER ")][-1] == "USER 10001:10001"


INTERNAL_SERVICES = ("verifier", "drafter", "scheduler")
TOKEN_FILE = "/run/dspark-secrets/internal_token"  # deploy/init_secrets.py writes it


def assert_internal_token_file_everywhere(services: dict) -> None:
    """Every internal service reads the token file from the secrets volume, mounted read-only."""
    for name in INTERNAL_SERVICES:
        environment = services[name]["environment"]
        assert environment[f"DSPARK_{name.upper()}_INTERNAL_TOKEN_FILE"] == TOKEN_FILE, name
        assert not any("INTERNAL_TOKEN=" in str(v) for v in environment), name
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in
                  services[name]["volumes"]]
        assert any(m.startswith("dspark-secrets:/run/dspark-secrets:ro") for m in mounts), name
    assert any(v.startswith("dspark-secrets:/run/dspark-secrets") and not v.endswith(":ro")
               for v in services["secrets"]["volumes"])  # where the token is written


def test_internal_services_get_the_internal_token_file():
    assert_internal_token_file_everywhere(compose_services())


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_hostnet_override_is_valid_and_keeps_to_loopback():
    services = merged_services("deploy/docker-compose.hostnet.yml")
    assert all(s.get("network_mode") == "host" for s in services.values())
    assert services["scheduler"]["environment"]["DSPARK_SCHEDULER_HOST"] == "127.0.0.1"
    assert "127.0.0.1" in services["redis"]["command"]
    assert_internal_token_file_everywhere(services)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_gpu_override_keeps_the_internal_token():
    services = merged_services("deploy/docker-compose.gpu.yml")
    assert services["verifier"]["environment"]["DSPARK_VERIFIER_DEVICE"] == "cuda"
    assert_internal_token_file_everywhere(services)


def base_images_can_be_had() -> bool:
    """deploy/compose_check.sh makes the base images with debootstrap (as root) unless
    DSPARK_BASE_IMAGE names ready ones."""
    return bool(os.environ.get("DSPARK_BASE_IMAGE")) or (
        shutil.which("debootstrap") is not None and os.geteuid() == 0)


@pytest.mark.skipif(os.environ.get("DSPARK_TEST_COMPOSE") == "0",
                    reason="DSPARK_TEST_COMPOSE=0 skips the stack in containers")
@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.skipif(not base_images_can_be_had(),
                    reason="no debootstrap run as root, and DSPARK_BASE_IMAGE not set")
@pytest.mark.skipif(not docker_daemon_answers(), reason="no Docker daemon answers `docker info` "
                    "(.ci/run starts dockerd where it is installed)")
def test_compose_stack_in_containers(tmp_path):
    report_path = tmp_path / "compose_check.json"
    done = subprocess.run(["bash", "deploy/compose_check.sh", "--report", str(report_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=CHECK_TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["compared_cases"] == 3
    assert report["seeded_repeats"] == 4 and report["seeded_tokens"] > 0
    assert report["drafter_killed_after_tokens"] < report["drafter_killed_stream_tokens"]
    print(json.dumps(report, indent=2))
