"""deploy/ray_serve.py's `--drafter-dir`, without a cluster: `none` gives every cell a verifier
that returns no features and no drafter; a folder, or empty (each service's shipped default),
keeps the drafter."""

from __future__ import annotations

import runpy

import pytest

from dspark.paths import REPO_ROOT


@pytest.fixture(scope="module")
def ray_serve_config():
    return runpy.run_path(str(REPO_ROOT / "deploy" / "ray_serve.py"),
                          run_name="dspark_ray_serve")["RayServeConfig"]


@pytest.mark.parametrize("drafter_dir, with_drafter", [("none", False), ("", True),
                                                       ("ckpt/dspark", True)])
def test_cells_follow_the_drafter_choice(ray_serve_config, drafter_dir, with_drafter):
    config = ray_serve_config(drafter_dir=drafter_dir)
    assert config.with_drafter is with_drafter
    verifier, drafter, _ = config.cell_configs()
    served = drafter_dir if with_drafter else ""
    assert verifier.drafter_dir == served and drafter.drafter_dir == served
    assert verifier.hidden_layer_ids == ("" if with_drafter else "none")
