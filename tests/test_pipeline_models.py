"""Pipeline model parallel on models as people write them: transformers' Llama, GPT-2 and BERT
(which torch.fx cannot trace, so the torch.export front end splits them) and a torchvision-
style ResNet (blocks in layer1..layer3 Sequentials); each equals the single-process reference."""

from __future__ import annotations

import pytest

import sagenb

from .helpers import check_equal
from .models import LM_CELLS

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

UNTRACEABLE_CELL = """
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


@pytest.mark.parametrize("name", list(LM_CELLS))
def test_transformers_models_match_reference(pool, name):
    cell = LM_CELLS[name]
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
        sagenb.train(UNTRACEABLE_CELL, strategy="model", partitions=2, batch_size=32)
    text = str(info.value)
    assert "torch.fx stopped at <smp_train cell>, line 11, in forward" in text, text
    assert "torch.export stopped at <smp_train cell>, line 11, in forward" in text, text
    assert "Remove that construct" in text, text


def test_planner_profiles_an_exported_model(pool):
    """--partition-by auto's profile runs the export front end's one-piece-per-block split."""
    plan = sagenb.plan(
        LM_CELLS["llama"], strategy="model", partitions=2, microbatches=2, batch_size=8
    )
    assert [s.blocks[0] for s in plan.stages][0] == "llm.model.layers.0"
    assert sum(len(s.blocks) for s in plan.stages) == 4
    assert all(s.seconds_per_microbatch > 0 for s in plan.stages)
