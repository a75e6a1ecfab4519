"""The checks of notebook 10 (10_write_your_own_ddp.ipynb): each answer is a DDP class the
student wrote. The check trains the lab's job with it (`--strategy own`, on the running pool)
and grades the run by what it did, never by a number typed in:

- equivalence: its parameters against torch's DistributedDataParallel on the same job (itself
  proved equal to one process by sagenb's tests), within 1e-5 after the lab's SGD steps;
- traffic: the all-reduces each step made and their bytes, as the flight recorder saw them;
- overlap: the share of the gradient bytes whose all-reduce began before backward ended.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sagenb.metrics import keys
from sagenb.run.session import train
from sagenb.teaching.exercises import WrongAnswer, answered

STEPS, BATCH = 4, 64
ATOL = 1e-5  # SGD on the same averaged gradients: the runs agree to rounding
#: the bucket caps of exercise 3, in MiB (the lab's gradients are 27,688 bytes in all)
BUCKETS_MB = (0.002, 0.01, 1.0)


def lab_job(ddp: Any = None) -> Callable[[], dict[str, Any]]:
    """The lab's job: an MLP classifier (32 features, 10 classes, integer targets) on 256
    samples, SGD with momentum; trained with the DDP class `ddp` under --strategy own."""

    def job() -> dict[str, Any]:
        model = nn.Sequential(
            nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
        )
        X, y = torch.randn(256, 32), torch.randint(0, 10, (256,))

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)

        return {
            "model": model,
            "dataset": torch.utils.data.TensorDataset(X, y),
            "loss_fn": nn.functional.cross_entropy,
            "make_optimizer": make_optimizer,
            "DDP": ddp,
        }

    return job


@functools.cache
def _torch_ddp() -> dict[str, torch.Tensor]:
    """The lab's parameters after torch's DDP trained it: what every answer must equal."""
    run = train(lab_job(), strategy="data", batch_size=BATCH, steps=STEPS, dashboard=False)
    return run.state_dict()


def _wrong(exercise: int, text: str) -> WrongAnswer:
    return WrongAnswer(f"Exercise {exercise}: {text}")


def _graded_run(exercise: int, answer: Any, **options: Any) -> Any:
    """The lab trained with the student's DDP, refused where it is not the reference's."""
    ddp = answer.func if isinstance(answer, functools.partial) else answer
    if not (isinstance(ddp, type) and issubclass(ddp, nn.Module)):
        raise _wrong(exercise, f"expected your DDP class (an nn.Module), got {type(ddp).__name__}")
    try:
        run = train(lab_job(answer), strategy="own", batch_size=BATCH, steps=STEPS, **options)
    except Exception as failed:  # the run's own error, its first line: the cell failed
        first = str(failed).strip().splitlines()[-1][:300]
        raise _wrong(exercise, f"the run with your DDP failed: {first}") from None
    state, expected = run.state_dict(), _torch_ddp()
    diff = max((state[k].double() - v.double()).abs().max().item() for k, v in expected.items())
    if diff > ATOL:
        raise _wrong(
            exercise,
            f"after {STEPS} steps your DDP's parameters differ from torch's DDP by {diff:.1e} "
            f"(at most {ATOL:g}): does it average the gradients over dist.get_world_size(), "
            "and start from rank 0's parameters?",
        )
    return run


def _per_step(run: Any, key: str) -> list[Any]:
    return [m.values[key] for m in run.metrics if key in m.values]


def exercise_1(answer: Any) -> None:
    """One flattened all-reduce a step, equal to torch's DDP."""
    if not answered(answer):
        print("Exercise 1: not answered yet")
        return
    run = _graded_run(1, answer, dashboard=False)
    counts = set(_per_step(run, keys.ALL_REDUCES))
    if counts != {1}:
        raise _wrong(
            1,
            f"{max(counts)} all-reduces a step, not one: flatten every gradient into one "
            "tensor, reduce it, and copy its parts back",
        )
    print("Exercise 1: correct: one all-reduce a step, parameters as torch's DDP's")


def exercise_2(answer: Any) -> None:
    """All-reduces started from the gradients' hooks, overlapping backward."""
    if not answered(answer):
        print("Exercise 2: not answered yet")
        return
    run = _graded_run(2, answer, dashboard=False)
    share = min(_per_step(run, keys.OVERLAPPED))
    if share < 0.5:
        raise _wrong(
            2,
            f"only {share:.0%} of a step's gradient bytes began their all-reduce before "
            "backward ended: start each from its parameter's post-accumulate-grad hook, "
            "async_op=True, and wait in finish_gradient_synchronization()",
        )
    print(f"Exercise 2: correct: {share:.0%} of the gradient bytes at least began in backward")


def buckets(sizes: list[int], cap_bytes: float) -> int:
    """How many buckets the exercise's rule makes of gradients of `sizes` bytes (in the
    order of model.parameters()): taken in reverse, a bucket closes when the next gradient
    would take it past the cap; a gradient larger than the cap is a bucket of its own."""
    count, held = 0, 0
    for size in reversed(sizes):
        if held and held + size > cap_bytes:
            count, held = count + 1, 0
        held += size
    return count + (1 if held else 0)


def exercise_3(answer: Any) -> None:
    """Bucketed all-reduces: as many a step as the rule makes, at each cap."""
    if not answered(answer):
        print("Exercise 3: not answered yet")
        return
    sizes = [p.numel() * 4 for p in lab_job()()["model"].parameters()]
    for cap in BUCKETS_MB:
        run = _graded_run(3, functools.partial(answer, bucket_mb=cap), dashboard=False)
        made, expected = set(_per_step(run, keys.ALL_REDUCES)), buckets(sizes, cap * 2**20)
        if made != {expected}:
            raise _wrong(
                3,
                f"with bucket_mb={cap}: {sorted(made)} all-reduces a step, where the rule "
                f"makes {expected} buckets",
            )
    print(f"Exercise 3: correct: the buckets of the rule at bucket_mb = {list(BUCKETS_MB)}")
