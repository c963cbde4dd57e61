"""Loading a C++ kernel with `torch.utils.cpp_extension.load`, never waiting on a dead builder.

torch's JIT build holds a lock file, `<build folder>/lock` (created with O_EXCL), around every
load of an extension, a cached one included, and a process that finds the file there polls until
it is gone. A process killed while it holds it (a service stopped during its first kernel build,
a test that kills a replica) leaves the file behind, and every later load of that kernel, in
every process, waits forever.

`load_kernel` runs torch's load while holding an fcntl lock on `<build folder>.guard`. The OS
drops that lock when its holder exits, however it exits, so a `lock` file found while holding the
guard was left by a process that died mid-build (every process of ours takes the guard first):
it is removed, and the build or load goes on. Two live processes loading one kernel still take
turns, as torch's own lock made them.
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

__all__ = ["load_kernel", "build_folder", "guard_file"]

_log = logging.getLogger(__name__)


def build_folder(name: str) -> Path:
    """Where torch builds and caches extension `name` (TORCH_EXTENSIONS_DIR, else torch's default
    root per Python and accelerator); created if missing."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def guard_file(folder: Path) -> Path:
    """The file whose fcntl lock every load of ours holds around torch's (beside the folder)."""
    return folder.with_name(f"{folder.name}.guard")


def load_kernel(name: str, **load_args):
    """`torch.utils.cpp_extension.load(name=name, **load_args)`, with a lock left in the build
    folder by a dead process removed first (module docstring)."""
    from torch.utils.cpp_extension import load

    folder = build_folder(name)
    with open(guard_file(folder), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the OS if this process dies
        stale = folder / "lock"
        if stale.exists():
            _log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        return load(name=name, **load_args)
