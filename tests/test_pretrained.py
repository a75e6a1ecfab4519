"""Pretrained weights a cell names, read shard by shard under --delay-init (issue 29, item 5):
the same parameters as one process that loads them whole, and each engine reads only its part."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import sagenb
from sagenb.config.job import Job, JobError
from sagenb.engine.model.delayed import materialize
from sagenb.engine.workspace import build_workspace

from .helpers import assert_params_equal, check_equal
from .models import PRETRAINED_LLAMA_CELL, SPLIT_GPT_CELL, tied_llama
from .reference import namespace

OPTIONS = dict(batch_size=32, steps=2)
# its own generator for the data: building the model on the meta device draws fewer numbers
GPT_CELL = SPLIT_GPT_CELL.replace(
    "(128, CONTEXT + 1))", "(128, CONTEXT + 1), generator=torch.Generator().manual_seed(1))"
)
assert GPT_CELL != SPLIT_GPT_CELL
# the one process the runs are compared with loads the file whole, by hand
LOAD_BY_HAND = """
from safetensors.torch import load_file
model.load_state_dict(load_file({file!r}), strict=False)  # the head is tied: not in the file
"""


def _pretrained_gpt(folder) -> tuple[str, int]:
    """The GPT cell's model with other values than its seeded ones, saved as transformers
    saves a tied model (the head's name left out); the file and its tensors' bytes."""
    model = namespace(GPT_CELL, seed=123)["model"]
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    file = str(folder / "model.safetensors")
    save_file(state, file)
    return file, sum(v.numel() * v.element_size() for v in state.values())


def test_from_pretrained_under_delay_init_keeps_its_weights(tmp_path):
    """Before: the values from_pretrained loaded were replaced by the seeded ones, silently."""
    pretrained = tied_llama(tmp_path)
    ws = build_workspace(
        Job.of(PRETRAINED_LLAMA_CELL.format(folder=str(tmp_path))), 0, delay_init=True
    )
    assert all(p.is_meta for p in ws.model.parameters())  # nothing was kept while the cell ran
    materialize(ws.model, [ws.model], seed=0, device=torch.device("cpu"), checkpoint=ws.checkpoint)
    assert_params_equal(ws.model.state_dict(), pretrained, tol=0)
    assert ws.model.lm_head.weight is ws.model.model.embed_tokens.weight  # tied, read once
    assert ws.checkpoint.bytes_read == sum(p.numel() * 4 for p in pretrained.parameters())


PEFT_CELL = """
import torch
from transformers import AutoConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
base = {base}
model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
dataset = [{{"input_ids": torch.arange(8), "labels": torch.arange(8)}}] * 4
"""


@pytest.mark.parametrize("naming", ["from_pretrained", "variable"])
def test_a_peft_model_reads_its_base(tmp_path, naming):
    """The base's keys lie under base_model.model., LoRA's wrapped layers under .base_layer."""
    pretrained = tied_llama(tmp_path)
    folder = str(tmp_path)
    if naming == "from_pretrained":
        cell = PEFT_CELL.format(base=f"LlamaForCausalLM.from_pretrained({folder!r})")
    else:  # built from its config: nothing read while the cell runs
        base = f"LlamaForCausalLM(AutoConfig.from_pretrained({folder!r}))"
        cell = PEFT_CELL.format(base=base) + f"pretrained = {folder!r}\n"
    ws = build_workspace(Job.of(cell), 0, delay_init=True)
    materialize(ws.model, [ws.model], seed=0, device=torch.device("cpu"), checkpoint=ws.checkpoint)
    state = ws.model.base_model.model.state_dict()
    for key, value in pretrained.state_dict().items():
        wrapped = key.replace("q_proj.", "q_proj.base_layer.").replace(
            "v_proj.", "v_proj.base_layer."
        )
        torch.testing.assert_close(state[wrapped], value, rtol=0, atol=0)


def test_values_with_no_file_are_refused():
    cell = SPLIT_GPT_CELL + "\nmodel.wte.weight = torch.nn.Parameter(torch.ones(64, 32))\n"
    with pytest.raises(JobError, match="pretrained = "):
        build_workspace(Job.of(cell), 0, delay_init=True)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    save_file({"encoder.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    cell = SPLIT_GPT_CELL + f"\npretrained = {str(tmp_path)!r}\n"
    with pytest.raises(JobError, match="holds none of the model's parameters"):
        build_workspace(Job.of(cell), 0, delay_init=True)


@pytest.mark.parametrize(
    "strategy, delay_init",
    [("sharded", True), ("model", True), ("tensor", True), ("sharded", False)],
)
def test_each_engine_reads_its_part(pool, tmp_path, strategy, delay_init):
    """Sharded engines read half of each tensor, pipeline engines their stages' tensors (the
    tied embedding and head both), tensor-parallel ones their slices of the split layers and
    the rest whole; without --delay-init each engine reads the whole file."""
    file, total = _pretrained_gpt(tmp_path)
    cell = GPT_CELL + f"\npretrained = {file!r}\n"
    split = {"partitions": 2} if strategy == "model" else {}
    result = sagenb.train(
        cell, strategy=strategy, delay_init=delay_init, dashboard=False, **split, **OPTIONS
    )
    check_equal(result, GPT_CELL + LOAD_BY_HAND.format(file=file), **OPTIONS)
    read = [rec.values["pretrained_read(MiB)"] * 2**20 for rec in result.metrics if rec.step == 1]
    assert len(read) == 2
    if not delay_init:
        assert read == [total, total]
    elif strategy == "sharded":  # FSDP2's rows of every tensor: halves that add up to one file
        assert sum(read) == total and max(read) < 0.6 * total, (read, total)
    elif strategy == "tensor":  # the split layers' halves, the embedding and norms whole
        assert total < sum(read) < 1.2 * total and max(read) < 0.6 * total, (read, total)
    else:  # each its stages: the embedding (tied to the head) on both ends
        embedding = 64 * 32 * 4
        assert sum(read) == total + embedding and max(read) < 0.8 * total, (read, total)


def test_from_pretrained_sharded_equals_one_process(pool, tmp_path):
    """A tied transformers Llama loaded by from_pretrained trains, sharded with --delay-init,
    as one process that loads it."""
    tied_llama(tmp_path)
    cell = PRETRAINED_LLAMA_CELL.format(folder=str(tmp_path))
    result = sagenb.train(cell, strategy="sharded", delay_init=True, dashboard=False, **OPTIONS)
    check_equal(result, cell, **OPTIONS)
    read = [rec.values["pretrained_read(MiB)"] for rec in result.metrics if rec.step == 1]
    assert len(read) == 2 and read[0] == pytest.approx(read[1], rel=0.1)


# -- what a pretrained file may make sagenb read ----------------------------------------------

SMALL_CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
dataset = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
loss_fn = nn.functional.mse_loss
pretrained = {folder!r}
"""


def _small_state(**replaced) -> dict[str, torch.Tensor]:
    model = namespace(SMALL_CELL.format(folder=""), seed=1)["model"]
    return {**{k: v.contiguous() for k, v in model.state_dict().items()}, **replaced}


@pytest.mark.parametrize("name", ["../elsewhere/x.safetensors", "ABSOLUTE"])
def test_an_index_names_only_files_in_its_folder(tmp_path, name):
    """`../elsewhere/x.safetensors` or an absolute path in the index was read."""
    folder, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    folder.mkdir(), elsewhere.mkdir()
    save_file(_small_state(), str(elsewhere / "x.safetensors"))
    name = str(elsewhere / "x.safetensors") if name == "ABSOLUTE" else name
    index = {"weight_map": dict.fromkeys(_small_state(), name)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(JobError, match=f"names a file outside {folder}: {re.escape(repr(name))}"):
        build_workspace(Job.of(SMALL_CELL.format(folder=str(folder))), 0)


@pytest.mark.parametrize("delay_init", [False, True])
def test_a_tensor_of_another_shape_is_refused(tmp_path, delay_init):
    """A (1, 8) tensor broadcast into the (16, 8) weight, silently, loaded whole or under
    --delay-init (read into the model as it is made)."""
    file = tmp_path / "model.safetensors"
    save_file(_small_state(**{"0.weight": torch.ones(1, 8)}), str(file))
    message = rf"0.weight in {file} is \[1, 8\], the model's 0.weight is \[16, 8\]"
    with pytest.raises(JobError, match=message):
        ws = build_workspace(Job.of(SMALL_CELL.format(folder=str(file))), 0, delay_init=delay_init)
        materialize(
            ws.model, [ws.model], seed=0, device=torch.device("cpu"), checkpoint=ws.checkpoint
        )


@pytest.mark.parametrize("strategy", ["sharded", "tensor"])
def test_a_larger_tensor_is_refused_not_cropped_on_the_engines(pool, tmp_path, strategy):
    """Under sharded or tensor --delay-init each engine read its box of the file's tensor: a
    (256, 64) tensor was cropped into the (128, 32) weight, and the run trained on."""
    model = namespace(GPT_CELL, seed=123)["model"]
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    state["blocks.0.mlp.0.weight"] = torch.ones(256, 64)
    file = str(tmp_path / "model.safetensors")
    save_file(state, file)
    key = "blocks.0.mlp.0.weight"
    message = rf"{key} in {file} is \[256, 64\], the model's {key} is \[128, 32\]"
    with pytest.raises(JobError, match=message):
        sagenb.train(
            GPT_CELL + f"\npretrained = {file!r}\n",
            strategy=strategy,
            delay_init=True,
            dashboard=False,
            **OPTIONS,
        )
