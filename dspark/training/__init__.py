"""Drafter training: losses (DESIGN.md section 4) and the online-teacher training loop."""
