"""The session's Ray cluster for the Ray Serve tests (tests/deploy/ray_support.py); Ray starts
only when a test asks for it."""

from tests.deploy.ray_support import ray_cluster  # noqa: F401 (a fixture)
