"""The job every peer trains: the same model, data, sample order, batch and steps."""

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


def local_batch(data, order, step: int, rank: int, world: int):
    """This rank's contiguous share of global batch `step` (the order sagenb uses)."""
    share = BATCH // world
    idx = order[step * BATCH : (step + 1) * BATCH][rank * share : (rank + 1) * share]
    return tuple(t[idx] for t in data.tensors)


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
