"""Model cells shared by the tests: an nn.Sequential and two small GPTs."""

from sagenb.examples import gpt_cell

SEQUENTIAL_CELL = """
import torch
from torch import nn
model = nn.Sequential(
    nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
    nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1),
)
X = torch.randn(256, 8)
dataset = torch.utils.data.TensorDataset(X, X @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1))
loss_fn = nn.functional.mse_loss
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
"""

# A GPT with torch's packed MultiheadAttention (pipelines cut it between blocks; the head is
# tied to the embedding), and one whose attention tensor parallel splits by heads.
GPT_CELL = gpt_cell(layers=4, attention="packed")
SPLIT_GPT_CELL = gpt_cell(layers=2)
