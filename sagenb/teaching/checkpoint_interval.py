"""How often to checkpoint: Young's and Daly's intervals, and the time a choice wastes.

Notebook 05 measures what a checkpoint write costs (`checkpoint_write(s)`, each step that wrote
one) and assumes a mean time between failures; from the two:

- Young's interval, sqrt(2 C M) for a write cost C and a mean time between failures M
  (J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9), 1974);
- Daly's refinement, sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C for C < 2M, and M
  past that (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
  restart dumps", Future Generation Computer Systems 22(3), 2006, eq. 37);
- the share of the wall-clock time wasted with a compute interval tau between checkpoints,
  under failures that arrive at random (exponentially, mean M), from Daly's model of the
  expected wall time: T_wall = M e^(R/M) (e^((tau + C)/M) - 1) T_solve / tau, R the time a
  restart takes (Daly 2006, eq. 13). The waste is 1 - T_solve / T_wall: the writes, the work
  computed again after each failure, the restarts.

A failure rate for a large cluster, as an assumption a notebook can state: Meta's Llama 3
pre-training saw 419 unexpected interruptions in a 54-day snapshot on up to 16,384 GPUs
(Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, 2024, section 3.3.4), about one
every 3 hours, i.e. one per ~51,000 GPU-hours (`LLAMA3_GPU_HOURS_PER_FAILURE`).

Notebook-side: plain arithmetic, no engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "LLAMA3_GPU_HOURS_PER_FAILURE",
    "job_mtbf_s",
    "young_interval",
    "daly_interval",
    "waste",
    "waste_table",
]

#: 16,384 GPUs x 54 days x 24 h / 419 unexpected interruptions (Llama 3 paper, section 3.3.4)
LLAMA3_GPU_HOURS_PER_FAILURE = 16_384 * 54 * 24 / 419


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive number of seconds")
    return value


def job_mtbf_s(gpus: int, *, gpu_hours_per_failure: float = LLAMA3_GPU_HOURS_PER_FAILURE) -> float:
    """The mean time between failures of a job on `gpus` GPUs, in seconds, when each GPU (with
    its share of the hosts, network and storage) fails once per `gpu_hours_per_failure` and
    one failure stops the whole synchronous job."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: must be a whole number of GPUs, at least 1")
    return _positive("gpu_hours_per_failure", gpu_hours_per_failure) * 3600 / gpus


def young_interval(write_s: float, mtbf_s: float) -> float:
    """Young's interval, sqrt(2 C M): seconds of compute between checkpoints."""
    return math.sqrt(2 * _positive("write_s", write_s) * _positive("mtbf_s", mtbf_s))


def daly_interval(write_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (2006, eq. 37): Young's, corrected for the write's own
    time and for failures during it; M itself once C reaches 2M."""
    c, m = _positive("write_s", write_s), _positive("mtbf_s", mtbf_s)
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def waste(interval_s: float, write_s: float, mtbf_s: float, *, restart_s: float = 0.0) -> float:
    """The expected share of the wall-clock time that is not new work, with `interval_s` of
    compute between checkpoints (Daly 2006, eq. 13): 1 - tau / (M e^(R/M) (e^((tau + C)/M) - 1))."""
    tau, c, m = (
        _positive(n, v)
        for n, v in (("interval_s", interval_s), ("write_s", write_s), ("mtbf_s", mtbf_s))
    )
    if not math.isfinite(restart_s) or restart_s < 0:
        raise ValueError(f"restart_s={restart_s!r}: must be a number of seconds, at least 0")
    wall_per_solve = m * math.exp(restart_s / m) * math.expm1((tau + c) / m) / tau
    return 1 - 1 / wall_per_solve


def waste_table(
    write_s: float, mtbf_s: float, intervals_s: Sequence[float], *, restart_s: float = 0.0
) -> str:
    """One line per interval: the interval, and the minutes of each wall-clock hour wasted."""
    lines = ["interval (s)   wasted per hour (min)"]
    for tau in intervals_s:
        wasted = waste(tau, write_s, mtbf_s, restart_s=restart_s) * 60
        lines.append(f"{tau:12.4g}   {wasted:21.2f}")
    return "\n".join(lines)
