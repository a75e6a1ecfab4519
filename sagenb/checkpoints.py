"""Reading a sagenb checkpoint in one process, without engines."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from sagenb.engine.checkpoint import latest

__all__ = ["load_checkpoint"]


def load_checkpoint(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state_dict (keys of `model.state_dict()`) of the newest checkpoint in
    `directory`, whatever strategy wrote it; loaded with `torch.load(weights_only=True)`."""
    path = latest(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "checkpoint.pt"
        dcp_to_torch_save(path, flat)
        state = torch.load(flat, weights_only=True)
    model = {k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")}
    return {k: model[k] for k in state["key_order"]}
