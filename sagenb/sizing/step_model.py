"""One optimizer step's time on an instance, and whether each rank fits its memory, from a
footprint's FLOPs and bytes (footprint.py) and the hardware table
(hardware.py). Plain arithmetic: no engine, no tensor, no plotly.

Compute: the step's FLOPs shared equally by the ranks, at the accelerator's peak for the
precision times a model FLOPs utilisation (MFU) range. 0.3-0.5 is what well-tuned dense
transformer training reaches on A100s: PaLM reports 46.2% MFU for PaLM 540B and recomputes
21.3% for GPT-3 and 30.2% for Megatron-Turing NLG (Chowdhery et al. 2022, arXiv:2204.02311,
section 4.1 and Table 3); Megatron-LM sustains 52% of peak on 3072 A100s (Narayanan et al.
2021, arXiv:2104.04473). Small models and small batches per rank sit below the range.

Communication: each rank's bytes per step over the link it crosses. Within one instance a
collective runs at the accelerators' link (NVLink/NVSwitch, or PCIe); once a run spans
instances, a ring collective is as slow as its inter-instance hops, where every rank of an
instance shares the instance's network (inter Gbit/s / engines per instance). Pipeline
point-to-point stays inside an instance when each pipeline does (ranks are replica-major:
rank = replica x partitions + stage, engine/strategies/pipeline/strategy.py). So do the
collectives a strategy runs only within groups of consecutive ranks (its description's
`inner_collectives`: hybrid sharding's gathers and reduce-scatters) when each instance holds
whole groups; its all-reduce across the groups crosses the network.

The range: low = compute at the high MFU, with communication hidden behind it (DDP's
gradient buckets and FSDP's prefetch overlap backward); high = compute at the low MFU plus
all communication, none hidden. A pipeline's compute is stretched by its bubble
(the strategy description's `bubble`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sagenb.config.options import describe
from sagenb.metrics import keys
from sagenb.sizing.hardware import Hardware

__all__ = [
    "MFU_RANGE",
    "MEMORY_OVERHEAD_GIB",
    "MEMORY_USABLE_FRACTION",
    "StepTime",
    "memory_limit_mib",
    "rank_total_mib",
    "step_time",
    "bandwidths",
]

#: model FLOPs utilisation, (low, high): see the module's docstring for the sources
MFU_RANGE = (0.3, 0.5)
#: what a CUDA process holds before the model: the CUDA context and cuBLAS/NCCL workspaces
#: (about 0.5-1 GiB on an A100)
MEMORY_OVERHEAD_GIB = 1.0
#: the part of the rest that tensors can use: the caching allocator's fragmentation and the
#: transient buffers of forward and backward take the other 10% (an assumption, stated)
MEMORY_USABLE_FRACTION = 0.9
GB = 1e9
MIB = 2**20
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def memory_limit_mib(hw: Hardware) -> float:
    """The MiB of parameters, gradients, optimizer state and activations one rank may hold."""
    return (hw.memory_gib - MEMORY_OVERHEAD_GIB) * MEMORY_USABLE_FRACTION * 1024


def rank_total_mib(rank: dict[str, float]) -> float:
    return sum(rank.get(keys.memory(kind), 0.0) for kind in keys.MEMORY_KINDS)


@dataclass(frozen=True)
class StepTime:
    """One optimizer step, in seconds, and what it is made of."""

    #: compute of the slowest rank at the high and at the low MFU (bubble included)
    compute_s: tuple[float, float]
    #: the slowest rank's communication, none of it hidden
    comm_s: float
    #: the pipeline's idle fraction (0 without a pipeline)
    bubble: float
    #: GB/s of a collective and of point-to-point, per rank
    collective_gb_s: float
    p2p_gb_s: float

    @property
    def range_s(self) -> tuple[float, float]:
        low = max(self.compute_s[0], self.comm_s)
        return low, self.compute_s[1] + self.comm_s


def bandwidths(hw: Hardware, config: Any, world_size: int) -> tuple[float, float]:
    """(collective GB/s, point-to-point GB/s) one rank gets, as the module's docstring says."""
    per = hw.engines_per_instance
    inter = hw.inter_gbit_s / 8 / per  # the instance's network, shared by its engines
    intra = hw.intra_gb_s if hw.intra_gb_s is not None else inter
    collective = intra if world_size <= per else min(intra, inter)
    partitions = getattr(config, "partitions", 1)
    pipeline_inside = partitions <= per and per % partitions == 0
    return collective, (intra if pipeline_inside else min(intra, inter))


def step_time(fp: Any, hw: Hardware, config: Any, *, bubble: float = 0.0) -> StepTime:
    """The step time of footprint `fp` on `hw`, for `config`'s precision."""
    peak = hw.peak(config.precision)
    if peak is None:  # check_hardware refuses this first; a direct caller gets the reason
        raise ValueError(f"{hw.name} has no {config.precision} peak")
    per_rank = fp.flops_per_step / fp.world_size / (peak * 1e12)
    stretch = 1 / (1 - bubble) if bubble < 1 else math.inf
    compute = (per_rank / MFU_RANGE[1] * stretch, per_rank / MFU_RANGE[0] * stretch)
    collective, p2p = bandwidths(hw, config, fp.world_size)
    group, kinds = describe(config.strategy).inner_collectives(config, fp.world_size)
    inner = bandwidths(hw, config, group)[0] if hw.engines_per_instance % group == 0 else collective
    speed = {k: (inner if k in kinds else collective) * GB for k in COLLECTIVES}
    comm = max(
        (
            sum(b / speed[k] for k, b in sent.items() if k in COLLECTIVES)
            + sent.get("p2p", 0.0) / (p2p * GB)
            for sent in fp.comm_bytes_per_step
        ),
        default=0.0,
    )
    return StepTime(compute, comm, bubble, collective, p2p)
