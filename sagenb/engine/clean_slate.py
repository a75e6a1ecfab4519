"""Each run starts from the engine's state at its start, not from what the last cell left.

An engine is a warm process: whatever a cell changes of the process outlives the cell. A cell
that calls `torch.set_default_dtype(torch.float64)`, or replaces `F.cross_entropy`, changed
every later run of an unchanged cell (it trained in float64, with the loss patched twice), and
once one engine was replaced the ranks disagreed and a valid cell crashed. So the engine's
state as it was when the pool warmed it up (`remember`, once per process) is put back before
every run (`restore`, a task of its own on each engine, pool/clean.py):

- torch's global modes: default dtype and device, deterministic algorithms, the cuDNN and TF32
  switches, float32 matmul precision, grad mode and anomaly detection, intra-op threads;
- the attributes of `torch`, `torch.nn.functional`, `torch.Tensor` and `torch.nn.Module` that
  held something else then: a patched function is put back. A name added since is left, as
  libraries add them on import (transformers adds `torch.nn.Module.smart_apply`), and an
  import happens once per process;
- `os.environ` (variables set since are removed, changed ones put back);
- the soft resource limits (`resource.setrlimit`);
- `sys.stdout` and `sys.stderr`, where a cell replaced them;
- DTensor's caches of sharding decisions, emptied: a replaced engine starts with none, and ranks
  that decide differently compute wrong gradients (engine/torch_private.py).

What a process cannot undo is reported instead, and the notebook replaces that engine: a hard
limit lowered below its start (only a privileged process may raise one, man 2 setrlimit),
inter-op threads changed (torch sets them once per process), a closed `sys.stdout` or
`sys.stderr` (ipykernel's stream cannot be reopened; nothing printed would reach the cell), and
non-daemon threads a cell
started that still run (Python cannot stop a thread from outside). Daemon threads are left:
libraries keep helpers in them (tqdm's monitor), and Python itself does not wait for them.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from sagenb.engine import torch_private
from sagenb.engine.live import kept

__all__ = ["Baseline", "remember", "restore", "Restored"]

#: whose attributes a cell may replace, by the name a user writes
OWNERS: dict[str, Any] = {
    "torch": torch,
    "torch.nn.functional": F,
    "torch.Tensor": torch.Tensor,
    "torch.nn.Module": nn.Module,
}


def _deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _set_default_device(device: torch.device) -> None:
    """The CPU as an engine starts: no device context at all (set_default_device(None)),
    rather than one that routes every factory call through a TorchFunctionMode."""
    torch.set_default_device(None if device.type == "cpu" else device)


def _switch(owner: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], object]]:
    """Read and write a plain boolean switch such as torch.backends.cudnn.benchmark."""
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


#: each global mode a cell can set: its public name, how to read it, how to set it
MODES: dict[str, tuple[Callable[[], Any], Callable[[Any], object]]] = {
    "torch.get_default_dtype()": (torch.get_default_dtype, torch.set_default_dtype),
    "torch.get_default_device()": (torch.get_default_device, _set_default_device),
    "torch.use_deterministic_algorithms": (_deterministic, _set_deterministic),
    "torch.backends.cudnn.deterministic": _switch(torch.backends.cudnn, "deterministic"),
    "torch.backends.cudnn.benchmark": _switch(torch.backends.cudnn, "benchmark"),
    "torch.backends.cudnn.enabled": _switch(torch.backends.cudnn, "enabled"),
    "torch.backends.cudnn.allow_tf32": _switch(torch.backends.cudnn, "allow_tf32"),
    "torch.backends.cuda.matmul.allow_tf32": _switch(torch.backends.cuda.matmul, "allow_tf32"),
    "torch.get_float32_matmul_precision()": (
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    # both set the mode as they are constructed (and are context managers besides)
    "torch.is_grad_enabled()": (torch.is_grad_enabled, lambda on: torch.set_grad_enabled(on)),
    "torch.is_anomaly_enabled()": (
        torch.is_anomaly_enabled,
        lambda on: torch.autograd.set_detect_anomaly(on),
    ),
    "torch.get_num_threads()": (torch.get_num_threads, torch.set_num_threads),
}


@dataclass(frozen=True)
class Baseline:
    """The engine's process state when the pool warmed it up."""

    modes: dict[str, Any]
    #: owner name -> a copy of its attributes (vars())
    attributes: dict[str, dict[str, Any]]
    environ: dict[str, str]
    #: resource -> (soft, hard)
    rlimits: dict[int, tuple[int, int]]
    interop_threads: int
    #: the threads then running (a thread started since and still running is a cell's)
    threads: frozenset[int]
    #: sys.stdout and sys.stderr
    streams: tuple[Any, Any]

    @classmethod
    def now(cls) -> Baseline:
        return cls(
            modes={name: get() for name, (get, _) in MODES.items()},
            attributes={name: dict(vars(owner)) for name, owner in OWNERS.items()},
            environ=dict(os.environ),
            rlimits={r: resource.getrlimit(r) for r in _rlimits()},
            interop_threads=torch.get_num_interop_threads(),
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
            streams=(sys.stdout, sys.stderr),
        )


@dataclass(frozen=True)
class Restored:
    """What `restore` put back (a list of what was changed), and what it could not: the
    engine must then be replaced."""

    changed: list[str]
    unrestorable: list[str]


_baseline: Baseline | None = None


def remember() -> None:
    """Note this process's state, once: later calls (a pool's warm-up runs on every engine
    each time it heals) keep the first."""
    global _baseline
    if _baseline is None:
        _baseline = Baseline.now()


def restore(base: Baseline | None = None) -> Restored:
    """Put back what changed since `remember` (or since `base`). Without a baseline (an
    engine that sagenb did not warm up: `%px` imported it first) it notes one now. A run's
    state kept for --continue is released first (live/kept.py): every run but a
    continuation starts clean."""
    kept.release()
    torch_private.forget_dtensor_shardings()
    if base is None and _baseline is None:
        remember()
        return Restored([], [])
    base = base or _baseline
    assert base is not None  # for mypy: remembered above
    changed = _restore_modes(base) + _restore_attributes(base) + _restore_environ(base)
    changed += _restore_streams(base)
    soft, hard = _restore_rlimits(base)
    unrestorable = hard + _interop(base) + _stray_threads(base) + _closed_streams()
    return Restored(changed + soft, unrestorable)


def _restore_modes(base: Baseline) -> list[str]:
    changed = []
    for name, (get, put) in MODES.items():
        was, now = base.modes[name], get()
        if now != was:
            put(was)
            changed.append(f"{name} was {now!r}, set back to {was!r}")
    return changed


def _restore_attributes(base: Baseline) -> list[str]:
    changed = []
    for owner_name, owner in OWNERS.items():
        was = base.attributes[owner_name]
        now = vars(owner)
        replaced = [n for n, v in was.items() if now.get(n, _MISSING) is not v]
        for name in replaced:
            setattr(owner, name, was[name])
        changed += [f"{owner_name}.{n} was replaced, put back" for n in replaced]
    return changed


def _restore_environ(base: Baseline) -> list[str]:
    was, now = base.environ, dict(os.environ)
    added = [k for k in now if k not in was]
    changed = [k for k, v in was.items() if now.get(k) != v]
    for key in added:
        del os.environ[key]
    for key in changed:
        os.environ[key] = was[key]
    return [f"os.environ[{k!r}] was set, removed" for k in added] + [
        f"os.environ[{k!r}] was changed, put back" for k in changed
    ]


def _restore_rlimits(base: Baseline) -> tuple[list[str], list[str]]:
    """Soft limits put back; the hard limits lowered since, which cannot be."""
    changed, lost = [], []
    for which, (soft, hard) in base.rlimits.items():
        now_soft, now_hard = resource.getrlimit(which)
        name = _RLIMIT_NAMES.get(which, str(which))
        if _lower(now_hard, hard):
            lost.append(f"{name}'s hard limit was lowered to {now_hard} (it was {hard}")
            lost[-1] += ": a process cannot raise its own hard limit back)"
        elif now_soft != soft:
            resource.setrlimit(which, (soft, now_hard))
            changed.append(f"resource.{name} was {now_soft}, set back to {soft}")
    return changed, lost


def _restore_streams(base: Baseline) -> list[str]:
    changed = []
    for name, was in zip(("stdout", "stderr"), base.streams):
        if getattr(sys, name) is not was:
            setattr(sys, name, was)
            changed.append(f"sys.{name} was replaced, put back")
    return changed


def _closed_streams() -> list[str]:
    return [
        f"sys.{name} was closed"
        for name in ("stdout", "stderr")
        if getattr(getattr(sys, name), "closed", False)
    ]


def _interop(base: Baseline) -> list[str]:
    now = torch.get_num_interop_threads()
    if now == base.interop_threads:
        return []
    return [
        f"torch.get_num_interop_threads() is {now} (it was {base.interop_threads}: torch sets "
        "it once per process)"
    ]


def _stray_threads(base: Baseline) -> list[str]:
    stray = [
        t
        for t in threading.enumerate()
        if t.ident not in base.threads and t.is_alive() and not t.daemon
    ]
    return [f"thread {t.name!r}, not a daemon, started by a cell, still runs" for t in stray]


_MISSING = object()


def _lower(limit: int, than: int) -> bool:
    """Whether `limit` is below `than`, RLIM_INFINITY (-1 here) being the highest."""
    infinite = resource.RLIM_INFINITY
    return limit != than and (than == infinite or (limit != infinite and limit < than))


def _rlimits() -> list[int]:
    return list(_RLIMIT_NAMES)


_RLIMIT_NAMES = {
    getattr(resource, name): name
    for name in sorted(dir(resource))
    if name.startswith("RLIMIT_") and isinstance(getattr(resource, name), int)
}
