"""Evaluation of drafters against the target: acceptance figures, calibration (docs/design.md 4, 9),
and the end-to-end speed tables of `dspark bench` (`speed/`)."""
