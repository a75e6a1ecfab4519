"""What the engines' collectives moved in a run, set beside what the estimate says each
strategy sends (footprint.py's `comm_bytes_per_step`); and an all-reduce's time against its
size on the pool's engines, with the alpha-beta fit t = alpha + n x beta (notebook 08).

Measured: each engine's collectives from torch's flight recorder (engine/wire/traffic.py):
which collective, on tensors of how many bytes. Each is assigned to the step whose metrics the
engine published next (`time(unix s)`, when a step ended). Bytes a rank sends are then counted
as the estimate counts them, for a ring over the group's n ranks (attribution.py's `ring`):
all-reduce 2(n-1)/n x the buffer, all-gather (n-1)/n x the gathered output, reduce-scatter
(n-1)/n x the input. n is read from the tensors for all-gather and reduce-scatter, and taken as
the run's engines for an all-reduce or a broadcast (true of every group of a data, sharded or
single-group tensor parallel run; not of hybrid's or tensor parallel's data-parallel groups).
Gloo's send and recv are not in the recorder: a pipeline's traffic is not measured.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sagenb.engine.strategies.attribution import ring
from sagenb.engine.wire.traffic import all_reduce_seconds, collectives_since
from sagenb.metrics import keys
from sagenb.pool import cluster

__all__ = [
    "AlphaBeta",
    "StepTraffic",
    "all_reduce_benchmark",
    "fit_alpha_beta",
    "measure_traffic",
    "typical_step",
]


@dataclass
class StepTraffic:
    """One rank's collectives in one optimizer step, by kind ("all_reduce", ...)."""

    step: int
    calls: dict[str, int] = field(default_factory=dict)
    #: bytes of the tensors the collectives were called on (all-gather: the gathered output)
    payload: dict[str, float] = field(default_factory=dict)
    #: bytes this rank sends in a ring, as the estimate counts them
    sent: dict[str, float] = field(default_factory=dict)
    #: the payload of each call, in the order called (DDP's buckets, FSDP's units)
    messages: dict[str, list[float]] = field(default_factory=dict)

    def add(self, collective: dict[str, Any], world_size: int) -> None:
        kind = collective["kind"]
        inp, out = collective["input_bytes"], collective["output_bytes"]
        if kind == "all_gather":
            payload, n = out, round(out / inp) if inp else world_size
        elif kind == "reduce_scatter":
            payload, n = inp, round(inp / out) if out else world_size
        else:
            payload, n = inp, world_size
        sent = payload if kind == "broadcast" else ring(kind, payload, n)
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.payload[kind] = self.payload.get(kind, 0.0) + payload
        self.sent[kind] = self.sent.get(kind, 0.0) + sent
        self.messages.setdefault(kind, []).append(payload)


def _ask_engines(fn: Any, per_rank_args: list[tuple], timeout_s: float) -> list[Any]:
    pool = cluster.current_pool()
    if pool is None:
        raise RuntimeError("no engine pool: start one (%smp_cluster start) and run first")
    ids = pool.engine_ids
    if len(per_rank_args) > len(ids):
        raise ValueError(f"{len(per_rank_args)} ranks but the pool has {len(ids)} engines")
    tasks = [pool.client[ids[r]].apply_async(fn, *args) for r, args in enumerate(per_rank_args)]
    return [task.get(timeout=timeout_s) for task in tasks]


def measure_traffic(result: Any, *, timeout_s: float = 60.0) -> dict[int, list[StepTraffic]]:
    """Each rank's collectives per step of `result`, a finished run on the current pool, read
    from its engines' flight recorders (ask soon after the run: each keeps its last 2000).
    The first step's window also holds the run's set-up (DDP's broadcast of the parameters)."""
    ends: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for record in result.metrics:
        if keys.TIME in record.values:
            ends[record.rank].append((record.values[keys.TIME], record.step))
    if not ends:
        raise ValueError("the result has no step's metrics: did the run finish a step?")
    # from the run's submission (its first step's end less the time to it): a window that
    # began earlier took in the last collectives of a run just before on the same engines
    first_end = min(t for rank in ends.values() for t, _ in rank)
    since_ns = int((first_end - result.time_to_first_step_s) * 1e9)
    ranks = sorted(ends)
    found = _ask_engines(collectives_since, [(since_ns,) for _ in ranks], timeout_s)
    if any(f is None for f in found):
        raise RuntimeError("this torch build has no flight recorder: nothing to measure from")
    return {
        rank: _by_step(sorted(ends[rank]), _this_run(collectives, first_end), result.engines)
        for rank, collectives in zip(ranks, found)
    }


def _this_run(collectives: list[dict[str, Any]], first_end: float) -> list[dict[str, Any]]:
    """The collectives of the run's own process groups: its default group is the newest one
    that was used before its first step ended (a group made later is one of the run's
    subgroups); a run just before on the same engines used an older one."""
    defaults = [
        c["pg_id"] for c in collectives if c.get("default") and c["time_ns"] / 1e9 <= first_end
    ]
    if not defaults:
        return collectives
    run_group = max(defaults)
    return [c for c in collectives if c.get("pg_id", run_group) >= run_group]


def _by_step(
    ends: list[tuple[float, int]], collectives: list[dict[str, Any]], world_size: int
) -> list[StepTraffic]:
    steps = [StepTraffic(step) for _, step in ends]
    for c in collectives:
        t = c["time_ns"] / 1e9
        index = next((i for i, (end, _) in enumerate(ends) if t <= end), None)
        if index is not None:  # after the last step's end: not the run's
            steps[index].add(c, world_size)
    return steps


def typical_step(steps: list[StepTraffic], *, skip: int = 1) -> dict[str, float]:
    """Bytes sent per kind in a step after the first `skip` (set-up), the median over them."""
    later = steps[skip:]
    if not later:
        raise ValueError(f"the run has {len(steps)} step(s): none after the first {skip}")
    kinds = sorted({k for s in later for k in s.sent})
    return {k: statistics.median(s.sent.get(k, 0.0) for s in later) for k in kinds}


# -- an all-reduce against its size ---------------------------------------------------------


def all_reduce_benchmark(
    sizes: list[int], *, engines: int = 2, repeats: int = 5, timeout_s: float = 120.0
) -> dict[int, float]:
    """Seconds of an fp32 all-reduce of each size (bytes) between the first `engines` engines
    of the pool, on a gloo group of their own: each repeat's slowest rank, the median of the
    repeats (the engines meet at a barrier before each)."""
    import torch.distributed as dist

    if engines < 2:
        raise ValueError(f"engines={engines}: an all-reduce needs at least 2")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pool = cluster.current_pool()
    if pool is not None and pool.multi_host:
        raise ValueError("the benchmark hosts its store on 127.0.0.1: engines on one host only")
    args = [(r, engines, "127.0.0.1", store.port, list(sizes), repeats) for r in range(engines)]
    rows = _ask_engines(_bench, args, timeout_s)
    return {
        size: statistics.median(max(rank[i][j] for rank in rows) for j in range(repeats))
        for i, size in enumerate(sizes)
    }


def _bench(rank: int, world: int, address: str, port: int, sizes: list[int], repeats: int) -> Any:
    """On an engine: all_reduce_seconds with its keyword (ipyparallel passes positionals)."""
    return all_reduce_seconds(rank, world, address, port, sizes, repeats=repeats)


@dataclass(frozen=True)
class AlphaBeta:
    """t(n) = alpha + n x beta: a message's latency (s) and seconds per byte."""

    alpha_s: float
    beta_s_per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte

    @property
    def gb_per_s(self) -> float:
        """1 / beta: the bandwidth a large message sees (an all-reduce's algorithm bandwidth)."""
        return 1 / self.beta_s_per_byte / 1e9

    @property
    def half_bytes(self) -> float:
        """The size whose bandwidth term equals the latency: alpha / beta."""
        return self.alpha_s / self.beta_s_per_byte


def fit_alpha_beta(times: dict[int, float]) -> AlphaBeta:
    """t = alpha + n x beta fitted to (size in bytes, seconds) pairs by least squares of the
    *relative* residuals, (alpha + n beta - t) / t: message sizes span orders of magnitude, and
    a plain fit would let the largest messages' noise (a busy core adds milliseconds) decide
    alpha, which the small ones measure. Raises ValueError for fewer than 2 sizes."""
    if len(times) < 2 or any(t <= 0 for t in times.values()):
        raise ValueError(f"times={times!r}: the fit needs 2 sizes or more, each with seconds > 0")
    w = {n: 1 / t**2 for n, t in times.items()}
    s, sn = sum(w.values()), sum(w[n] * n for n in times)
    snn = sum(w[n] * n * n for n in times)
    st, snt = sum(w[n] * t for n, t in times.items()), sum(w[n] * n * t for n, t in times.items())
    det = s * snn - sn * sn
    if det <= 0:
        raise ValueError(f"sizes {sorted(times)}: the fit needs 2 different sizes")
    return AlphaBeta((snn * st - sn * snt) / det, (s * snt - sn * st) / det)
