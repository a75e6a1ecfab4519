"""The hand-written peer of `--strategy model --partitions 2`: torch.distributed.pipelining
under torchrun, the same model, cut, batch, microbatches and optimizer as sagenb's run.

    torchrun --nproc-per-node 2 benchmarks/peers/pipeline_script.py --schedule gpipe \\
        --microbatches 4 --steps 60 --threads 1

Written as its documentation shows: a PipelineStage per rank and ScheduleGPipe / Schedule1F1B
(which scale the gradients by 1 / microbatches themselves). Prints one JSON line (rank 0): the
end time of every step.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, str(Path(__file__).parent))
from workload import PIPELINE_CELL, PIPELINE_CUT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ns: dict = {}
    exec(PIPELINE_CELL, ns)
    blocks = list(ns["model"])
    part = nn.Sequential(*(blocks[:PIPELINE_CUT] if rank == 0 else blocks[PIPELINE_CUT:]))
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = cls(stage, args.microbatches, loss_fn=ns["loss_fn"])
    # sagenb's default optimizer (engine/loop.py default_optimizer), so both sides step alike
    opt = torch.optim.AdamW(part.parameters(), lr=1e-3, fused=True)
    data = ns["dataset"].tensors
    batch = 128 * args.microbatches
    order = torch.randperm(len(data[0]), generator=torch.Generator().manual_seed(0))
    stamps = []
    for step in range(args.steps):
        idx = order[(step * batch) % len(order) :][:batch]
        if rank == 0:
            schedule.step(data[0][idx])
        else:
            losses: list = []
            schedule.step(target=data[1][idx], losses=losses)
            float(torch.stack(losses).detach().mean())  # the loss a user would log
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.time())
    if rank == 0:
        print(json.dumps({"stamps": stamps}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
