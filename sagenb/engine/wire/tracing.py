"""Where a rank is when the notebook finds its run stalled: its Python stack, and the
collectives it has started that have not finished.

The stack: `faulthandler` dumps every thread's Python frames from a C signal handler on
SIGUSR1 (https://docs.python.org/3/library/faulthandler.html#dumping-the-traceback-on-a-user-signal),
so it works while the rank's main thread spins in a Python loop or is blocked in a C++
collective with the GIL released. It writes to a per-rank file (`stack_path`) the notebook reads
on the same host, in a directory private to the user (engine/scratch.py: $TMPDIR is shared, and
a planted symlink there made the dump overwrite a file of the user's); the file's first line
names the thread that runs the rank.

The collectives: torch's flight recorder keeps the last collectives of every process group
(2000 by default in torch 2.13, gloo included; `TORCH_FR_BUFFER_SIZE` sets how many). A
thread of the rank, blocked in the run's store like stopping.py's, dumps the ones not
yet retired into the store when the notebook asks (a signal handler cannot: Python handlers run
only when the main thread gets back to Python, and a rank blocked in a collective does not).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import IO, NoReturn

import torch.distributed as dist

from sagenb.engine.scratch import create_private, dir_path, private_dir
from sagenb.engine.torch_private import dump_flight_recorder_json
from sagenb.engine.wire import shared_memory
from sagenb.engine.wire.rendezvous import wait_for_key

__all__ = [
    "STACK_SIGNAL",
    "Tracer",
    "stack_path",
    "crash_path",
    "report_crashes",
    "request_key",
    "collectives_key",
]

STACK_SIGNAL = signal.SIGUSR1
STACKS_DIR = "sagenb-stacks"  # $TMPDIR/sagenb-stacks-<uid>, private to the user (scratch.py)
_END = "end"
_CONNECT = timedelta(seconds=2)  # to release the thread at the end of the run


def stack_path(port: int, rank: int) -> str:
    """Where rank `rank` of the run whose store listens on `port` dumps its stack: derived,
    not sent, so the notebook and the engine agree without a field in RankSpec."""
    return os.path.join(dir_path(STACKS_DIR), f"{port}-{rank}")


def crash_path(pid: int) -> str:
    """Where the engine of process `pid` reports a fatal signal (report_crashes)."""
    return os.path.join(dir_path(STACKS_DIR), f"crash-{pid}")


_crash_file: list = []


def report_crashes() -> None:
    """Have faulthandler write a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) and
    the Python stack it hit to `crash_path`, for the engine's life: the notebook reads it when
    the engine died (run/stacks.py), as ipyparallel says only "Engine 1 died". The engine's
    stderr will not do: ipykernel captures its descriptor into a pipe read by a thread of the
    dying process. Once per process; nothing when the directory is not private (scratch.py)."""
    if _crash_file:
        return
    try:
        private_dir(STACKS_DIR)
        _crash_file.append(create_private(crash_path(os.getpid())))
    except OSError:  # UnsafeDirectory too: the engine runs without crash reports
        return
    faulthandler.enable(file=_crash_file[0], all_threads=True)
    os._exit = _reporting_exit(os._exit, _crash_file[0])  # type: ignore[assignment]


#: the first line of the report of an engine that called os._exit (run/stacks.py reads it)
EXITED = "Exited: "


def _reporting_exit(
    exit_now: Callable[[int], NoReturn], file: IO[str]
) -> Callable[[int], NoReturn]:
    """os._exit, reporting first who called it: an engine ended so (by the cell, or a library
    it calls) was reported as "killed, likely SIGKILL or the OOM killer". Set once per engine
    before the state every run starts from is remembered (clean_slate.py), so it stays."""

    def exit_reporting(status: int) -> NoReturn:
        try:
            file.seek(0)
            file.truncate()
            file.write(f"{EXITED}os._exit({status})\n")
            file.flush()
            faulthandler.dump_traceback(file, all_threads=True)
        except Exception:  # noqa: BLE001 - the exit is what was asked for
            pass
        exit_now(status)

    return exit_reporting


def request_key(rank: int) -> str:
    return f"sagenb/trace/request/{rank}"


def collectives_key(rank: int) -> str:
    return f"sagenb/trace/collectives/{rank}"


_nowhere: list = []  # /dev/null, opened once per engine


def _stand_down() -> None:
    """Dump a later SIGUSR1 (sent as the run ended) into /dev/null: unregistered, its default
    action would end the engine, and a closed file's descriptor may be reused."""
    if not _nowhere:
        _nowhere.append(open(os.devnull, "w"))  # noqa: SIM115 - for the engine's lifetime
    faulthandler.register(STACK_SIGNAL, file=_nowhere[0], all_threads=True, chain=False)


class Tracer:
    """One rank's side, for the length of one run; `close()` when the run ends."""

    def __init__(self, *, addr: str, port: int, rank: int, timeout: timedelta) -> None:
        self.path, self.rank = stack_path(port, rank), rank
        self.started_ns = time.time_ns()  # an earlier run's unfinished entries are not ours
        private_dir(STACKS_DIR)  # UnsafeDirectory when another user could redirect the dump
        self._file = create_private(self.path)  # faulthandler writes to it until close
        self._file.write(f"rank thread 0x{threading.get_ident():016x}\n")
        self._file.flush()  # faulthandler appends at the descriptor's offset, after this line
        faulthandler.register(STACK_SIGNAL, file=self._file, all_threads=True, chain=False)
        self._closed, self._where = False, (addr, port)
        # the thread connects: an unreachable store fails init_process_group, not this
        self._thread = threading.Thread(
            target=self._listen,
            args=(addr, port, timeout),
            name=f"sagenb-trace-{rank}",
            daemon=True,
        )
        self._thread.start()

    def _listen(self, addr: str, port: int, timeout: timedelta) -> None:
        key = request_key(self.rank)
        try:
            # the thread's own connection: a store client is not shared between threads
            store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
            if not wait_for_key(store, key):
                return  # the store is gone: so is the run
            if not self._closed and store.get(key).decode() != _END:
                store.set(collectives_key(self.rank), json.dumps(in_flight(self.started_ns)))
        except Exception:  # noqa: BLE001 - tracing must never fail the rank
            return

    def close(self) -> None:
        """Stop dumping (a later SIGUSR1 is ignored), remove the file, release the thread."""
        _stand_down()
        self._closed = True
        self._file.close()
        try:
            os.remove(self.path)
        except OSError:
            pass
        if self._thread.is_alive():
            # through a connection of its own: the thread's is busy in its wait (a second
            # call on it would block behind that wait); in a thread: a store that is gone
            # takes seconds to refuse, and the rank's peers are waiting for it to end
            threading.Thread(target=self._release, name="sagenb-trace-end", daemon=True).start()

    def _release(self) -> None:
        try:
            store = dist.TCPStore(*self._where, is_master=False, timeout=_CONNECT)
            store.set(request_key(self.rank), _END)
        except Exception:  # noqa: BLE001 - the store is gone; so is the thread's wait
            pass


def in_flight(since_ns: int = 0) -> list[dict]:
    """The collectives this process started since `since_ns` (epoch) that have not been
    retired, oldest first, from torch's flight recorder (empty when it records nothing or this
    torch has none)."""
    # data parallel's gradients, when they are reduced through shared memory, not gloo
    reducing = shared_memory.in_flight()
    try:
        trace = json.loads(dump_flight_recorder_json() or "{}")
    except Exception:  # noqa: BLE001 - a private API: changed in other versions
        return reducing
    return [
        {
            "op": e.get("profiling_name", "?"),
            "seq": e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id"),
            "sizes": e.get("input_sizes"),
            "group": (e.get("process_group") or ["", ""])[-1],
        }
        for e in trace.get("entries", [])
        if not e.get("retired", True) and e.get("time_created_ns", 0) >= since_ns
    ] + reducing
