"""Mixed precision (`--precision`): autocast for the forward, a loss scaler for fp16.

Parameters, gradients and optimizer state stay fp32 whatever the precision; only the forward's
matmuls and convolutions run in bf16 or fp16 under `torch.autocast` (torch's AMP recipe). bf16
has fp32's exponent range and needs no scaling. fp16 does: small gradients underflow to zero,
so the loss is multiplied by a scale S before backward and the gradients divided by S before
clipping and the optimizer step. The scaler is the dynamic one of torch.amp.GradScaler
(start 2**16, halve and skip the step on inf/nan, double after 2000 clean steps), written here
so that the skip decision is one all-reduce over every rank, whatever the strategy: a step
skipped on one shard must be skipped on all.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from sagenb.config.errors import ConfigError
from sagenb.engine.strategies.dtensors import local

__all__ = ["autocast", "check_supported", "LossScaler", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_supported(precision: str, device: torch.device) -> None:
    """Raise a ConfigError naming the option when this engine's device lacks `precision`."""
    if precision == "fp32":
        return
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            "precision", precision, f"{name} has no bf16 support; use fp16 (loss-scaled) or fp32"
        )
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError("precision", precision, f"no autocast on {device.type}; use fp32")


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The forward's context: autocast to bf16/fp16, or nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


class LossScaler:
    """Dynamic loss scaling for fp16, agreed across every rank."""

    def __init__(
        self, *, init_scale: float = 2.0**16, growth_interval: int = 2000, device: torch.device
    ) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.device = device
        self._clean_steps = 0

    def unscale(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; return whether all are finite on every rank
        (when not, the caller skips the optimizer step and the scale is halved)."""
        grads = [local(p.grad) for p in params if p.grad is not None]
        bad = torch.zeros((), device=self.device)
        for g in grads:
            g.div_(self.scale)
            bad += (~torch.isfinite(g)).any().float()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        finite = bool(bad == 0)
        if not finite:
            self.scale /= 2
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps % self.growth_interval == 0:
                self.scale *= 2
        return finite
