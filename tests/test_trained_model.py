"""The trained model back in the kernel: `result.model()` builds the cell's model here with the
run's parameters, and `result.save_pretrained` writes it as transformers and peft load it."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import sagenb
from sagenb.config.job import Job
from sagenb.run.trained import CellModel, save_pretrained

from .helpers import TOL, check_equal
from .models import LM_CELLS, SEQUENTIAL_CELL, TIED_LLAMA, llama_cell
from .reference import namespace

LORA = """
from peft import LoraConfig, get_peft_model
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
"""


def pretrained_peft_cell(base: str) -> str:
    """LoRA on a "pretrained" tiny Llama, which the test saved to `base` (nothing downloaded)."""
    cell = llama_cell(tied=True)
    build = "model = LlamaForCausalLM(config)"
    assert build in cell
    return cell.replace(build, f"model = LlamaForCausalLM.from_pretrained({base!r})") + LORA


IDS = torch.randint(1, 64, (3, 12), generator=torch.Generator().manual_seed(5))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def nudged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Another model's values: every float entry moved by 0.01 (tied names alike)."""
    return {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}


# -- in the kernel, without engines ----------------------------------------------------------------


@pytest.mark.parametrize("delay_init", [False, True])
def test_the_kernel_builds_the_model_as_the_engines_do(delay_init):
    """Seeded as an engine (the one-process reference's values), or under --delay-init never
    initialised: meta parameters, allocated and filled with the given values, ties kept. The
    kernel's random state is left as it was."""
    cell = llama_cell(tied=True)
    source = CellModel(Job.from_cell(cell), seed=3, delay_init=delay_init)
    before = torch.get_rng_state()
    built = source.build()
    assert torch.equal(torch.get_rng_state(), before)
    if delay_init:
        assert all(p.is_meta for p in built.parameters())
    else:
        assert_same(built.state_dict(), namespace(cell, 3)["model"].state_dict())
    wanted = nudged(namespace(cell, 3)["model"].state_dict())
    trained = source.trained(wanted)
    assert_same(trained.state_dict(), wanted)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    assert not trained.training  # eval mode, as from_pretrained returns a model


def test_a_callable_job_and_a_cell_s_own_class_come_back_without_their_data():
    """A job given as a function (sagenb.train(fn)) builds again too; a class the cell defines
    keeps the cell's names alive through its methods' globals, but not the dataset."""

    def job():
        layer = torch.nn.Linear(4, 2)
        return {"model": layer, "dataset": torch.utils.data.TensorDataset(torch.ones(8, 4))}

    state = {"weight": torch.ones(2, 4), "bias": torch.zeros(2)}
    assert_same(CellModel(Job.from_callable(job), seed=0).trained(state).state_dict(), state)
    wrapper = CellModel(Job.from_cell(LM_CELLS["llama"]), seed=0).build()
    kept = type(wrapper).forward.__globals__
    assert "ids" in kept and "dataset" not in kept


def assert_same(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert list(state) == list(reference)
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


#: the base unfrozen by hand, outside the adapter: peft's files would lose its training
UNFROZEN = llama_cell() + LORA + "model.base_model.model.lm_head.weight.requires_grad_(True)\n"


@pytest.mark.parametrize(
    ("cell", "merge", "error", "says"),
    [
        (
            SEQUENTIAL_CELL,
            False,
            TypeError,
            "the cell's model is torch.nn.modules.container.Sequential. For any model: "
            "torch.save(result.state_dict(), path)",
        ),
        (LM_CELLS["llama"], False, TypeError, "at .llm: `result.model().llm.save_pretrained"),
        (llama_cell(), True, ValueError, "merge=True: needs a peft.PeftModel"),
        (llama_cell(), "yes", TypeError, "merge='yes': must be True or False"),
        (UNFROZEN, False, ValueError, "(base_model.model.lm_head.weight), which the adapter"),
    ],
    ids=["plain-torch", "wrapped", "merge-no-adapter", "merge-not-bool", "base-trained"],
)
def test_what_cannot_be_saved_pretrained_says_what_to_do(tmp_path, cell, merge, error, says):
    source = CellModel(Job.from_cell(cell), seed=0)
    state = source.build().state_dict()
    with pytest.raises(error) as raised:
        source.save_pretrained(state, tmp_path / "out", merge=merge)
    assert says in str(raised.value)
    assert not (tmp_path / "out").exists()


# -- after a run on the engines --------------------------------------------------------------------


def test_a_pipeline_saves_the_files_data_parallel_saves(pool, tmp_path):
    """A tied Llama, 2 steps data parallel and 2 as a 2-stage pipeline: each saved model loads
    back with transformers' AutoModel giving the kernel's model's logits, and the pipeline's
    safetensors hold its state_dict bit for bit and data parallel's within the strategies'
    equivalence bound. (--delay-init is the kernel's to honour, tested above: a pipeline cannot
    trace a transformers model on the meta device.)"""
    cell = llama_cell(tied=True)
    common = dict(batch_size=8, steps=2, dashboard=False)
    runs = {
        "data": sagenb.train(cell, strategy="data", **common),
        "model": sagenb.train(cell, strategy="model", partitions=2, microbatches=2, **common),
    }
    files = {}
    for strategy, result in runs.items():
        saved = result.save_pretrained(tmp_path / strategy)
        files[strategy] = load_file(saved / "model.safetensors")
        state = result.state_dict()
        assert files[strategy].keys() <= state.keys() and "model.norm.weight" in files[strategy]
        for key, value in files[strategy].items():
            assert torch.equal(value, state[key]), f"{strategy}: {key} differs from state_dict()"
        mine = result.model()
        assert_same(mine.state_dict(), state)
        back = AutoModelForCausalLM.from_pretrained(saved)
        assert isinstance(back, LlamaForCausalLM)
        torch.testing.assert_close(logits(back), logits(mine), rtol=0, atol=0)
    assert files["model"].keys() == files["data"].keys()
    for key, value in files["data"].items():
        # the bound the strategies meet against one process (tests/helpers.py's TOL)
        torch.testing.assert_close(files["model"][key], value, rtol=0, atol=TOL, msg=key)


def test_a_peft_adapter_saves_and_loads_on_its_base(pool, tmp_path):
    """LoRA on a "pretrained" tiny Llama (saved here), 2 steps data parallel, trained as one
    process would: the adapter on the base, and the base with the adapter merged, load back
    giving the trained model's logits."""
    base_dir = tmp_path / "base"
    namespace(llama_cell(tied=True), seed=11)["model"].save_pretrained(base_dir)
    cell = pretrained_peft_cell(str(base_dir))
    result = sagenb.train(cell, batch_size=8, steps=2, dashboard=False)
    check_equal(result, cell, batch_size=8, steps=2)
    mine = result.model()
    assert isinstance(mine, PeftModel)
    lora_b = [v for k, v in result.state_dict().items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)  # trained from peft's zeros

    adapter = result.save_pretrained(tmp_path / "adapter")
    assert (adapter / "adapter_model.safetensors").exists()
    back = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter)
    torch.testing.assert_close(logits(back), logits(mine), rtol=0, atol=0)

    merged = result.save_pretrained(tmp_path / "merged", merge=True)
    assert not (merged / "adapter_config.json").exists()
    back = AutoModelForCausalLM.from_pretrained(merged)
    # W + scale * B @ A folded into one matrix rounds differently from adding the two products
    # (1.2e-7 measured in the logits): the equivalence bound
    torch.testing.assert_close(logits(back), logits(mine), rtol=0, atol=TOL)


def test_save_pretrained_raises_when_nothing_was_written(tmp_path):
    """Onto an existing file transformers logs "should be a directory", writes nothing, and
    sagenb returned the path as if saved."""
    source = CellModel(Job.from_cell(llama_cell()), seed=0)
    model = source.build()
    file = tmp_path / "out"
    file.write_text("mine")
    with pytest.raises(NotADirectoryError, match=f"save_pretrained: {file} is a file, not a"):
        source.save_pretrained(model.state_dict(), file)
    assert file.read_text() == "mine"
    # a library whose save writes nothing, for whatever reason: said, never a saved path
    model.save_pretrained = lambda directory, **kwargs: None
    with pytest.raises(RuntimeError, match=r"wrote nothing to .*folder: see"):
        save_pretrained(model, tmp_path / "folder")


def test_a_cell_that_asks_its_rank_is_built_again_in_the_kernel_as_rank_0_of_1():
    """Before: "Default process group has not been initialized" from result.model() of a cell
    that prints on rank 0 only. The kernel's process group (it had none) is left as it was."""
    import torch.distributed as dist

    cell = SEQUENTIAL_CELL + "if dist.get_rank() == 0:\n    ASKED = dist.get_world_size()\n"
    model = CellModel(Job.from_cell("import torch.distributed as dist\n" + cell), seed=0).build()
    assert isinstance(model, torch.nn.Sequential) and not dist.is_initialized()


def test_a_one_file_save_over_a_sharded_one_is_read_as_transformers_reads_it(tmp_path):
    """Before: the sharded save's index stayed beside the one file (transformers removes the
    shards, not the index), and --delay-init's engines followed it: FileNotFoundError."""
    from sagenb.engine.model.pretrained import INDEX, Checkpoint

    model = LlamaForCausalLM(LlamaConfig(**TIED_LLAMA))
    save_pretrained(model, tmp_path, max_shard_size="20KB")
    save_pretrained(model, tmp_path)
    assert (tmp_path / INDEX).exists()  # transformers' leftover
    checkpoint = Checkpoint.open(tmp_path)
    assert set(checkpoint.files.values()) == {str(tmp_path / "model.safetensors")}
