"""The hand-written peer: plain DDP under torchrun, the same job and sample order as sagenb.

    torchrun --nproc-per-node 2 benchmarks/peers/ddp_script.py --threads 1

Prints one JSON line (rank 0): the end time of every step, and when the first one ended.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
from workload import CELL, STEPS, local_batch  # noqa: E402


def main() -> None:
    started = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ns: dict = {}
    exec(CELL, ns)
    model = DistributedDataParallel(ns["model"])
    opt = ns["make_optimizer"](list(model.parameters()))
    data, loss_fn = ns["dataset"], ns["loss_fn"]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    stamps = []
    for step in range(STEPS):
        x, y = local_batch(data, order, step, rank, world)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.time())
    if rank == 0:
        print(json.dumps({"started": started, "stamps": stamps}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
