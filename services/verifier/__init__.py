"""The verifier service: `python -m services.verifier` (or `dspark serve verifier`)."""
