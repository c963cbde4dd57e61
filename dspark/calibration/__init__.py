"""Calibration of the drafter's confidences: Sequential Temperature Scaling (STS) and its metrics.

Follows docs/design.md section 4 ("Sequential Temperature Scaling") and section 9 (ECE).

Glossary
- ``c_k``: raw confidence of draft position k (1-based in prose, column k-1 in arrays): the
  drafter's predicted P(x_k accepted | x_1..x_{k-1} all accepted).
- ``a_k = prod_{i<=k} c_i``: predicted *survival* of the draft prefix of length k (what the
  scheduler of section 6 consumes, so it must be right in absolute value, not only in ranking).
- ``survived[:, k-1]``: observed outcome, True iff drafts 1..k were all accepted. From an accepted
  length ``n`` in 0..gamma: positions 1..n survived, n+1 (if any) was rejected, and every later
  prefix is dead too. A survival matrix must therefore be non-increasing along a row.
- STS: for k = 1..gamma in order, pick ``T_k`` from a grid so that the ECE of
  ``a_k = a_{k-1}' * sigmoid(logit(c_k) / T_k)`` against ``survived[:, k-1]`` is smallest, with
  the already-fitted ``T_1..T_{k-1}`` held fixed (``a_{k-1}'`` is the calibrated prefix).
- Shifted STS (``fit_sts(..., shift=True)``, our extension): the same sequential fit of the map
  ``sigmoid(logit(c_k) / T_k + b_k)``, searching ``T_k`` and a shift ``b_k`` together. A
  temperature alone cannot move the mean of predictions that sit on the wrong side of the
  observed rate without also spreading them (a head trained on other contexts over-predicts
  everywhere); the shift can. With two parameters, ECE is no longer a safe objective: it is
  minimised by a near-constant prediction at the base rate (a huge ``T_k``), which keeps the
  order but throws away the head's sharpness (Brier score worse than raw). So the shifted fit
  minimises the log-loss of the cumulative product ``a_k`` against prefix survival (a proper
  scoring rule: sequential Platt scaling), and ECE is what it is then measured by.
  Both maps are strictly increasing in ``c_k``, so the ranking of the raw head is kept
  (the *conditional* AUC per position, `metrics.conditional_auc`, is unchanged up to float rounding; the AUC of the
  cumulative product can change, since positions get different temperatures).

The modules, one concern each:
- `arrays`: numpy float64 / bool arrays from tensors and sequences;
- `outcomes`: the prefix-survival matrix, from accepted lengths or given, and its checks;
- `metrics`: ECE, its noise floor, ROC-AUC (also conditional on a position), Brier score, and
  their conventions;
- `sts_map`: the fitted map (`STSCalibration`), one per sampling temperature (`CalibrationSet`),
  and the `calibration.json` file beside a drafter checkpoint;
- `fit`: `fit_sts` (plain and shifted) and the cross-fitted ECE;
- `report`: the per-position report and the reliability diagram.
"""
