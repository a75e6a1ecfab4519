"""Model cells shared by the tests: an nn.Sequential, two small GPTs, a ResNet, a map-style
dataset, a model with nowhere to cut, transformers' Llama, GPT-2, BERT and Qwen2-MoE from tiny
configs, LoRA on the Llama, and a tied Llama saved to a folder and loaded back."""

from pathlib import Path

from sagenb.notebook.examples import gpt_cell

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

# A map-style dataset (samples built one by one and collated), an eval set, a scheduler.
MAP_STYLE_CELL = """
import torch
from torch import nn

class Squares(torch.utils.data.Dataset):
    # a plain map-style dataset: samples are built one by one and collated
    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 4, generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], (self.x[i] ** 2).sum(0, keepdim=True)

model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
dataset = Squares(160)
eval_dataset = Squares(50)
loss_fn = nn.MSELoss()

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)

def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
"""

# No nn.Sequential, no list of blocks: a pipeline has nowhere to cut it.
UNSPLITTABLE_CELL = """
import torch
from torch import nn

class Net(nn.Module):  # no nn.Sequential, no list of blocks: nowhere to cut
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x)

model = Net()
X = torch.randn(64, 4)
dataset = torch.utils.data.TensorDataset(X, X)
loss_fn = nn.functional.mse_loss
"""

# transformers' Llama, GPT-2 and BERT from tiny configs (random initialisation, nothing
# downloaded), wrapped so that forward(ids) -> logits: the pipeline, data and sharded tests' models.
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


LM_CELLS = {
    "llama": lm_cell("LlamaForCausalLM", LLAMA.format(n=4, tie=False)),
    "llama-tied": lm_cell("LlamaForCausalLM", LLAMA.format(n=2, tie=True)),
    "gpt2-tied": lm_cell("GPT2LMHeadModel", GPT2),
    "bert": lm_cell("BertForMaskedLM", BERT, use_cache=False),
}

# A tiny Llama built from a config (random initialisation, nothing downloaded), given as it is:
# model(**batch) returns a CausalLMOutputWithPast whose loss shifts labels by one. Samples are
# dicts whose prompts (a random length) and right padding are labelled -100: every piece of a
# global batch counts a different number of tokens.
LLAMA_DICT_CELL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                     use_cache=False, tie_word_embeddings={tied})
model = LlamaForCausalLM(config)

class Prompts(torch.utils.data.Dataset):
    def __init__(self, n, length=12):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 64, (n, length), generator=g)
        self.prompt = torch.randint(0, 8, (n,), generator=g)
        self.used = torch.randint(6, length + 1, (n,), generator=g)
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        pos = torch.arange(self.ids.shape[1])
        mask = (pos < self.used[i]).long()
        labels = self.ids[i].clone()
        labels[(pos < self.prompt[i]) | (mask == 0)] = -100
        return {{"input_ids": self.ids[i], "attention_mask": mask, "labels": labels}}

dataset = Prompts(96)
eval_dataset = Prompts(20)
{loss}
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
"""

# The same with a loss_fn of the cell: it receives the output's logits and the labels, and a
# piece's weight is the count of those labels other than -100 (so a loss_fn must not drop
# labels itself: the labels the loss uses are the dataset's, aligned with the logits)
CELL_LOSS = """
import torch.nn.functional as F
def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
"""


def llama_cell(*, tied: bool = False, own_loss: bool = True) -> str:
    return LLAMA_DICT_CELL.format(tied=tied, loss="" if own_loss else CELL_LOSS)


# transformers heads given as they are, from tiny configs: dict samples with labels, no
# loss_fn, so each trains on its own loss (issue 29). `{model}` builds the model, `{sample}`
# one sample's dict from row i of `ids` (token ids, a prompt's length `cut`) or `images`.
HEAD_CELL = """
import torch
import transformers as T

bert = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
model = {model}
g = torch.Generator().manual_seed(5)
ids = torch.randint(1, 64, (48, 8), generator=g)
images = torch.randn(48, 3, 8, 8, generator=g)
cut = torch.randint(1, 6, (48,), generator=g)
used = torch.randint(5, 9, (48,), generator=g)
def sample(i):
    pos = torch.arange(8)
    mask = (pos < used[i]).long()
    return {sample}
dataset = [sample(i) for i in range(40)]
eval_dataset = [sample(i) for i in range(40, 46)]
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
"""
TOKENS = '"input_ids": ids[i], "attention_mask": mask'
#: an encoder-decoder's targets: the input reversed, 4 to 8 of them, -100 after
SEQ2SEQ_LABELS = "torch.where(pos < cut[i] + 3, ids[i].flip(0), -100)"
#: labels of -100 where no target is: a prompt, the padding, or (masked LM) unmasked tokens
HEADS = {
    "sequence": (
        "T.BertForSequenceClassification(T.BertConfig(num_labels=3, **bert))",
        f"{{{TOKENS}, 'labels': ids[i].sum() % 3}}",
    ),
    "multi-label": (
        "T.BertForSequenceClassification(T.BertConfig(num_labels=3, "
        "problem_type='multi_label_classification', **bert))",
        f"{{{TOKENS}, 'labels': (ids[i, :3] % 2).float()}}",
    ),
    "regression": (
        "T.BertForSequenceClassification(T.BertConfig(num_labels=1, **bert))",
        f"{{{TOKENS}, 'labels': ids[i].float().mean() / 64}}",
    ),
    "masked-lm": (
        "T.BertForMaskedLM(T.BertConfig(**bert))",
        f"{{{TOKENS}, 'labels': torch.where((pos % 3 == 0) & (mask == 1), ids[i], -100)}}",
    ),
    "token": (
        "T.BertForTokenClassification(T.BertConfig(num_labels=4, **bert))",
        f"{{{TOKENS}, 'labels': torch.where(mask == 1, ids[i] % 4, -100)}}",
    ),
    "image": (
        "T.ViTForImageClassification(T.ViTConfig(image_size=8, patch_size=4, hidden_size=32, "
        "num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=5))",
        "{'pixel_values': images[i], 'labels': (images[i].mean() * 40).long() % 5}",
    ),
    # GPT-2 with its config's default use_cache=True: training builds no cache
    "causal-lm": (
        "T.GPT2LMHeadModel(T." + GPT2 + ")",
        f"{{{TOKENS}, 'labels': torch.where((pos >= cut[i]) & (mask == 1), ids[i], -100)}}",
    ),
    "llama-sequence": (
        "T.LlamaForSequenceClassification(T."
        + LLAMA.format(n=2, tie=False)[:-1]
        + ", num_labels=3, pad_token_id=0))",
        f"{{{TOKENS}, 'labels': ids[i].sum() % 3}}",
    ),
    # encoder-decoders: labels (the decoder's targets, read shifted right as its inputs) of
    # a length of their own, -100 after it; the tied embedding is used by encoder, decoder and
    # head. Two blocks each in the encoder and the decoder.
    "t5": (
        "T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, "
        "num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0, "
        "decoder_start_token_id=0, pad_token_id=0))",
        f"{{{TOKENS}, 'labels': {SEQ2SEQ_LABELS}}}",
    ),
    "bart": (
        "T.BartForConditionalGeneration(T.BartConfig(vocab_size=64, d_model=32, "
        "encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, "
        "decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, "
        "max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, "
        "activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, "
        "decoder_start_token_id=2, forced_eos_token_id=None))",
        f"{{{TOKENS}, 'labels': {SEQ2SEQ_LABELS}}}",
    ),
}


def head_cell(head: str) -> str:
    model, sample = HEADS[head]
    return HEAD_CELL.format(model=model, sample=sample)


# a transformers Qwen2-MoE from a tiny config: 4 experts, 2 per token, a shared expert
MOE_CELL = """
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
config = Qwen2MoeConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, use_cache=False,
)
model = Qwen2MoeForCausalLM(config)
ids = torch.randint(0, 128, (64, 8), generator=torch.Generator().manual_seed(1))
dataset = [{"input_ids": i, "labels": i} for i in ids]
"""

# LoRA (or DoRA) on a Llama's attention and MLP projections, peft's own wrapping
LORA = """
import peft
model = peft.get_peft_model(model, peft.LoraConfig(
    r=4, lora_alpha=8, target_modules={targets}, lora_dropout=0.0, init_lora_weights=False,
    use_dora={dora}))
"""
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def lora(targets: list[str] = TARGETS, dora: bool = False) -> str:
    return llama_cell() + LORA.format(targets=targets, dora=dora)


# a "pretrained" Llama with its embedding and head tied, saved to a folder and loaded back
TIED_LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    use_cache=False,
    tie_word_embeddings=True,
)
PRETRAINED_LLAMA_CELL = """
import torch
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained({folder!r})
ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
dataset = [{{"input_ids": i, "labels": i}} for i in ids]
"""


def tied_llama(folder):
    """A tied Llama from TIED_LLAMA, seeded, saved as transformers saves it (its head left
    out of the file) in `folder`, for PRETRAINED_LLAMA_CELL to load."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**TIED_LLAMA))
    model.save_pretrained(folder)
    return model


# The GPT of notebooks/nanogpt_model.py, as people copy it from nanoGPT (a @dataclass config,
# a tied head, forward(idx, targets=None) returning (logits, loss) with ignore_index=-1, its own
# configure_optimizers), pasted into the cell. {data} gives the samples: dict ones ({"idx",
# "targets"}) or (x, y) tuples.
NANOGPT_MODEL = (Path(__file__).parent.parent / "notebooks" / "nanogpt_model.py").read_text() + (
    "\nmodel = GPT(GPTConfig())\n"
)
NANOGPT_DATA = {
    # targets padded with -1 at the end of some samples, as nanoGPT's ignore_index leaves out
    "dict": """
ids = torch.randint(0, 48, (64, 17))
ids[::3, -4:] = -1
class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return len(ids)
    def __getitem__(self, i):
        return {"idx": ids[i, :-1].clamp(min=0), "targets": ids[i, 1:]}
dataset = Tokens()
""",
    "tuple": """
ids = torch.randint(0, 48, (64, 17))
ids[::3, -4:] = -1
dataset = torch.utils.data.TensorDataset(ids[:, :-1].clamp(min=0), ids[:, 1:])
""",
}
NANOGPT_SGD = """
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
"""


def nanogpt_cell(data: str = "dict", optimizer: str = NANOGPT_SGD) -> str:
    """The nanoGPT-style cell with `data` ("dict" or "tuple") samples and `optimizer`."""
    return NANOGPT_MODEL + NANOGPT_DATA[data] + optimizer
