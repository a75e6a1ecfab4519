"""What this engine's collectives carried, and how long an all-reduce takes against its size:
the engine's half of sagenb/sizing/traffic.py, which asks the pool's engines after a run.

The collectives come from torch's flight recorder (engine/torch_private.py), which keeps the
last collectives of every process group of this process, gloo included (2000 by default in
torch 2.13; `TORCH_FR_BUFFER_SIZE` sets how many), after the group is destroyed too: for each,
its name ("gloo:all_reduce"), the sizes and dtypes of its input and output tensors, and when it
was called (the clock of `time.time_ns`). Gloo's point-to-point send and recv are not recorded
there, so a pipeline's activations between stages are not in what this returns.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from math import prod
from typing import Any

import torch
import torch.distributed as dist

from sagenb.engine.torch_private import dump_flight_recorder_json
from sagenb.engine.wire import shared_memory

__all__ = ["DTYPE_BYTES", "collectives_since", "all_reduce_seconds"]

#: bytes per element of the dtype names the flight recorder writes (c10's ScalarType names)
DTYPE_BYTES = {
    "Double": 8,
    "Long": 8,
    "ComplexFloat": 8,
    "Float": 4,
    "Int": 4,
    "Half": 2,
    "BFloat16": 2,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
}


def _bytes(sizes: list[list[int]], dtypes: list[str]) -> int:
    try:
        return sum(prod(shape) * DTYPE_BYTES[dtype] for shape, dtype in zip(sizes, dtypes))
    except KeyError as exc:
        raise ValueError(f"the flight recorder wrote dtype {exc}: not in DTYPE_BYTES") from None


def collectives_since(since_ns: int) -> list[dict[str, Any]] | None:
    """This process's collectives called at or after `since_ns` (time.time_ns()), oldest first:
    {"kind": "all_reduce", "time_ns", "input_bytes", "output_bytes", "group", "pg_id",
    "default"}. None where this
    torch build has no flight recorder."""
    raw = dump_flight_recorder_json()
    if raw is None:
        return None
    out = []
    for entry in json.loads(raw).get("entries", []):
        if entry["time_created_ns"] < since_ns:
            continue
        out.append(
            {
                "kind": entry["profiling_name"].split(":")[-1],
                "time_ns": entry["time_created_ns"],
                "input_bytes": _bytes(entry["input_sizes"], entry["input_dtypes"]),
                "output_bytes": _bytes(entry["output_sizes"], entry["output_dtypes"]),
                "group": str(entry["process_group"][0]),
                # which instance of a group (each init_process_group makes a new one, its
                # name reused), and whether it is the default group
                "pg_id": int(entry.get("pg_id", -1)),
                "default": entry["process_group"][1] == "default_pg",
            }
        )
    # data parallel's gradients reduced through shared memory (shared_memory.py), not gloo
    out += shared_memory.recorded_since(since_ns)
    return sorted(out, key=lambda c: c["time_ns"])


def all_reduce_seconds(
    rank: int,
    world_size: int,
    address: str,
    port: int,
    sizes: list[int],
    *,
    repeats: int = 5,
    timeout_s: float = 60.0,
) -> list[list[float]]:
    """Seconds of each of `repeats` all-reduces (sum, fp32) of each message size in `sizes`
    (bytes), timed on this rank, on a gloo group of its own (not the default group a run
    uses) over the store the notebook hosts at `address`:`port`. The ranks meet at a
    barrier before every all-reduce, so each is timed from a common start."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    # a gloo backend object of its own, outside torch.distributed's registry of groups (the
    # run's default group is not disturbed); torch's stubs omit its collectives (typed Any)
    prefix = dist.PrefixStore("allreduce-bench", store)
    group: Any = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    times: list[list[float]] = []
    for size in sizes:
        buffer = torch.ones(max(size // 4, 1))
        group.allreduce([buffer]).wait()  # warm: gloo's buffers for this size
        row = []
        for _ in range(repeats):
            group.barrier().wait()
            start = time.perf_counter()
            group.allreduce([buffer]).wait()
            row.append(time.perf_counter() - start)
        times.append(row)
    return times
