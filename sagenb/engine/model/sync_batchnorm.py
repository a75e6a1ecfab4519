"""BatchNorm over the global batch: the statistics of every data-parallel replica together.

Plain BatchNorm in a data-parallel run normalises each engine's share of the batch with that
share's own mean and variance, so the model drifts from the one a single process trains on the
whole batch (sagenb issue 15). torch.nn.SyncBatchNorm fixes this on GPUs but refuses CPU
tensors (its kernels, torch.batch_norm_stats and friends, exist for CUDA only), so on the CPU
(gloo) the modules here do the same math with plain tensor ops.

The math is that of torch.nn.modules._functions.SyncBatchNorm (torch 2.x):

forward: each rank sums x and x**2 over every dimension but the channels and counts its
    values; one all-reduce gives the global sums, hence the global mean and (biased) variance
    that normalise every rank's share. Sums are taken in float64, so that `sumsq/n - mean**2`
    loses nothing a float32 BatchNorm would keep.
backward: with xmu = x - mean, each rank reduces sum(dy) and sum(dy * xmu) locally; the
    weight and bias gradients are those local sums (DDP / FSDP average them like any
    parameter's), and one all-reduce of the two gives the input gradient
    (dy - mean(dy) - xmu * invstd**2 * mean(dy * xmu)) * invstd * weight, the means taken over
    the global count: the gradient of the loss summed over ranks, which the data-parallel
    average then divides by the number of replicas, as for every other parameter.

The running statistics are updated with the global mean and the unbiased global variance
(n / (n - 1) over the global count), with BatchNorm's momentum (or the cumulative average when
momentum is None) and num_batches_tracked, so every rank's state_dict is one process's. In eval
mode, or with no process group, it is plain BatchNorm: evaluation splits the eval set unevenly
across ranks, and a collective there would wait forever.
"""

from __future__ import annotations

import functools
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from sagenb.engine.torch_private import BatchNormBase, check_batchnorm_input

__all__ = ["GlobalBatchNorm", "sync_batchnorm", "batchnorm_layers"]


def batchnorm_layers(model: nn.Module) -> list[str]:
    """The qualified names of model's BatchNorm layers (1d, 2d, 3d, lazy, sync)."""
    return [name for name, m in model.named_modules() if isinstance(m, BatchNormBase)]


def sync_batchnorm(model: nn.Module, *, device: torch.device, group: Any = None) -> nn.Module:
    """Make every BatchNorm of `model` normalise over the whole batch of `group`'s ranks
    (default: every rank); returns the model (a new root only when the root is a BatchNorm).

    On CUDA: torch's own nn.SyncBatchNorm.convert_sync_batchnorm (fused kernels, nccl). On the
    CPU: each layer's class becomes a GlobalBatchNorm subclass of its own class, in place, so
    it keeps its parameters, buffers, names (state_dict keys), hooks and isinstance checks.
    """
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    for module in model.modules():
        if isinstance(module, BatchNormBase) and not isinstance(module, GlobalBatchNorm):
            _make_global(module, group)
    return model


def _make_global(module: BatchNormBase, group: Any) -> None:
    wrapped = module.__dict__.get("forward")  # e.g. recompute.checkpoint_blocks' wrapper
    # a class is hashable; mypy says no when it defines __hash__ (python/mypy#11470)
    module.__class__ = _global_class(type(module))  # type: ignore[arg-type]
    module.process_group = group
    if _wraps_own_forward(wrapped, module):  # it calls the old class's forward: rewrap
        new_forward = type(module).forward.__get__(module)
        # an instance attribute over the class's forward, where the replaced wrapper was
        module.forward = functools.partial(  # type: ignore[method-assign]
            wrapped.func, new_forward, *wrapped.args[1:], **wrapped.keywords
        )


def _wraps_own_forward(wrapped: Any, module: nn.Module) -> TypeGuard[functools.partial[Any]]:
    return (
        isinstance(wrapped, functools.partial)
        and bool(wrapped.args)
        and getattr(wrapped.args[0], "__self__", None) is module
    )


@functools.cache
def _global_class(cls: type) -> type:
    return type(f"Global{cls.__name__}", (GlobalBatchNorm, cls), {"__module__": __name__})


class GlobalBatchNorm(BatchNormBase):
    """A BatchNorm whose training-mode statistics are those of the whole data-parallel batch.

    Not built directly: sync_batchnorm turns an existing BatchNorm1d/2d/3d into one."""

    process_group: Any = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        check_batchnorm_input(self, input)
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:  # as _BatchNorm.forward counts and averages
            # _BatchNorm registers these buffers (else None) exactly when track_running_stats
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        mean, var, count = _global_stats(input, self.process_group)
        if self.track_running_stats:
            assert self.running_mean is not None and self.running_var is not None
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        invstd = torch.rsqrt(var + self.eps)
        return _GlobalBatchNormFn.apply(
            input, self.weight, self.bias, mean, invstd, count, self.process_group
        )


def _channel_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against an (N, C, ...) tensor of `dim` dims."""
    return t.view(1, -1, *([1] * (dim - 2)))


@torch.no_grad()
def _global_stats(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean and biased variance per channel over every rank's x (float64), and the count."""
    dims = [0, *range(2, x.dim())]
    x64 = x.to(torch.float64)
    sums = torch.cat(
        [x64.sum(dims), x64.square().sum(dims), x64.new_tensor([x.numel() / x.shape[1]])]
    )
    dist.all_reduce(sums, group=group)  # one collective: sum, sum of squares, count
    channels, count = x.shape[1], float(sums[-1])
    if count <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {count:.0f} over "
            "every data-parallel engine: raise --batch-size"
        )
    mean = sums[:channels] / count
    var = (sums[channels : 2 * channels] / count - mean.square()).clamp_min(0)
    return mean, var, count


class _GlobalBatchNormFn(torch.autograd.Function):
    """Normalise with the global statistics; backward all-reduces the gradient terms (see
    the module docstring). mean and invstd come in without a graph: backward's formula
    accounts for their dependence on x, on every rank."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, group):
        scale = invstd if weight is None else invstd * weight.detach().double()
        shift = -mean * scale if bias is None else bias.detach().double() - mean * scale
        view = functools.partial(_channel_view, dim=x.dim())
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group, ctx.count = group, count
        return x * view(scale.to(x.dtype)) + view(shift.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        dims, view = [0, *range(2, x.dim())], functools.partial(_channel_view, dim=x.dim())
        dy = grad_out.to(torch.float64)
        xmu = x.to(torch.float64) - view(mean)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        # weight and bias: the local sums; DDP / FSDP average them across ranks like any gradient
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:  # alike on every rank (the same model): collectives match
            both = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(both, group=ctx.group)
            mean_dy, mean_dy_xmu = (both / ctx.count).chunk(2)
            w = invstd if weight is None else invstd * weight.detach().double()
            grad_input = (
                (dy - view(mean_dy) - xmu * view(invstd.square() * mean_dy_xmu)) * view(w)
            ).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
