"""The drafter service: `python -m services.drafter` (or `dspark serve drafter`)."""
