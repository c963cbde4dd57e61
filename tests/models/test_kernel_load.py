"""dspark.models.kernel_load on the fused RMSNorm kernel (the quickest of ours to build), each
load in a process of its own as a service's would be:

- a `lock` file left in the build folder by a process that died mid-build no longer makes the
  load wait forever: the next process removes it, loads the kernel and gets its bits;
- a lock held by a live builder (its guard held) is waited for, not removed: the load finishes
  only after the builder lets go.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.models import fused_norm
from dspark.models.kernel_load import build_folder, guard_file

LOAD = ("import torch\n"
        "from dspark.models import fused_norm\n"
        "x = torch.randn(3, 576)\n"
        "w = torch.randn(576)\n"
        "assert fused_norm.lanes() is not None, 'the kernel did not load'\n"
        "assert torch.equal(fused_norm.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (576,), w, 1e-5))\n"
        "print('loaded')\n")


@pytest.fixture
def kernel_folder():
    if fused_norm.lanes() is None:
        pytest.skip("no C++ compiler here: no kernel to load")
    ext = fused_norm._extension()
    folder = build_folder(ext.__name__)
    assert (folder / f"{ext.__name__}.so").exists()
    yield folder
    (folder / "lock").unlink(missing_ok=True)


@pytest.fixture
def load_in_a_process():
    """Starts the load in a process of its own; a process still waiting at the end is killed."""
    started = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
        return started[-1]

    yield start
    for child in started:
        child.kill()
        child.wait()


def opened(pid: int, path) -> bool:
    """Whether process `pid` holds `path` open (Linux /proc)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.path.realpath(fd) == os.path.realpath(path) for fd in fds.iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_lock_left_by_a_dead_build_is_removed(kernel_folder, load_in_a_process):
    (kernel_folder / "lock").touch()  # as a process killed while building leaves it
    child = load_in_a_process()
    out, err = child.communicate(timeout=180)  # torch's own load would poll here forever
    assert child.returncode == 0, err
    assert out.strip() == "loaded"
    assert "did not finish" in err  # it says what it removed
    assert not (kernel_folder / "lock").exists()


def test_a_live_builders_lock_is_waited_for(kernel_folder, load_in_a_process):
    guard = guard_file(kernel_folder)
    with open(guard, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live process of ours building the kernel
        (kernel_folder / "lock").touch()
        child = load_in_a_process()
        deadline = time.monotonic() + 120
        while not opened(child.pid, guard):  # it has reached the guard
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.1)
        time.sleep(0.5)
        assert child.poll() is None  # waiting for the builder
        assert (kernel_folder / "lock").exists()
        (kernel_folder / "lock").unlink()  # the build ends: torch's lock, then the guard
        fcntl.flock(held, fcntl.LOCK_UN)
    out, err = child.communicate(timeout=180)
    assert child.returncode == 0, err
    assert out.strip() == "loaded" and "did not finish" not in err
