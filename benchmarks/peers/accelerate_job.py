"""The same job through Hugging Face Accelerate's notebook_launcher (an optional peer)."""

import json
import time

import torch
from workload import CELL, STEPS, local_batch


def job(out_path: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ns: dict = {}
    exec(CELL, ns)
    model = ns["model"]
    opt = ns["make_optimizer"](list(model.parameters()))
    model, opt = accelerator.prepare(model, opt)
    data, loss_fn = ns["dataset"], ns["loss_fn"]
    rank, world = accelerator.process_index, accelerator.num_processes
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    stamps = []
    for step in range(STEPS):
        x, y = local_batch(data, order, step, rank, world)
        accelerator.backward(loss_fn(model(x), y))
        opt.step()
        opt.zero_grad()
        stamps.append(time.time())
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"stamps": stamps}, f)
