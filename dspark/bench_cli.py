"""`dspark bench`: the end-to-end speed tables (DESIGN.md section 10).

The same benchmark and flags as `bench/e2e.py`; the code is `dspark.bench_e2e`.
"""

from dspark.bench_e2e import configure, run

__all__ = ["configure", "run"]
