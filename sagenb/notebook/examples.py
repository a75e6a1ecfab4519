"""Example cells to try the strategies on: a small GPT, as `%%smp_train` cell source.

    from sagenb.notebook.examples import gpt_cell
    sagenb.train(gpt_cell(layers=4, width=128), strategy="tensor", batch_size=32, steps=20)

The tests, the benchmarks and the notebooks' reference checks use the same source. The cell
defines `model`, `dataset` (random token ids, so the loss tells nothing about learning: the
point is the parallelism) and `loss_fn`, and an SGD `make_optimizer`, which keeps parameter
comparisons between strategies clean.
"""

from __future__ import annotations

__all__ = ["gpt_cell"]

_HEADER = """
import torch
from torch import nn
import torch.nn.functional as F

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = {vocab}, {context}, {width}, {heads}, {layers}
"""

# q, k, v and the output projection as separate Linear layers and a head count: the shapes
# tensor parallel splits by heads (sagenb/engine/strategies/tensor/plan.py); views sized from
# n_head and -1
SPLIT_ATTENTION = """
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head = HEADS
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.proj = nn.Linear(WIDTH, WIDTH)
    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (f(x).view(B, L, self.n_head, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, L, -1))
"""

# torch's own MultiheadAttention (one packed q/k/v weight): tensor parallel leaves it whole
PACKED_ATTENTION = """
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1))
    def forward(self, x):
        return self.mha(x, x, x, attn_mask=self.mask, need_weights=False)[0]
"""

_MODEL = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        nn.init.normal_(self.wte.weight, std=0.1)
{tie}    def forward(self, idx):
        x = self.wte(idx) + self.wpe
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

model = GPT()
tokens = torch.randint(0, VOCAB, ({samples}, CONTEXT + 1))
dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
def make_optimizer(params):
    return torch.optim.SGD(params, lr={lr}, momentum=0.9)
"""


def gpt_cell(
    *,
    layers: int = 2,
    width: int = 32,
    heads: int = 4,
    vocab: int = 64,
    context: int = 16,
    samples: int = 128,
    lr: float = 0.1,
    attention: str = "split",
    tied: bool = True,
) -> str:
    """The source of a cell training a GPT of `layers` blocks, its output head tied to the
    token embedding (one Parameter) unless `tied=False`.
    attention="split" has separate q/k/v/output projections (tensor parallel splits them by
    heads); "packed" uses torch's nn.MultiheadAttention."""
    kinds = {"split": SPLIT_ATTENTION, "packed": PACKED_ATTENTION}
    if attention not in kinds:
        raise ValueError(f"attention {attention!r}: must be one of {', '.join(kinds)}")
    header = _HEADER.format(vocab=vocab, context=context, width=width, heads=heads, layers=layers)
    tie = "        self.head.weight = self.wte.weight  # tied input and output embeddings\n"
    model = _MODEL.format(samples=samples, lr=lr, tie=tie if tied else "")
    return header + kinds[attention] + model
