"""Pipeline model parallel on models as people write them: transformers' Llama, GPT-2 and BERT
(which torch.fx cannot trace, so the torch.export front end splits them) and a torchvision-
style ResNet (blocks in layer1..layer3 Sequentials); each equals the single-process reference."""

from __future__ import annotations

import pytest

import sagenb

from .test_model_parallel import check_equal

LM_DATA = """
import torch
import torch.nn.functional as F
from torch import nn
import transformers

class LM(nn.Module):  # forward(ids) -> logits, as the batch reaches the model today
    def __init__(self, llm):
        super().__init__()
        self.llm = llm

    def forward(self, ids):
        return self.llm(input_ids=ids, {use_cache}).logits

model = LM(transformers.{cls}(transformers.{config}))
ids = torch.randint(0, 64, (96, 8))
dataset = torch.utils.data.TensorDataset(ids, torch.roll(ids, -1, dims=1))
loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
"""
LLAMA = "LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers={n}, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings={tie})"  # noqa: E501
GPT2 = "GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)"  # noqa: E501
BERT = "BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)"  # noqa: E501


def lm_cell(cls: str, config: str, use_cache: bool = True) -> str:
    cache = "use_cache=False" if use_cache else "return_dict=True"
    return LM_DATA.format(cls=cls, config=config, use_cache=cache)


CELLS = {
    "llama": lm_cell("LlamaForCausalLM", LLAMA.format(n=4, tie=False)),
    "llama-tied": lm_cell("LlamaForCausalLM", LLAMA.format(n=2, tie=True)),
    "gpt2-tied": lm_cell("GPT2LMHeadModel", GPT2),
    "bert": lm_cell("BertForMaskedLM", BERT, use_cache=False),
}

RESNET_CELL = """
import torch
import torch.nn.functional as F
from torch import nn

class BasicBlock(nn.Module):  # torchvision.models.resnet.BasicBlock, in miniature
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)

class ResNet(nn.Module):
    def __init__(self, width=8, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width)
        )
        self.layer3 = nn.Sequential(BasicBlock(2 * width, 4 * width, 2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))

model = ResNet()
X = torch.randn(64, 3, 8, 8)
dataset = torch.utils.data.TensorDataset(X, torch.randint(0, 4, (64,)))
loss_fn = F.cross_entropy
"""

UNSPLITTABLE_CELL = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        if x.sum() > 0:  # a branch on a tensor's value: neither tracer gets past it
            x = -x
        for block in self.blocks:
            x = block(x)
        return x

model = Net()
X = torch.randn(64, 4)
dataset = torch.utils.data.TensorDataset(X, X)
loss_fn = nn.functional.mse_loss
"""


@pytest.mark.parametrize("name", list(CELLS))
def test_transformers_models_match_reference(pool, name):
    cell = CELLS[name]
    options = dict(batch_size=8, steps=10)
    result = sagenb.train(
        cell, strategy="model", partitions=2, microbatches=2, dashboard=False, **options
    )
    check_equal(result, cell, **options)


def test_resnet_blocks_span_its_sequentials(pool):
    options = dict(batch_size=8, steps=8)
    result = sagenb.train(
        RESNET_CELL,
        strategy="model",
        partitions=2,
        microbatches=1,  # BatchNorm over a microbatch would not equal one process's batch
        schedule="gpipe",
        dashboard=False,
        **options,
    )
    check_equal(result, RESNET_CELL, **options)


def test_unsplittable_model_names_the_construct(pool):
    with pytest.raises(sagenb.JobError) as info:
        sagenb.train(UNSPLITTABLE_CELL, strategy="model", partitions=2, batch_size=32)
    text = str(info.value)
    assert "torch.fx stopped at <smp_train cell>, line 11, in forward" in text, text
    assert "torch.export stopped at <smp_train cell>, line 11, in forward" in text, text
    assert "Remove that construct" in text, text


def test_planner_profiles_an_exported_model(pool):
    """--partition-by auto's profile runs the export front end's one-piece-per-block split."""
    plan = sagenb.plan(CELLS["llama"], strategy="model", partitions=2, microbatches=2, batch_size=8)
    assert [s.blocks[0] for s in plan.stages][0] == "llm.model.layers.0"
    assert sum(len(s.blocks) for s in plan.stages) == 4
    assert all(s.seconds_per_microbatch > 0 for s in plan.stages)
