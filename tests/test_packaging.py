"""The package a user installs: the wheel built from this tree declares what the code imports,
offers the extras the README names, installs the `dspark` command, and carries the files the code
reads at run time (the kernel's C++ source, the shipped drafter and its calibration).

The wheel is built from a copy of the tree's files (tracked and untracked, not ignored) so that a
stale `build/` folder in the checkout cannot leak into it.
"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dspark.paths import REPO_ROOT

FIRST_PARTY = {"dspark", "services", "loadtest", "tests", "bench", "deploy", "scripts"}
EXTRAS = {"serve", "train", "loadtest", "ray", "dev"}
CORE = {"torch", "numpy", "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "jinja2"}
SERVE = {"grpcio", "grpcio-health-checking", "protobuf", "fastapi", "uvicorn", "redis",
         "prometheus-client", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc",
         "xgrammar"}
SHIPPED_FILES = ["dspark/models/csrc/paged_attention.cpp",
                 "dspark/models/csrc/rms_norm.cpp",
                 "checkpoints/dspark-markov/config.json",
                 "checkpoints/dspark-markov/model.safetensors",
                 "checkpoints/dspark-markov/calibration.json",
                 "dspark/v1/generation_pb2_grpc.py",
                 "services/scheduler/rest_api.py",
                 "loadtest/locustfile.py"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """The distribution a requirement line names: 'uvicorn[standard]>=0.30 ; extra == "serve"'
    -> 'uvicorn'."""
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1))


def requirement_extra(spec: str) -> str | None:
    found = re.search(r"""extra\s*==\s*["']([^"']+)["']""", spec)
    return found.group(1) if found else None


def source_files() -> list[Path]:
    """The tree as git sees it: tracked files and untracked ones that are not ignored."""
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO_ROOT, check=True, capture_output=True).stdout
    return [Path(p) for p in out.decode().split("\0") if p]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel, built without build isolation from a copy of the packaged folders."""
    src = tmp_path_factory.mktemp("src")
    wanted = ("dspark/", "services/", "loadtest/", "checkpoints/dspark-markov/")
    for rel in source_files():
        path = REPO_ROOT / rel
        if (str(rel) in ("pyproject.toml", "README.md") or str(rel).startswith(wanted)) and path.is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(src)], check=True)
    [built] = out.glob("dspark_serve-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def test_requirement_parsing():
    assert requirement_name('uvicorn[standard]>=0.30; extra == "serve"') == "uvicorn"
    assert requirement_name("prometheus_client>=0.20") == "prometheus-client"
    assert requirement_extra('redis>=5; extra == "serve"') == "serve"
    assert requirement_extra("torch>=2.4") is None


def test_core_dependencies_and_extras(wheel):
    meta = metadata(wheel)
    requires = meta.get_all("Requires-Dist")
    core = {requirement_name(r) for r in requires if requirement_extra(r) is None}
    assert CORE <= core, CORE - core
    assert not core & SERVE, "the embedded engine needs no service packages"
    assert set(meta.get_all("Provides-Extra")) == EXTRAS
    serve = {requirement_name(r) for r in requires if requirement_extra(r) == "serve"}
    assert SERVE <= serve, SERVE - serve
    test_tools = {requirement_name(r) for r in requires if requirement_extra(r) == "dev"}
    assert {"pytest", "scipy", "dspark-serve"} <= test_tools
    assert not {"pytest", "locust", "matplotlib"} & (core | serve)
    torch = [r for r in requires if requirement_name(r) == "torch"]
    assert torch and "==" not in torch[0], "torch is a range, so that a CUDA build satisfies it"


def test_dspark_command(wheel):
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    scripts = wheel.read(name).decode()
    assert re.search(r"^\[console_scripts\]\s*\ndspark = dspark\.cli:main$", scripts, re.M), scripts


def test_files_the_code_reads_at_run_time_are_in_the_wheel(wheel):
    names = set(wheel.namelist())
    missing = [f for f in SHIPPED_FILES if f not in names]
    assert not missing, missing
    assert not [n for n in names if n.startswith(("tests/", "bench/", "data/"))]
    # only the default drafter ships: the baselines stay in the repository
    assert not [n for n in names if n.startswith(("checkpoints/dflash", "checkpoints/eagle"))]


def imported_modules(folder: Path) -> dict[str, str]:
    """Top-level module -> a file that imports it, over every import statement under `folder`
    (lazy ones inside functions too)."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(REPO_ROOT)))
    return found


def module_level_imports(folder: Path) -> dict[str, str]:
    """Like `imported_modules`, but only the imports a module runs when it is imported (at its top
    level, also under `if` / `try`), not those inside functions."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        todo = list(ast.parse(path.read_text(), str(path)).body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.If, ast.Try)):
                todo.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                            + [s for h in getattr(node, "handlers", []) for s in h.body])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name.split(".")[0], str(path.relative_to(REPO_ROOT)))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.setdefault(node.module.split(".")[0], str(path.relative_to(REPO_ROOT)))
    return found


def test_serve_extra_covers_what_the_package_imports(wheel):
    """`pip install .[serve]` is enough for `dspark up` and every module of dspark/ and services/
    to import: their module-level third-party imports come from the core dependencies or the
    serve extra (the train and loadtest extras only feed imports inside functions, such as the
    plots' matplotlib)."""
    requires = metadata(wheel).get_all("Requires-Dist")
    allowed = {requirement_name(r) for r in requires if requirement_extra(r) in (None, "serve")}
    owners = importlib.metadata.packages_distributions()
    outside = []
    for folder in ("dspark", "services"):
        for module, where in module_level_imports(REPO_ROOT / folder).items():
            if module in sys.stdlib_module_names or module in FIRST_PARTY or module == "__future__":
                continue
            dists = {canonical(d) for d in owners.get(module, [module])}
            if not dists & allowed:
                outside.append(f"{module} ({where}; from {sorted(dists)})")
    assert not outside, outside


def test_every_third_party_import_is_declared(wheel):
    """Each third-party module the package's code imports comes from a distribution that the
    wheel requires (in its core or one of its extras), so that an import added without its
    dependency fails here rather than in a user's fresh install."""
    declared = {requirement_name(r) for r in metadata(wheel).get_all("Requires-Dist")}
    owners = importlib.metadata.packages_distributions()
    undeclared = []
    for folder in ("dspark", "services", "loadtest"):
        for module, where in imported_modules(REPO_ROOT / folder).items():
            if module in sys.stdlib_module_names or module in FIRST_PARTY or module == "__future__":
                continue
            dists = {canonical(d) for d in owners.get(module, [module])}
            if not dists & declared:
                undeclared.append(f"{module} ({where}; from {sorted(dists)})")
    assert not undeclared, undeclared


def test_constraints_pin_every_declared_dependency(wheel):
    """CI installs with -c constraints.txt: every distribution the wheel names has an exact pin."""
    pinned = {canonical(line.split("==")[0].split("[")[0]) for line in
              (REPO_ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.lstrip().startswith("#")}
    declared = {requirement_name(r) for r in metadata(wheel).get_all("Requires-Dist")} - {"dspark-serve"}
    assert not declared - pinned, declared - pinned


def test_setup_installs_the_package_with_every_extra():
    lines = [ln.strip() for ln in (REPO_ROOT / "requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    [editable] = [ln for ln in lines if ln.startswith("-e .")]
    assert set(re.search(r"\[(.*)\]", editable).group(1).split(",")) == EXTRAS
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    assert "-c constraints.txt -r requirements.txt" in setup
