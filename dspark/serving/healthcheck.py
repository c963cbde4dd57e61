"""`python -m dspark.serving.healthcheck HOST:PORT`: exit 0 if the gRPC service there answers
SERVING on the standard health service, else 1 (the containers' healthcheck)."""

from __future__ import annotations

import sys

from dspark.serving.grpc_runtime import is_serving

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if is_serving(sys.argv[1], timeout=3.0) else 1)
