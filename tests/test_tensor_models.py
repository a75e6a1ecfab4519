"""Tensor parallel on the models people bring: transformers' Llama (its own plan, tied and
untied embeddings) and GPT-2 (Conv1D layers, no shipped plan), a gated MLP with meaningless
names (the dataflow-derived plan), peft's LoRA on a Llama and BERT (a plan from one recorded
forward), each on 2 real engines against the single-process reference; and the plans that
cannot work, refused by name before the first step."""

from __future__ import annotations

import pytest
import torch

import sagenb
from sagenb.config.job import JobError
from sagenb.engine.strategies.tensor.plan import derive_plan, plan_for
from sagenb.engine.strategies.tensor.styles import splits
from sagenb.run.failures import TrainingError

from .helpers import check_equal
from .models import head_cell, lora

OPTIONS = dict(batch_size=16, steps=8, epochs=2)
QKV = ("query", "key", "value")
# a transformers model wrapped so that forward(ids) -> logits, as a cell would hold one
WRAPPED = """
import torch
import torch.nn.functional as F
from torch import nn
import transformers

class Wrapped(nn.Module):
    def __init__(self, llm):
        super().__init__()
        self.llm = llm
    def forward(self, ids):
        return self.llm(input_ids=ids, use_cache=False).logits

tokens = torch.randint(0, 64, (64, 17))
dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.2)
"""
LLAMA = """
config = transformers.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads={kv}, max_position_embeddings=16,
    tie_word_embeddings={tie}, bos_token_id=0, eos_token_id=0,
)
model = Wrapped(transformers.LlamaForCausalLM(config))
"""
GPT2 = """
config = transformers.GPT2Config(
    vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
model = Wrapped(transformers.GPT2LMHeadModel(config))
"""
# a gated MLP (SwiGLU) whose layer names say nothing: the plan must come from the dataflow
GATED = """
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(n=nn.LayerNorm(32), x=nn.Linear(32, 64), y=nn.Linear(32, 64),
                               z=nn.Linear(64, 32)))
            for _ in range(2)
        )
        self.b = nn.Linear(32, 1)
    def forward(self, inp):
        h = self.a(inp)
        for blk in self.blocks:
            u = blk["n"](h)
            h = h + blk["z"](F.silu(blk["x"](u)) * blk["y"](u))
        return self.b(h)

model = Net()
X = torch.randn(128, 8)
dataset = torch.utils.data.TensorDataset(X, X @ torch.randn(8, 1))
loss_fn = F.mse_loss
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
"""


# peft's LoRA on column-wise (q, v) and row-wise (o, down) layers; B drawn at random (peft's
# default zeros would leave A without a gradient in the first step)
# BERT fine-tuned for classification and ViT for images, each on its own loss (padding masked);
# BERT's masked LM keeps its decoder (tied to the embedding) whole
BERT, VIT = head_cell("sequence"), head_cell("image")
# LoRA on BERT's attention and MLP, its classifier trained whole (peft's modules_to_save)
BERT_LORA = """
import peft
model = peft.get_peft_model(model, peft.LoraConfig(
    task_type="SEQ_CLS", r=4, target_modules=["query", "value", "dense"], lora_dropout=0.0,
    init_lora_weights=False))
"""
CELLS = {
    "llama-lora": lora,
    "bert": lambda: BERT,
    "bert-lora": lambda: BERT + BERT_LORA,
    "vit": lambda: VIT,
    "bert-mlm": lambda: head_cell("masked-lm"),
}


def _example(ns: dict):
    """The cell's model on its first sample, as the strategy runs it for the recorded plan."""
    first = torch.utils.data.default_collate([ns["dataset"][0]])
    return lambda: ns["model"](**first)


def llama(kv: int = 2, tie: bool = False) -> str:
    return WRAPPED + LLAMA.format(kv=kv, tie=tie)


def _namespace(cell: str) -> dict:
    torch.manual_seed(0)
    ns: dict = {}
    exec(cell, ns)
    return ns


@pytest.mark.parametrize("tie", [False, True])
def test_llama_trains_as_one_process_with_its_own_plan(pool, tie):
    cell = llama(tie=tie)
    result = sagenb.train(cell, strategy="tensor", dashboard=False, **OPTIONS)
    check_equal(result, cell, **OPTIONS)
    state = result.state_dict()
    head, embed = state["llm.lm_head.weight"], state["llm.model.embed_tokens.weight"]
    assert torch.equal(head, embed) == tie  # the tie survives the split (and nothing ties)


def test_gpt2_trains_as_one_process(pool):
    cell = WRAPPED + GPT2
    result = sagenb.train(cell, strategy="tensor", dashboard=False, **OPTIONS)
    check_equal(result, cell, **OPTIONS)


def test_gated_mlp_without_names_gets_the_dataflow_plan(pool):
    plan = derive_plan(_namespace(GATED)["model"], 2)
    assert plan == {
        **{f"blocks.{i}.{n}": "colwise" for i in (0, 1) for n in "xy"},
        **{f"blocks.{i}.z": "rowwise" for i in (0, 1)},
    }  # a and b have a residual / no partner: whole; the LayerNorm stays outside the pairs
    options = dict(batch_size=32, steps=8, epochs=2)
    result = sagenb.train(GATED, strategy="tensor", dashboard=False, **options)
    check_equal(result, GATED, **options)


def test_plans_of_transformers_models():
    styles = plan_for(_namespace(llama(tie=True))["model"], 2, None).styles
    assert "llm.model.layers.*.mlp.gate_proj" in styles  # the gated MLP, whole
    assert not {"llm.lm_head", "llm.model.embed_tokens"} & set(styles)  # tied: left whole
    untied = plan_for(_namespace(llama())["model"], 2, None).styles
    assert {"llm.lm_head", "llm.model.embed_tokens"} <= set(untied)
    gpt2 = derive_plan(_namespace(WRAPPED + GPT2)["model"], 2)
    assert gpt2 == {  # Conv1D MLPs; fused c_attn (q|k|v side by side) and attention whole
        **{f"llm.transformer.h.{i}.mlp.c_fc": "colwise" for i in (0, 1)},
        **{f"llm.transformer.h.{i}.mlp.c_proj": "rowwise" for i in (0, 1)},
    }


def test_plans_that_cannot_work_are_refused_by_name():
    with pytest.raises(JobError, match=r"num_key_value_heads = 1 heads cannot be split 2 ways"):
        plan_for(_namespace(llama(kv=1))["model"], 2, None)
    model = _namespace(llama())["model"]
    with pytest.raises(
        JobError,
        match=r"tp_plan\['llm.model.layers.\*.mlp.up_proj'\] = "
        r"'packed_colwise': sagenb's tensor parallel knows the styles colwise",
    ):
        plan_for(model, 2, {"llm.model.layers.*.mlp.up_proj": "packed_colwise"})
    model.llm._tp_plan["model.layers.*.mlp.up_proj"] = "moe_tp_experts"
    with pytest.raises(JobError, match=r"the model's own _tp_plan\[.*'moe_tp_experts'"):
        plan_for(model, 2, None)
    with pytest.raises(
        JobError,
        match=r"'llm.model.layers.0.mlp.up_proj' \(torch.nn.modules.linear.Linear\) split "
        r"colwise 3 ways, but its out_features = 64 does not divide by 3",
    ):
        plan_for(model, 3, {"llm.model.layers.0.mlp.up_proj": "colwise"})
    with pytest.raises(
        JobError,
        match=r"'llm.model.norm' is a transformers.models.llama.modeling_llama.LlamaRMSNorm; ",
    ):
        plan_for(model, 2, {"llm.model.norm": "colwise"})
    tied = _namespace(llama(tie=True))["model"]
    with pytest.raises(JobError, match=r"'llm.lm_head' shares its weight .* untie"):
        plan_for(tied, 2, {"llm.lm_head": "colwise_gather_output"})


def test_a_plan_that_breaks_the_forward_stops_before_the_first_step(pool):
    # the old name-based plan of issue 15: up and down split, the gate whole
    hand = {
        "llm.model.layers.*.mlp.up_proj": "colwise",
        "llm.model.layers.*.mlp.down_proj": "rowwise",
    }
    cell = llama() + f"\ntp_plan = {hand!r}\n"
    with pytest.raises(
        (JobError, TrainingError),
        match=r"trial forward .* failed in "
        r"'llm.model.layers.0.mlp'",
    ):
        sagenb.train(cell, strategy="tensor", dashboard=False, **OPTIONS)


@pytest.mark.parametrize("name", list(CELLS))
def test_fine_tuned_models_train_as_one_process(pool, name):
    cell = CELLS[name]()
    options = dict(batch_size=16, steps=3)
    result = sagenb.train(cell, strategy="tensor", dashboard=False, **options)
    check_equal(result, cell, **options)  # the model's own keys, adapters included
    if name == "llama-lora":  # the adapters trained, the frozen base did not move
        trained, initial = result.state_dict(), _namespace(cell)["model"].state_dict()
        key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"
        assert not torch.equal(trained[key], initial[key])
        base = key.replace("lora_A.default", "base_layer")
        assert torch.equal(trained[base], initial[base])


def test_plans_of_fine_tuned_models():
    ns = _namespace(lora())
    styles = plan_for(ns["model"], 2, None, example=_example(ns)).styles
    layers = "base_model.model.model.layers.*."
    kinds = {k[len(layers) :]: splits(v) for k, v in styles.items() if k.startswith(layers)}
    assert kinds == {
        **{f"self_attn.{n}_proj.base_layer": "colwise" for n in "qv"},
        **{f"self_attn.{n}_proj.lora_B.default": "colwise" for n in "qv"},  # lora_A whole
        "self_attn.k_proj": "colwise",
        "self_attn.o_proj.base_layer": "rowwise",
        "self_attn.o_proj.lora_A.default": "rowwise",  # lora_B whole
        "mlp.down_proj.base_layer": "rowwise",
        "mlp.down_proj.lora_A.default": "rowwise",
        **{f"mlp.{n}_proj": "colwise" for n in ("gate", "up")},
    }
    ns = _namespace(
        lora().replace("init_lora_weights", "layers_to_transform=[1], init_lora_weights")
    )
    styles = plan_for(ns["model"], 2, None, example=_example(ns)).styles
    assert splits(styles[layers.replace("*", "0") + "self_attn.q_proj"]) == "colwise"  # plain
    assert splits(styles[layers.replace("*", "1") + "self_attn.q_proj.lora_B.default"])
    ns = _namespace(BERT)
    plan = plan_for(ns["model"], 2, None, example=_example(ns)).styles
    layer = "bert.encoder.layer.{}."
    assert {k: splits(v) for k, v in plan.items()} == {  # no plan shipped: one forward's
        **{layer.format(i) + f"attention.self.{n}": "colwise" for i in (0, 1) for n in QKV},
        **{layer.format(i) + "attention.output.dense": "rowwise" for i in (0, 1)},
        **{layer.format(i) + "intermediate.dense": "colwise" for i in (0, 1)},
        **{layer.format(i) + "output.dense": "rowwise" for i in (0, 1)},
        "bert.pooler.dense": "colwise",  # tanh between them: a pair too
        "classifier": "rowwise",
    }
    with pytest.raises(JobError, match=r"found no Linear layers to split"):
        derive_plan(ns["model"], 2)  # torch.fx alone cannot trace BERT's blocks
    eight = plan_for(ns["model"], 8, None, example=_example(ns)).styles
    assert not any("attention" in k for k in eight)  # 4 heads cannot split 8 ways: whole
    assert layer.format(0) + "output.dense" in eight  # its MLP still splits
    ns = _namespace(VIT)
    plan = plan_for(ns["model"], 2, None, example=_example(ns)).styles
    assert {k: splits(v) for k, v in plan.items()} == {
        **{f"vit.layers.{i}.attention.{n}_proj": "colwise" for i in (0, 1) for n in "qkv"},
        **{f"vit.layers.{i}.attention.o_proj": "rowwise" for i in (0, 1)},
        **{f"vit.layers.{i}.mlp.fc1": "colwise" for i in (0, 1)},
        **{f"vit.layers.{i}.mlp.fc2": "rowwise" for i in (0, 1)},
    }  # the classifier reads the first token after a LayerNorm: whole


def test_peft_layers_that_cannot_split_are_refused_by_module_path():
    ns = _namespace(lora(dora=True))
    with pytest.raises(
        JobError,
        match=r"'base_model.model.model.layers.0.self_attn.q_proj' is a "
        r"peft.tuners.lora.layer.Linear and colwise cannot split it: it uses a LoRA variant "
        r".*leave 'q_proj' out of the LoRA config's target_modules",
    ):
        plan_for(ns["model"], 2, None)
    ns = _namespace(lora(targets=["embed_tokens"]))
    with pytest.raises(JobError, match=r"is a peft.tuners.lora.layer.Embedding and rowwise"):
        plan_for(ns["model"], 2, None)
    ns = _namespace(lora())
    q = "base_model.model.model.layers.*.self_attn.q_proj"
    with pytest.raises(
        JobError,
        match=r"names 'base_model.model.model.layers.0.self_attn.q_proj.base_layer', part of "
        r"the LoRA layer .* \(peft.tuners.lora.layer.Linear\); name .*q_proj' instead",
    ):
        plan_for(ns["model"], 2, {q + ".base_layer": "colwise"})
