"""deploy/grafana/dspark.json against what the scheduler exports: every PromQL expression of the
dashboard parses (Debian's promtool checks it as a recording rule) and every metric it names is
one SchedulerMetrics exports; the monitoring compose profile provisions that dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from dspark.serving.local_stack import REPO_ROOT
from dspark.serving.metrics import SchedulerMetrics

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dspark.json"
METRIC_NAME = re.compile(r"dspark:[A-Za-z0-9_:]+")
SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",),
                   "histogram": ("_bucket", "_sum", "_count")}


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 12
    return exprs


def exported_names() -> set[str]:
    """Every sample name the scheduler's registry can produce (labelled families included before
    their first sample)."""
    return {family.name + suffix for family in SchedulerMetrics("tiny").registry.collect()
            for suffix in SAMPLE_SUFFIXES[family.type]}


def test_every_metric_the_dashboard_names_is_exported():
    names = exported_names()
    for expr in dashboard_expressions():
        used = set(METRIC_NAME.findall(expr))
        assert used, f"no dspark metric in {expr!r}"
        assert used <= names, f"{sorted(used - names)} are not exported (in {expr!r})"


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian: apt-get install prometheus)")
def test_every_expression_parses_with_promtool(tmp_path):
    # Grafana's variables are not PromQL: substitute what Grafana would.
    exprs = [e.replace("$__rate_interval", "1m").replace("$model", ".*")
             for e in dashboard_expressions() if not e.startswith("label_values(")]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dspark_dashboard:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_rejects_a_broken_expression(tmp_path):
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [
        {"record": "bad:expr", "expr": "sum(rate(dspark:generation_tokens_total[1m])"}]}]}))
    assert subprocess.run(["promtool", "check", "rules", str(path)],
                          capture_output=True).returncode != 0


def test_monitoring_profile_provisions_the_dashboard():
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    assert compose["prometheus"]["profiles"] == ["monitoring"]
    assert compose["grafana"]["profiles"] == ["monitoring"]
    mounts = compose["grafana"]["volumes"]
    assert "./deploy/grafana/dspark.json:/var/lib/grafana/dashboards/dspark.json:ro" in mounts
    provider = yaml.safe_load((REPO_ROOT / "deploy/grafana/provisioning/dashboards/dspark.yml")
                              .read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((REPO_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml")
                            .read_text())["datasources"][0]
    assert source["uid"] == json.loads(DASHBOARD.read_text())["panels"][0]["datasource"]["uid"]
    scrape = yaml.safe_load((REPO_ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["scheduler:8000"]


def test_monitoring_ports_listen_on_loopback_and_images_are_pullable_by_default():
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    for name, default in (("prometheus", "prom/prometheus:"), ("grafana", "grafana/grafana:")):
        assert all(str(p).startswith("127.0.0.1:") for p in compose[name]["ports"]), name
        image = compose[name]["image"]  # ${VAR:-default}: the default is a public image
        assert image.startswith("${") and f":-{default}" in image, image
