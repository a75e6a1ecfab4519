"""Every rank stops after the same step when the notebook asks (the kernel's interrupt).

The notebook sets REQUEST_KEY in the run's store. Rank 0, at its next step boundary s, fixes the
last step at s + 1: it tells every other rank through a key of that rank's own, and waits until
each has acknowledged before it starts step s + 1. No other rank can finish step s + 1 before
that (every step ends in collectives that need rank 0), so every rank knows the last step before
it reaches it, and all stop at the same boundary.

Only this run's participants can stop it. torch's store has no authentication and lists its
keys to any client (`TCPStore.list_keys`), and any local process can connect to a loopback
port. So every message of this protocol carries the run's token, a random string the notebook
hands its ranks with the run (RankSpec) and never writes to the store before it sends a request:
a message without it is deleted and ignored, and the rank keeps listening.

Each rank listens in a thread of its own, blocked in the store (a C++ wait that releases the
GIL), so the training loop pays an attribute read per step. It used to ask the store at every
step, a round trip through the notebook's process that cost data-parallel throughput
(benchmarks/against_peers.py; benchmarks/results/measured_in_code.md).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from sagenb.engine.wire.rendezvous import wait_for_key

__all__ = ["REQUEST_KEY", "StopWatch", "request"]

#: set by the notebook (to the run's token) when the user interrupts
REQUEST_KEY = "sagenb/stop_requested"
#: written by the rank itself when its run ends, to release its listening thread
_END = "end"


def _last_step_key(rank: int) -> str:
    return f"sagenb/stop_after_step/{rank}"


def _ack_key(rank: int) -> str:
    return f"sagenb/stop_acknowledged/{rank}"


class StopWatch:
    """One rank's side of the protocol above; `should_stop(step)` after every step."""

    def __init__(
        self,
        store: dist.Store,
        *,
        addr: str,
        port: int,
        rank: int,
        world_size: int,
        timeout: timedelta,
        token: str = "",
    ) -> None:
        self.store, self.rank, self.world_size, self.token = store, rank, world_size, token
        #: messages without the run's token, deleted and ignored (see the module docstring)
        self.ignored = 0
        self.requested = False  # rank 0: the notebook has asked
        self.last_step: int | None = None
        # the thread's own connection: a store client is not shared between threads
        listener = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        self._key = REQUEST_KEY if rank == 0 else _last_step_key(rank)
        self._thread = threading.Thread(
            target=self._listen, args=(listener,), name=f"sagenb-stop-{rank}", daemon=True
        )
        self._thread.start()

    def _listen(self, listener: dist.TCPStore) -> None:
        try:
            value = self._wait(listener)
            if value is None or value == _END:
                return
            if self.rank == 0:
                self.requested = True
            else:
                self.last_step = int(value)
                listener.set(_ack_key(self.rank), self._signed("1"))
        except Exception:  # noqa: BLE001 - the store went away: the run is over
            return

    def _signed(self, value: str) -> str:
        return f"{self.token}:{value}"

    def _wait(self, listener: dist.TCPStore) -> str | None:
        """The next message of this run's on this rank's key, its token taken off (None: the
        store is gone)."""
        while wait_for_key(listener, self._key):
            value = _verified(listener, self._key, self.token)
            if value is not None:
                return value
            self.ignored += 1  # not this run's: keep waiting
        return None

    def should_stop(self, step: int) -> bool:
        """Whether this rank stops after `step`; called at every step boundary but the
        plan's last (see train_loop), by every rank."""
        if self.rank == 0 and self.requested and self.last_step is None:
            self._decide(step + 1)
        return self.last_step is not None and step >= self.last_step

    def _decide(self, last: int) -> None:
        others = range(1, self.world_size)
        for r in others:
            self.store.set(_last_step_key(r), self._signed(str(last)))
        for r in others:
            while _verified(self.store, _ack_key(r), self.token, wait=True) is None:
                self.ignored += 1
        self.last_step = last

    def close(self) -> None:
        """Release this rank's listening thread (the run is over)."""
        if self._thread.is_alive():
            try:
                self.store.set(self._key, self._signed(_END))
            except Exception:  # noqa: BLE001 - the store is gone; so is the thread's wait
                pass
            self._thread.join(timeout=1)


def request(store: dist.Store, token: str) -> None:
    """The notebook's side: ask the run whose token is `token` to stop."""
    store.set(REQUEST_KEY, f"{token}:1")


def _verified(store: dist.Store, key: str, token: str, *, wait: bool = False) -> str | None:
    """`key`'s value without the run's token, or None (the key deleted) when it lacks it."""
    if wait:
        store.wait([key])
    value = store.get(key).decode()
    head, sep, body = value.partition(":")
    if sep and head == token:
        return body
    store.delete_key(key)  # not this run's: a forged or stray message
    return None
