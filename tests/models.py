"""Model cells shared by the tests: an nn.Sequential, two small GPTs and a ResNet."""

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

# A torchvision-shaped ResNet (torchvision.models.resnet: BasicBlock, _make_layer, a 1x1
# conv + BatchNorm downsample where the shape changes), written out because torchvision does not
# import here; tiny: 16x16 RGB images, widths 8-16, 10 classes. Its BatchNorm layers are what
# data-parallel engines must synchronise to train as one process (sagenb issue 15).
RESNET_CELL = """
import torch
from torch import nn

def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)

class ResNet(nn.Module):
    def __init__(self, widths=(8, 16, 16), blocks=(2, 2, 2), num_classes=10):
        super().__init__()
        self.conv1 = conv3x3(3, widths[0])
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks)):
            layers = [BasicBlock(cin, width, 1 if i == 0 else 2)]
            layers += [BasicBlock(width, width) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
            cin = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))

model = ResNet()
X = torch.randn(256, 3, 16, 16)
Y = (X.mean(1).flatten(1) @ torch.randn(256, 10)).argmax(1)  # a learnable labelling
dataset = torch.utils.data.TensorDataset(X, Y)
loss_fn = nn.functional.cross_entropy
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
"""
