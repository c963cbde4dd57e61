"""What a failed call tells a gRPC client: a status code that says whose fault it was, and the
error's message (grpc's default for an exception that escapes a handler is UNKNOWN with no
text, which a scheduler can neither act on nor show).

- INVALID_ARGUMENT: the request was wrong (ValueError, TypeError, IndexError, KeyError);
- RESOURCE_EXHAUSTED: the KV cache is full, or the device ran out of memory;
- INTERNAL: the service failed on a valid request (any other RuntimeError: a CUDA error, a
  kernel that refused its tensors), with the error's type and message.
"""

from __future__ import annotations

import grpc

from dspark.models.kv_cache import KVCacheFull

HANDLED = (KVCacheFull, ValueError, TypeError, IndexError, KeyError, RuntimeError)
"""The errors `status_of` maps; what a servicer catches around its model calls."""


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for `error` (module doc)."""
    if isinstance(error, KVCacheFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV cache full: {error}"
    oom = getattr(__import__("torch"), "OutOfMemoryError", ())
    if oom and isinstance(error, oom):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"device out of memory: {error}"
    if isinstance(error, (ValueError, TypeError, IndexError, KeyError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def abort_with(context: grpc.ServicerContext, error: BaseException) -> None:
    """Abort the call with `status_of(error)` (raises, as context.abort does)."""
    code, message = status_of(error)
    context.abort(code, message)
