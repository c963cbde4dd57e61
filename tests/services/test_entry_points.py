"""Entry points: every service command answers --help, the compose file's commands and env vars
are real flags of real entry points (and `docker-compose config -q` accepts the file when
docker-compose is installed), and `dspark up` brings the stack up and down cleanly."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shutil
import signal
import subprocess
import sys

import openai
import pytest
import yaml

from dspark.serving.config import DrafterServiceConfig, SchedulerConfig, VerifierServiceConfig
from dspark.serving.local_stack import REPO_ROOT, ServiceProcess, free_port, wait_http

SERVICE_MODULES = {"services.verifier": "services.verifier.main",
                   "services.drafter": "services.drafter.main",
                   "services.scheduler": "services.scheduler.main"}
ENV_CONFIGS = {"DSPARK_VERIFIER_": VerifierServiceConfig, "DSPARK_DRAFTER_": DrafterServiceConfig,
               "DSPARK_SCHEDULER_": SchedulerConfig}


def run_help(*args: str) -> str:
    done = subprocess.run([sys.executable, *args, "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("module", sorted(SERVICE_MODULES))
def test_service_modules_answer_help(module):
    out = run_help("-m", module)
    assert "--port" in out or "--http-port" in out
    assert "--trace-exporter" in out and "DSPARK_" in out


@pytest.mark.parametrize("command", [["serve", "drafter"], ["serve", "verifier"],
                                     ["serve", "scheduler"], ["up"]])
def test_dspark_commands_answer_help(command):
    assert "usage: dspark" in run_help("-m", "dspark.cli", *command)


def compose_services() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]


def test_compose_commands_are_real_entry_points_with_real_flags():
    checked = 0
    for name, service in compose_services().items():
        command = service.get("command", [])
        if command[:2] == ["python", "-m"] and command[2] in SERVICE_MODULES:
            parser = argparse.ArgumentParser()
            importlib.import_module(SERVICE_MODULES[command[2]]).configure(parser)
            parser.parse_args(command[3:])  # exits (fails the test) on an unknown flag
            checked += 1
        elif command[:1] == ["dspark"]:
            run_help("-m", "dspark.cli", *command[1:])
            checked += 1
        for key in (service.get("environment") or {}):
            for prefix, config in ENV_CONFIGS.items():
                if key.startswith(prefix):
                    field = key[len(prefix):].lower()
                    assert field in {f.name for f in dataclasses.fields(config)}, (name, key)
        health = (service.get("healthcheck") or {}).get("test", [])
        if "dspark.serving.healthcheck" in health:
            importlib.import_module("dspark.serving.healthcheck")
    assert checked == 4  # fetch-model, verifier, drafter, scheduler


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.parametrize("files", [["docker-compose.yml"],
                                   ["docker-compose.yml", "deploy/docker-compose.gpu.yml"]])
def test_docker_compose_config_is_valid(files):
    args = [a for f in files for a in ("-f", f)]
    done = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "TORCH_INDEX_URL": "http://unused"})
    assert done.returncode == 0, done.stderr


def test_dspark_up_serves_and_stops_cleanly(tiny_models, tmp_path):
    ports = {name: free_port() for name in ("port", "grpc", "verifier", "drafter")}
    up = ServiceProcess("dspark_up", [
        "dspark.cli", "up", "--model-dir", str(tiny_models.target_dir),
        "--drafter-dir", str(tiny_models.drafter_dir), "--cost-table", str(tiny_models.cost_table),
        "--model-name", "tiny", "--port", str(ports["port"]), "--grpc-port", str(ports["grpc"]),
        "--verifier-port", str(ports["verifier"]), "--drafter-port", str(ports["drafter"]),
        "--log-dir", str(tmp_path / "logs")], log_dir=tmp_path).start()
    try:
        wait_http(up, ports["port"])
        out = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['port']}/v1", api_key="none",
                            max_retries=0).completions.create(model="tiny", prompt="t5 t6",
                                                              max_tokens=6, temperature=0)
        assert len(out.model_extra["dspark"]["token_ids"]) == 6
    finally:
        code = up.stop(signal.SIGINT, timeout=60)
    assert code == 0, up.log_text()
    log = up.log_text()
    assert "dspark up: ready" in log and "dspark up: stopped" in log
    for name in ("verifier", "drafter", "scheduler"):  # each one drained and exited itself
        assert '"msg": "stopped"' in (tmp_path / "logs" / f"{name}.log").read_text(), name
