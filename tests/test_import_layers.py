"""The package's layers: `dspark` (models, the round loop, the serving library) sits below
`services` (the processes built on it), so no module under dspark/ imports `services`.

`dspark serve` and `dspark up` start the services by module name (a string handed to importlib or
to a new process), the command line being the top of the stack; a static import is what this
test forbids.
"""

from __future__ import annotations

import ast
from pathlib import Path

from dspark.paths import REPO_ROOT

UPPER_LAYERS = ("services",)


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import statement in `source`, also those inside
    functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def upward_imports(source: str) -> list[tuple[int, str]]:
    return [(line, module) for line, module in imported_modules(source)
            if module.split(".")[0] in UPPER_LAYERS]


def test_the_scan_finds_imports_of_services_at_any_depth():
    source = ("import os\n"
              "from dspark.engine import Engine\n"
              "def f():\n"
              "    from services.scheduler.main import configure\n"
              "    import services.verifier as v\n"
              "from . import services\n"          # a relative import of a sibling, not the layer
              "import servicesx\n")
    assert upward_imports(source) == [(4, "services.scheduler.main"), (5, "services.verifier")]


def test_no_module_of_the_package_imports_services():
    files = sorted((REPO_ROOT / "dspark").rglob("*.py"))
    assert len(files) > 50  # the package is there, not an empty folder
    offending = [f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
                 for path in files
                 for line, module in upward_imports(path.read_text(encoding="utf-8"))]
    assert offending == []
