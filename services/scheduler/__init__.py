"""The scheduler service (gateway): `python -m services.scheduler` (or `dspark serve scheduler`)."""
