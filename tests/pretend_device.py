"""A pretend accelerator on the CPU: catch tensors of two devices meeting, and count the calls
that would synchronise the host with the device, without a GPU.

`PretendDevice` is a TorchFunctionMode. Tensors it *places* (a runner's or drafter's weights
and caches, anything created with `device=` the pretend device, moved there with `.to()` /
`.cuda()`, or computed from such tensors) are tagged; everything runs on the CPU as before, but
a tagged tensor reports the pretend device (`t.device`, `t.is_cuda`), so code that follows
`x.device` behaves as on a GPU. Every other tensor is a host tensor. An op that mixes a tagged
tensor with a host tensor of one or more dimensions raises `MixedDevices`, as CUDA would
("Expected all tensors to be on the same device"); host 0-dim tensors may meet device tensors
(CUDA allows CPU scalars), a device tensor may be indexed by host indices, and `copy_` crosses
devices. These are the rules CUDA applies, a little stricter where CUDA's are loose (values
written by advanced indexing must be on the indexed tensor's device).

Synchronisations: reading a device tensor's values on the host (`item`, `tolist`, `bool()`,
`int()`, `float()`, `__index__`, `numpy`, `.cpu()` / `.to(cpu)`) and the ops whose output shape
depends on device values (`nonzero`, boolean-mask indexing, `masked_select`, `unique`,
`repeat_interleave` without output_size; a host mask costs nothing) are counted in `syncs` (and by name in `sync_calls`); with the environment variable DSPARK_SYNC_STACKS set,
each one prints the project's stack to stderr.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_TAG = "_pretend_device"
STACKS_ENV = "DSPARK_SYNC_STACKS"
"""Set (to anything) to print the project's stack at every counted synchronisation."""


class MixedDevices(RuntimeError):
    """Tensors of the pretend device and of the host met in one op."""


def _tagged(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _tag(out) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _TAG, True)
            except (AttributeError, RuntimeError):  # e.g. a C++-owned tensor without __dict__
                pass


def _untag(out) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and getattr(t, _TAG, False):
            setattr(t, _TAG, False)


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _descriptor(func):
    """The getset descriptor of a property getter (`Tensor.device.__get__`), else None."""
    owner = getattr(func, "__self__", None)
    return owner if type(owner).__name__ == "getset_descriptor" else None


_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__len__"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}
_FACTORY_LIKE = {"to", "cuda", "cpu", "new_tensor", "new_zeros", "new_ones", "new_empty",
                 "new_full"}


def _own_frames() -> list[str]:
    """The formatted stack of the project's own frames (not torch's, not this file's)."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if "/torch/" not in f.filename and not f.filename.endswith("pretend_device.py")
              and "/_pytest/" not in f.filename and "/pluggy/" not in f.filename]
    return traceback.format_list(frames[-8:])


def _caller() -> str:
    """file:line of the innermost frame of the project's own code (not torch, not this file)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("pretend_device.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class PretendDevice(TorchFunctionMode):
    """Run under `with PretendDevice() as dev:` after `dev.place(module_or_tensor, ...)`."""

    def __init__(self, device: str = "cuda:0") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.syncs = 0
        self.sync_calls: Counter[str] = Counter()
        self.counting = True
        self.sync_sites: Counter[str] | None = None
        """Set to a Counter to count syncs by where our code made them (file:line)."""
        self.uploads = 0
        """Host-to-device copies: a host tensor moved to the device (`to`, `cuda`, `copy_` into
        a device tensor), or a tensor made on the device from host data (`tensor`,
        `as_tensor`)."""

    # -- placing ---------------------------------------------------------------------------
    def place(self, *objs) -> None:
        """Tag modules' parameters, buffers and tensor attributes, or tensors, as on the device."""
        for obj in objs:
            if isinstance(obj, torch.Tensor):
                _tag(obj)
            elif isinstance(obj, torch.nn.Module):
                for m in obj.modules():
                    for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                        _tag(t)
                    for v in vars(m).values():
                        if isinstance(v, torch.Tensor):
                            _tag(v)
                        elif isinstance(v, (list, tuple)):
                            _tag([x for x in v if isinstance(x, torch.Tensor)])
            else:
                for v in vars(obj).values():
                    if isinstance(v, torch.Tensor):
                        _tag(v)

    def place_runner(self, runner) -> None:
        """A TargetRunner as it would be on the device: weights, KV cache, its device, and the
        attention a runner on that device picks."""
        from dspark.models.runner import default_attention

        self.place(runner.model, runner.cache)
        runner.device = self.device
        runner.attention = runner.config.attention or default_attention(self.device)

    def is_on_device(self, t: torch.Tensor) -> bool:
        return _tagged(t)

    def reset_counts(self) -> None:
        self.syncs = 0
        self.sync_calls.clear()
        self.uploads = 0

    def _sync(self, what: str) -> None:
        if self.counting:
            self.syncs += 1
            self.sync_calls[what] += 1
            if self.sync_sites is not None:
                self.sync_sites[f"{what} at {_caller()}"] += 1
            if os.environ.get(STACKS_ENV):
                print(f"--- sync: {what}\n" + "".join(_own_frames()), file=sys.stderr)

    # -- the mode --------------------------------------------------------------------------
    def _is_pretend(self, device) -> bool:
        if device is None or isinstance(device, (torch.dtype, torch.Tensor)):
            return False
        try:
            return torch.device(device).type == self.device.type
        except (RuntimeError, TypeError):
            return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = _name(func)
        descriptor = _descriptor(func)
        if descriptor is not None:  # property getters
            prop = getattr(descriptor, "__name__", "")
            if args and _tagged(args[0]):
                if prop == "device":
                    return self.device
                if prop == "is_cuda":
                    return self.device.type == "cuda"
                if prop == "is_cpu":
                    return False
            return func(*args, **kwargs)
        if name == "get_device" and args and _tagged(args[0]):
            return self.device.index or 0

        # Where the output goes: an explicit device (to/cuda/cpu, device=), else its inputs'.
        to_device = None
        if "device" in kwargs:
            to_device = kwargs["device"]
            if self._is_pretend(to_device):
                kwargs["device"] = "cpu"
        if name == "to" and args:
            rest = list(args[1:])
            for i, a in enumerate(rest):
                if isinstance(a, torch.Tensor):
                    to_device = self.device if _tagged(a) else torch.device("cpu")
                    break
                if isinstance(a, (str, torch.device)):
                    to_device = a
                    if self._is_pretend(a):
                        rest[i] = "cpu"
                    break
            args = (args[0], *rest)
        elif name == "cuda":
            to_device = self.device
            func, args = torch.Tensor.to, (args[0], "cpu")
        elif name == "cpu":
            to_device = torch.device("cpu")
        elif name in ("pin_memory",):
            return args[0]  # pinned host memory is host memory

        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if _tagged(t)]
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None

        if on_device and name not in _FACTORY_LIKE and name != "copy_":
            host = [t for t in tensors if not _tagged(t) and t.dim() > 0]
            if name in _INDEXING and self_t is not None and _tagged(self_t):
                # A device tensor indexed by host indices is fine; written values must be on
                # the device.
                values = args[2] if name == "__setitem__" and len(args) > 2 else None
                host = ([values] if isinstance(values, torch.Tensor) and not _tagged(values)
                        and values.dim() > 0 else [])
            if host:
                shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in host)
                raise MixedDevices(f"{name}: tensors on {self.device} meet host tensors "
                                   f"({shapes})")

        # Synchronisations.
        if self_t is not None and _tagged(self_t):
            if name in _READS:
                self._sync(name)
            elif name in _DATA_DEPENDENT:
                self._sync(name)
            elif name in ("cpu", "to") and to_device is not None and not self._is_pretend(to_device):
                self._sync(name)
            elif name in ("__getitem__", "__setitem__"):
                index = args[1] if len(args) > 1 else None
                idx = index if isinstance(index, tuple) else (index,)
                if any(_tagged(i) and i.dtype == torch.bool and i.dim() > 0 for i in idx):
                    self._sync(f"{name}[bool mask]")
        if self.counting and (
                (name == "copy_" and self_t is not None and _tagged(self_t) and len(args) > 1
                 and isinstance(args[1], torch.Tensor) and not _tagged(args[1]))
                or (name in ("tensor", "as_tensor") and self_t is None
                    and self._is_pretend(to_device))):
            self.uploads += 1
        if name == "repeat_interleave" and "output_size" not in kwargs:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if _tagged(repeats) or (_tagged(self_t) and self_t.dtype != torch.bool
                                    and len(args) == 1 and "repeats" not in kwargs):
                self._sync("repeat_interleave")
        out = func(*args, **kwargs)
        if name in _READS or name == "__repr__" or name == "__format__":
            return out
        if to_device is not None:
            moving = self_t is not None and _tagged(self_t) != self._is_pretend(to_device)
            if moving and self.counting and self._is_pretend(to_device):
                self.uploads += 1
            if moving and out is self_t:  # a real move makes a new tensor; the CPU returns self
                out = out.clone()
            if self._is_pretend(to_device):
                _tag(out)
            else:
                _untag(out)
            return out
        if on_device:
            _tag(out)
        return out
