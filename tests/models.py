"""Model cells shared by the model-parallel tests: an nn.Sequential and a small GPT."""

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

GPT_CELL = """
import torch
from torch import nn
import torch.nn.functional as F

VOCAB, CONTEXT, WIDTH = 64, 16, 32

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )
        self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1))
    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        nn.init.normal_(self.wte.weight, std=0.1)
        self.head.weight = self.wte.weight  # tied input and output embeddings
    def forward(self, idx):
        x = self.wte(idx) + self.wpe
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

model = GPT()
tokens = torch.randint(0, VOCAB, (128, CONTEXT + 1))
dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
"""

# A GPT whose attention has separate q/k/v/output projections and a head count, the shapes
# tensor parallel splits automatically (sagenb/engine/tp_plan.py); the head is tied to wte.
SPLIT_GPT_CELL = """
import torch
from torch import nn
import torch.nn.functional as F

VOCAB, CONTEXT, WIDTH = 64, 16, 32

class Attention(nn.Module):
    def __init__(self, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.proj = nn.Linear(WIDTH, WIDTH)
    def forward(self, x):
        B, L, _ = x.shape
        # sized from self.n_head and -1: under tensor parallel each engine has its own heads
        q, k, v = (f(x).view(B, L, self.n_head, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, L, -1))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        nn.init.normal_(self.wte.weight, std=0.1)
        self.head.weight = self.wte.weight
    def forward(self, idx):
        x = self.wte(idx) + self.wpe
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

model = GPT()
tokens = torch.randint(0, VOCAB, (128, CONTEXT + 1))
dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
"""
