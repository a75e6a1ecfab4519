"""Modules beside the notebook are imported again once their files change, as a run's code.

ipyparallel starts the engines in the notebook's folder (their working directory, which `''`
on sys.path names), so a cell's `import model` finds a `model.py` beside the notebook, as the
kernel does. But an engine is a warm process: `import` hands back the module it imported for
an earlier run, and a run after `model.py` was edited trained the old code, silently (a kernel
with `%autoreload 2` sees the new code; the engines did not).

So each run notes the files of the modules it imported from the folder (`note`: their size and
modification time, as importlib's own bytecode check compares them), and the next run, before
its cell runs, removes from `sys.modules` every module of the folder if any of those files
changed or went away (`drop_edited`): all of them, not just the edited one, since another
module of the folder may hold the old one's names (`from model import GPT` in `train.py`), and
a package's attribute its old submodule. The cell's imports then read the files as they are.

"The folder" is the engine's working directory. What lies in it but is not the user's is left
alone: sagenb itself (a notebook at the root of sagenb's checkout) and installed packages (a
virtual environment inside the folder: site-packages, dist-packages).
"""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["note", "drop_edited", "folder_modules"]

#: file -> (size, mtime_ns) when a run imported it
_imported: dict[str, tuple[int, int]] = {}

#: sagenb's own package folder (this file is sagenb/engine/edited_modules.py)
_SAGENB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def folder_modules(folder: str | None = None) -> dict[str, str]:
    """The modules in sys.modules imported from `folder` (the working directory): name -> file.

    By the file names as imported (absolute: the finder of `''` on sys.path joins the working
    directory), compared as strings: resolving each of an engine's ~2,000 modules' paths took
    0.08 s a call."""
    root = os.path.join(os.path.abspath(folder or os.getcwd()), "")
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.startswith(root) and not _left_alone(path):
            found[name] = path
    return found


def note() -> None:
    """Remember the files of the folder's modules not noted yet, as they are now (just after
    the cell imported them, and at the run's end for modules imported while it trained)."""
    for path in folder_modules().values():
        if path not in _imported:
            stamp = _stamp(path)
            if stamp is not None:
                _imported[path] = stamp


def drop_edited() -> list[str]:
    """If a noted file changed since, every module of the folder leaves sys.modules (to be
    imported again by the cell); returns the changed files, relative to the folder."""
    modules = folder_modules()
    edited = sorted({p for p in modules.values() if p in _imported and _stamp(p) != _imported[p]})
    if edited:
        for name, path in modules.items():
            del sys.modules[name]
            _imported.pop(path, None)
        importlib.invalidate_caches()  # the finders' cached listings of the folder
    return [os.path.relpath(p) for p in edited]


def _left_alone(path: str) -> bool:
    return path.startswith(_SAGENB) or any(part in path for part in _INSTALLED)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # deleted: changed, and imported again (or failing) as the kernel would
        return None
    return st.st_size, st.st_mtime_ns
