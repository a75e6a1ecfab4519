"""A single-process reference, written with plain torch from the contract in docs/contract.md.

Deliberately independent of sagenb's engine code: if the engine's sample order, accumulation,
clipping or scheduling drifted from the contract, the comparison with this would fail. With a
`collate_fn` in the cell it collates the whole global batch at once (each slice with
`grad_accum`), as one process would, where the engines collate each piece of it on their own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch

#: torch threads of each engine of the tests' 2-engine local pool (TrainConfig.threads_per_engine:
#: the machine's cores shared by its engines). The reference computes with as many: a convolution's
#: backward sums in another order with another thread count, and on some CPUs of the CI's kind a
#: ResNet's parameters then differed by 5.2e-5 after 8 steps (2.4e-7 at the engines' count).
POOL_THREADS = max(1, (os.cpu_count() or 1) // 2)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def namespace(cell: str, seed: int, delay_init: bool = False) -> dict:
    torch.manual_seed(seed)
    ns: dict = {}
    if not delay_init:
        exec(cell, ns)
        return ns
    # --delay-init defines its own initial values (sagenb/engine/model/delayed.py): take them from
    # there, materialising the whole model in this one process; the training below is plain
    from sagenb.engine.model.delayed import materialize, meta_parameters

    with meta_parameters():
        exec(cell, ns)
    materialize(ns["model"], [ns["model"]], seed=seed, device=torch.device("cpu"))
    return ns


def contract_order(n: int, seed: int):
    """The contract's order of range(n) for seed + epoch, as order(start, stop) -> indices:
    torch.randperm up to 2**22 samples, above it the Feistel permutation as docs/contract.md states
    it, recomputed here in plain Python integers, one position at a time."""
    if n <= 2**22:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return lambda start, stop: perm[start:stop]
    return lambda start, stop: torch.tensor([feistel_index(i, n, seed) for i in range(start, stop)])


def feistel_index(i: int, n: int, seed: int) -> int:
    h = (max(1, (n - 1).bit_length()) + 1) // 2
    keys, s = [], seed % 2**64
    for _ in range(6):  # splitmix64, the top 32 bits of each output
        s = (s + 0x9E3779B97F4A7C15) % 2**64
        z = (s ^ (s >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
        keys.append((z ^ (z >> 31)) // 2**32)
    while True:  # cycle-walking: apply the network until the value is below n
        left, right = i // 2**h, i % 2**h
        for k in keys:
            x = right ^ k
            for _ in range(2):
                x = (x ^ (x >> 16)) * 0x45D9F3B % 2**32
            left, right = right, left ^ ((x ^ (x >> 16)) % 2**h)
        i = left * 2**h + right
        if i < n:
            return i


def batch(dataset, idx, collate_fn=None):
    """The samples at `idx` as one batch (`of_samples`)."""
    return of_samples([dataset[i] for i in idx.tolist()], collate_fn)


def of_samples(samples, collate_fn=None):
    """`samples` as one batch: made by the cell's `collate_fn` when it has one (its Mapping,
    such as transformers' BatchEncoding, read as a dict), else stacked."""
    if collate_fn is not None:
        made = collate_fn(samples)
        return dict(made) if isinstance(made, Mapping) else made
    if isinstance(samples[0], dict):
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    xs, ys = zip(*samples)
    return torch.stack(xs), torch.stack(ys)


def loss_of(model, loss_fn, data):
    """One forward over `data`: loss_fn(model(x), y) for tuples; for dicts, model(**inputs)
    and loss_fn(logits, labels), or the model's own loss when loss_fn is None."""
    if not isinstance(data, dict):
        x, y = data
        return loss_fn(model(x), y) if loss_fn is not None else _own(model(x, y))
    if loss_fn is None:
        return _own(model(**data))
    inputs = {k: v for k, v in data.items() if k != "labels"}
    out = model(**inputs)
    logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)
    return loss_fn(logits, data["labels"])


def _own(output):
    """The model's own loss: transformers' `.loss`, or the loss of a (logits, loss) tuple."""
    return output[1] if isinstance(output, tuple) else output.loss


def eval_loss(model, dataset, loss_fn, collate_fn=None) -> float:
    """The loss over the whole of `dataset` in one forward (collated at once)."""
    model.eval()
    with torch.no_grad():
        data = batch(dataset, torch.arange(len(dataset)), collate_fn)
        value = float(loss_of(model, loss_fn, data))
    model.train()
    return value


def train_reference(
    cell: str,
    *,
    batch_size: int,
    epochs: int = 1,
    steps: int | None = None,
    lr: float = 1e-3,
    seed: int = 0,
    grad_accum: int = 1,
    clip_grad_norm: float | None = None,
    delay_init: bool = False,
    threads: int = POOL_THREADS,
) -> tuple[torch.nn.Module, list[float], dict]:
    """Returns the trained model, the loss of every step and the cell's namespace, computed
    with `threads` torch threads (those of the engines it is compared with)."""
    with torch_threads(threads):
        return _train(
            cell,
            batch_size=batch_size,
            epochs=epochs,
            steps=steps,
            lr=lr,
            seed=seed,
            grad_accum=grad_accum,
            clip_grad_norm=clip_grad_norm,
            delay_init=delay_init,
        )


def _train(
    cell: str,
    *,
    batch_size: int,
    epochs: int,
    steps: int | None,
    lr: float,
    seed: int,
    grad_accum: int,
    clip_grad_norm: float | None,
    delay_init: bool,
) -> tuple[torch.nn.Module, list[float], dict]:
    ns = namespace(cell, seed, delay_init)
    model, dataset, loss_fn = ns["model"], ns["dataset"], ns.get("loss_fn")
    collate_fn = ns.get("collate_fn")
    params = list(model.parameters())
    opt = (
        ns["make_optimizer"](params)
        if "make_optimizer" in ns
        else torch.optim.AdamW(params, lr=lr, fused=True)  # the contract's default, on the CPU
    )
    sched = ns["make_scheduler"](opt) if "make_scheduler" in ns else None
    losses: list[float] = []
    for samples in global_batches(dataset, batch_size=batch_size, epochs=epochs, seed=seed):
        if steps is not None and len(losses) == steps:
            return model, losses, ns
        step_loss = 0.0
        # the whole global batch (each slice, with grad_accum) collated at once, padded to
        # its own longest sample by a padding collate_fn
        for piece in torch.arange(len(samples)).chunk(grad_accum):
            loss = loss_of(model, loss_fn, batch(samples, piece, collate_fn))
            (loss / grad_accum).backward()
            step_loss += float(loss.detach()) / grad_accum
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(step_loss)
    return model, losses, ns


def global_batches(dataset, *, batch_size: int, epochs: int, seed: int) -> Iterator[list]:
    """The samples of each global batch, epoch after epoch, as docs/contract.md orders them: a
    map-style dataset in the shuffled order of seed + epoch; a stream (no __len__) read in
    order from its start each epoch (after set_epoch(epoch) where it has one). An incomplete
    last batch is dropped."""
    for epoch in range(epochs):
        if hasattr(dataset, "__len__"):
            n = len(dataset)
            order = contract_order(n, seed + epoch)
            for b in range(n // batch_size):
                yield [dataset[i] for i in order(b * batch_size, (b + 1) * batch_size).tolist()]
            continue
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        pending: list = []
        for item in dataset:
            pending.append(item)
            if len(pending) == batch_size:
                yield pending
                pending = []


def one_process_eval(cell: str, model) -> float:
    """The model's own loss over the whole eval set in one forward: the mean over its tokens."""
    ns = namespace(cell, 0)
    data = batch(ns["eval_dataset"], torch.arange(len(ns["eval_dataset"])))
    model.eval()
    with torch.no_grad():
        return float(model(**data).loss)
