"""Evaluation of drafters against the target: acceptance figures, calibration (DESIGN.md 4, 9)."""
