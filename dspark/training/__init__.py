"""Drafter training: losses (docs/design.md section 4) and the online-teacher training loop."""
