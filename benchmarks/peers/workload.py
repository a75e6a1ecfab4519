"""The jobs every peer trains: the same model, data, sample order, batch and steps.

`WORKLOADS` are the three losses people train with, each a cell sagenb runs and the peers
exec: integer class targets with nn.CrossEntropyLoss (a classifier), dict batches with a
transformers causal LM's own loss (labels with -100 where a prompt is left out), and float
targets with mse_loss (a regression). Integer targets pay sagenb's counted-target weighting
(sagenb/engine/objective.py); float targets count samples, known without looking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                      nn.Linear(1024, 1))
X = torch.randn(65536, 512)
dataset = torch.utils.data.TensorDataset(X, X[:, :1] * X[:, 1:2])
loss_fn = nn.functional.mse_loss
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)
"""
BATCH = 256
STEPS = 200
WARMUP = 5  # steps left out of the rate (first calls pay for allocation)

CLASSIFY_CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10))
X = torch.randn(40960, 512)
dataset = torch.utils.data.TensorDataset(X, (X[:, :10] ** 2).argmax(1))
loss_fn = nn.CrossEntropyLoss()
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)
"""

CAUSAL_LM_CELL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))
ids = torch.randint(0, 256, (8192, 64))
labels = ids.clone()
labels[:, :8] = -100  # a prompt the loss leaves out
dataset = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
"""


@dataclass(frozen=True)
class Workload:
    """One job: its cell, global batch and steps."""

    cell: str
    batch: int
    steps: int
    #: what the results call it
    title: str


WORKLOADS = {
    "classify": Workload(
        CLASSIFY_CELL, 128, 300, "MLP 512-1024-1024-10, CrossEntropyLoss, integer classes"
    ),
    "causal_lm": Workload(
        CAUSAL_LM_CELL, 32, 150, "tiny Llama (2 layers, hidden 128), its own loss, dict batches"
    ),
    "regress": Workload(CELL, BATCH, STEPS, "MLP 512-1024-1024-1, mse_loss, float targets"),
}


def local_batch(data, order, step: int, rank: int, world: int, batch: int = BATCH):
    """This rank's contiguous share of global batch `step` (the order sagenb uses): a
    TensorDataset indexed in one go, other samples collated by default_collate (as sagenb
    loads them)."""
    share = batch // world
    idx = order[step * batch : (step + 1) * batch][rank * share : (rank + 1) * share]
    if isinstance(data, torch.utils.data.TensorDataset):
        return tuple(t[idx] for t in data.tensors)
    return torch.utils.data.default_collate([data[i] for i in idx.tolist()])


def rate(stamps: list[float], batch: int = BATCH, warmup: int = WARMUP) -> float:
    """Samples per second between the end of step `warmup` and the end of the last step."""
    span = stamps[-1] - stamps[warmup - 1]
    return (len(stamps) - warmup) * batch / span


# The pipeline benchmarks' job: compute-heavy blocks, so that a microbatch's work (~10 ms a
# stage) dwarfs its transfers. 9 blocks; sagenb's uniform cut for 2 stages starts stage 1 at
# block 4 (the peer script cuts there too).
PIPELINE_CELL = """
import torch
from torch import nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(8)],
                      nn.Linear(1024, 1))
X = torch.randn(4096, 1024)
dataset = torch.utils.data.TensorDataset(X, X[:, :1])
loss_fn = nn.functional.mse_loss
"""
PIPELINE_CUT = 4
