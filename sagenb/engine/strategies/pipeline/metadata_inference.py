"""What PipelineStage's metadata inference must not do to a stage.

At its first step PipelineStage runs each stage once more to learn the shapes it sends
(torch/distributed/pipelining/stage.py, _forward_metadata_inference), later stages on
torch.empty inputs. Only shapes are read from that pass; these hooks keep its garbage from
reaching the model's state or from raising.
"""

from __future__ import annotations

import inspect
from types import FrameType
from typing import Any

import torch
from torch import nn

__all__ = ["keep_buffers_through_inference", "zero_indices_through_inference"]


def _inferring() -> bool:
    """Whether this forward runs inside PipelineStage's metadata inference (below)."""
    frame: FrameType | None = inspect.currentframe()  # this one and its callers: none is it
    while frame is not None:
        if frame.f_code.co_name == "_forward_metadata_inference":
            return True
        frame = frame.f_back
    return False


def keep_buffers_through_inference(module: nn.Module) -> None:
    """Undo what PipelineStage's metadata inference does to buffers.

    At its first step PipelineStage runs each stage once more to learn the shapes it sends
    (torch/distributed/pipelining/stage.py, _forward_metadata_inference), later stages on
    torch.empty inputs: a BatchNorm's running statistics would count that pass, filled with
    garbage (inf after one step, measured on a ResNet). Buffers are saved before a forward
    made inside that inference and put back after it; other forwards are left alone."""
    if not any(True for _ in module.buffers()):
        return
    saved: list[dict[str, torch.Tensor]] = []

    def before(mod: nn.Module, args: Any) -> None:
        if _inferring():
            saved.append({k: b.clone() for k, b in mod.named_buffers()})

    @torch.no_grad()
    def after(mod: nn.Module, args: Any, output: Any) -> None:
        if saved:
            state = saved.pop()
            for k, b in mod.named_buffers():
                b.copy_(state[k])

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def zero_indices_through_inference(module: nn.Module) -> None:
    """Give that inference's forward zeros for the integer tensors it would get as
    torch.empty: labels carried to the last stage (the model's own loss, computed there),
    token or position ids. Garbage there is out of range for cross_entropy or an embedding
    and raises; 0 is a valid class and index, and only shapes are read from this pass."""

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not _inferring():
            return None
        args, kwargs = tuple(_zeroed(a) for a in args), {k: _zeroed(v) for k, v in kwargs.items()}
        return args, kwargs

    module.register_forward_pre_hook(before, with_kwargs=True)


def _zeroed(value: Any) -> Any:
    if torch.is_tensor(value) and not (value.is_floating_point() or value.is_complex()):
        return torch.zeros_like(value)
    return value
