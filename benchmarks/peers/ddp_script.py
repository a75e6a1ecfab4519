"""The hand-written peer: plain DDP under torchrun, the same job and sample order as sagenb.

    torchrun --nproc-per-node 2 benchmarks/peers/ddp_script.py --threads 1 [--workload classify]

Prints one JSON line (rank 0): the end time of every step, and when the first one ended. With
--profile PATH, rank 0's steps after the warm-up run under cProfile, its stats written to PATH.
"""

import argparse
import cProfile
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
from workload import WARMUP, WORKLOADS, local_batch  # noqa: E402


def main() -> None:
    started = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workload", default="regress", choices=sorted(WORKLOADS))
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = WORKLOADS[args.workload]
    torch.manual_seed(0)
    ns: dict = {}
    exec(work.cell, ns)
    model = DistributedDataParallel(ns["model"])
    opt = ns["make_optimizer"](list(model.parameters()))
    data, loss_fn = ns["dataset"], ns.get("loss_fn")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    stamps = []
    for step in range(work.steps):
        if profiler is not None and step == WARMUP:
            profiler.enable()
        batch = local_batch(data, order, step, rank, world, work.batch)
        if loss_fn is None:  # dict samples: the model's own loss
            loss = model(**batch).loss
        else:
            x, y = batch
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.time())
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    if rank == 0:
        print(json.dumps({"started": started, "stamps": stamps}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
