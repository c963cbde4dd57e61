"""deploy/kuberay/rayservice.yaml, without a cluster: the RayService has the structure KubeRay's
ray.io/v1 CRD requires (spec.rayClusterConfig with a head group and named worker groups, pod
templates with named containers and images, rayStartParams as strings), its serveConfigV2 passes
Ray Serve's own schema (ServeDeploySchema) and names builders that exist in deploy/ray_serve.py
with arguments it accepts; each worker pod has the GPU its cells reserve, every secret it reads
comes from the one secret the README creates, and the Redis service the cells reach is in the
manifest. deploy/ray-cluster.yaml (VMs) is checked the same way against Ray's cluster-config
schema."""

from __future__ import annotations

import re
import runpy

import pytest
import yaml

from dspark.paths import REPO_ROOT

MANIFEST = REPO_ROOT / "deploy" / "kuberay" / "rayservice.yaml"
README = REPO_ROOT / "deploy" / "README.md"


@pytest.fixture(scope="module")
def documents() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


@pytest.fixture(scope="module")
def ray_serve() -> dict:
    return runpy.run_path(str(REPO_ROOT / "deploy" / "ray_serve.py"), run_name="dspark_ray_serve")


def pod_containers(template: dict) -> list[dict]:
    containers = template["spec"]["containers"]
    assert containers, "a pod template needs containers"
    for c in containers:
        assert isinstance(c["name"], str) and c["name"] and isinstance(c["image"], str)
    return containers


def test_rayservice_has_the_crd_structure(documents):
    service = documents["RayService/dspark"]
    assert service["apiVersion"] == "ray.io/v1"
    spec = service["spec"]
    assert set(spec) <= {"serveConfigV2", "rayClusterConfig", "upgradeStrategy",
                         "serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold",
                         "excludeHeadPodFromServeSvc", "serveService"}
    assert isinstance(spec["serveConfigV2"], str)  # a YAML string, not a mapping
    cluster = spec["rayClusterConfig"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", cluster["rayVersion"])
    head = cluster["headGroupSpec"]
    for params in [head["rayStartParams"]] + [g["rayStartParams"]
                                               for g in cluster["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in params.values()), params  # map[string]string
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    head_container, = pod_containers(head["template"])
    assert {p["name"]: p["containerPort"] for p in head_container["ports"]} == {
        "gcs": 6379, "dashboard": 8265, "serve": 8000}
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        assert isinstance(group["groupName"], str) and group["groupName"]
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        pod_containers(group["template"])


def test_cells_fit_the_gpu_workers(documents, ray_serve):
    """Every cell the serve config names fits the worker pods' GPUs and dspark_cell slots."""
    import json

    service = documents["RayService/dspark"]
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    cells = [a for a in serve_config["applications"]
             if a["import_path"] == "deploy.ray_serve:cell_app"]
    group, = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    container, = group["template"]["spec"]["containers"]
    gpus = int(group["rayStartParams"]["num-gpus"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus) \
        == container["resources"]["requests"]["nvidia.com/gpu"]
    slots = json.loads(json.loads(group["rayStartParams"]["resources"]))[
        ray_serve["CELL_RESOURCE"]]
    assert len(cells) <= slots * group["replicas"]
    per_cell = [a["args"]["verifier_gpus"] + a["args"]["drafter_gpus"] for a in cells]
    assert all(g > 0 for g in per_cell) and slots * max(per_cell) <= gpus
    assert "num-gpus" not in service["spec"]["rayClusterConfig"]["headGroupSpec"][
        "rayStartParams"] or service["spec"]["rayClusterConfig"]["headGroupSpec"][
        "rayStartParams"]["num-gpus"] == "0"  # the head hosts no cell


def test_serve_config_passes_ray_serves_schema_and_names_real_builders(documents, ray_serve):
    from ray.serve.schema import ServeDeploySchema

    text = documents["RayService/dspark"]["spec"]["serveConfigV2"]
    schema = ServeDeploySchema.parse_obj(yaml.safe_load(text))
    apps = {a.name: a for a in schema.applications}
    cells = sorted(n for n in apps if n != "dspark")
    assert cells == [f"dspark-cell{i}" for i in range(len(cells))] and len(cells) >= 2
    router = apps["dspark"]
    assert router.import_path == "deploy.ray_serve:router_app" and router.route_prefix == "/"
    assert router.args == {"cells": len(cells)}
    for i, name in enumerate(cells):
        app = apps[name]
        assert app.route_prefix is None  # only the router takes HTTP
        assert app.import_path == "deploy.ray_serve:cell_app" and app.args["cell"] == i
        # The arguments are RayServeConfig flags the builder parses.
        args = {k: v for k, v in app.args.items() if k != "cell"}
        config = ray_serve["config_from_serve_args"](args)
        assert config.dtype == "bfloat16" and config.verifier_gpus > 0
    for builder in ("cell_app", "router_app"):
        assert callable(ray_serve[builder])


def test_secrets_and_redis_are_wired(documents):
    readme = README.read_text()
    created = re.search(r"kubectl create secret generic dspark-secrets(.*?)\n\n", readme, re.S)
    assert created, "deploy/README.md creates the secret"
    keys = set(re.findall(r"--from-literal=([a-z-]+)=", created.group(1)))
    used = set()

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("secretKeyRef")
            if ref:
                assert ref["name"] == "dspark-secrets"
                used.add(ref["key"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(list(documents.values()))
    assert used == keys == {"api-keys", "redis-password", "ray-auth-token"}
    cluster = documents["RayService/dspark"]["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"]
                                                     for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert {"RAY_AUTH_TOKEN", "DSPARK_RAY_API_KEYS", "DSPARK_RAY_REDIS_URL"} <= set(env)
        url = env["DSPARK_RAY_REDIS_URL"]["value"]
        host = re.match(r"redis://:\$\(REDIS_PASSWORD\)@([a-z-]+):(\d+)/\d+$", url)
        assert host and list(env).index("REDIS_PASSWORD") < list(env).index(
            "DSPARK_RAY_REDIS_URL")  # $(VAR) expands only variables defined before it
        redis_service = documents[f"Service/{host.group(1)}"]
        assert int(host.group(2)) in {p["port"] for p in redis_service["spec"]["ports"]}
        deployment = documents[f"Deployment/{host.group(1)}"]
        assert redis_service["spec"]["selector"].items() <= \
            deployment["spec"]["template"]["metadata"]["labels"].items()


def test_vm_cluster_yaml_passes_rays_schema():
    """What `ray up` does with it first: fill Ray's defaults, then check Ray's JSON schema."""
    import json

    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((REPO_ROOT / "deploy" / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "local" and config["provider"]["worker_ips"]
    head = " ".join(config["head_start_ray_commands"])
    assert "--head" in head and "RAY_gcs_server_port_wait_time_s=" in head
    worker = " ".join(config["worker_start_ray_commands"])
    assert "--num-gpus=1" in worker
    slots = json.loads(re.search(r"--resources='([^']+)'", worker).group(1))
    assert slots["dspark_cell"] >= 1


def test_the_image_the_pods_run_is_built_with_ray_serve_and_the_builders(documents):
    """Every Ray pod runs the image deploy/kuberay/Dockerfile tags, which copies the module the
    serve config imports (and its build context lets it)."""
    dockerfile = (REPO_ROOT / "deploy" / "kuberay" / "Dockerfile").read_text()
    ignore = (REPO_ROOT / "deploy" / "kuberay" / "Dockerfile.dockerignore").read_text().split()
    tag = re.search(r"docker build -f deploy/kuberay/Dockerfile -t (\S+) \.", dockerfile).group(1)
    cluster = documents["RayService/dspark"]["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"]
                                                     for g in cluster["workerGroupSpecs"]]
    assert {c["image"] for p in pods for c in p["spec"]["containers"]} == {f"{tag}:latest"}
    assert "COPY deploy/ray_serve.py /app/deploy/ray_serve.py" in dockerfile
    assert "ENV PYTHONPATH=/app" in dockerfile and '"ray[serve]"' in dockerfile
    assert "!deploy/ray_serve.py" in ignore and "!constraints.txt" in ignore
