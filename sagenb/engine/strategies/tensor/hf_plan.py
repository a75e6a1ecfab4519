"""The tensor-parallel plan a transformers model ships, for the model or a wrapper holding it.

transformers models carry their own plan (`model.tp_plan`, built in post_init from the
class's and `config.base_model_tp_plan`; e.g. Llama's splits q/k/v/gate/up column-wise and
o/down row-wise, https://huggingface.co/docs/transformers/perf_infer_gpu_multi). The cell's
model may be such a PreTrainedModel or hold one as a submodule (`self.llm`): every outermost
PreTrainedModel found is used with its plan's keys prefixed by its path.

Embeddings and the output head: the plan's `embedding_rowwise` / `colwise_gather_output`
entries are kept when their weights are their own, and dropped (the layers stay whole) when
they hold a tied parameter (tie_word_embeddings=True): torch's styles replace each module's
weight by a new DTensor parameter, so splitting either one would silently untie them.

Heads: transformers' attention sizes its views with -1 heads (`view(*shape, -1, head_dim)`),
so a column-wise q/k/v gives each engine its own heads with no attribute changed, as in
transformers' own tensor parallel. The key/value heads (GQA) must divide by T, else an engine
would get part of a head: refused here, naming config.num_key_value_heads.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from sagenb.config.job import JobError
from sagenb.engine.torch_private import shipped_tp_plan

__all__ = ["shipped_plans"]


def shipped_plans(model: nn.Module, tp: int) -> tuple[dict[str, str], set[str]]:
    """(plan with full paths, paths of the PreTrainedModels whose plans it holds)."""
    if "transformers" not in sys.modules:  # a model from transformers has imported it
        return {}, set()
    from transformers import PreTrainedModel

    plan: dict[str, str] = {}
    roots: set[str] = set()
    outer: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        if any(path.startswith(p + ".") or p == "" for p in outer):
            continue  # inside one already taken (LlamaForCausalLM's .model)
        outer.append(path)
        own = _plan_of(module)
        if not own:
            continue  # GPT-2 and others ship none: derived like any model
        _check_heads(module, path, tp)
        prefix = f"{path}." if path else ""
        plan.update({prefix + key: style for key, style in own.items()})
        roots.add(path)
    return plan, roots


def _plan_of(model: nn.Module) -> dict[str, str]:
    own = dict(shipped_tp_plan(model) or {})
    if own:
        return own
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return {f"{prefix}.{key}": style for key, style in base.items()}
    return base


def _check_heads(model: nn.Module, path: str, tp: int) -> None:
    # transformers' PretrainedConfig (nn.Module's __getattr__ types it Tensor | Module)
    config: Any = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    where = f"{path}.config" if path else "model.config"
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(count, int) and count % tp:
            raise JobError(
                f"--tensor-parallel {tp}: {where}.{name} = {count} heads cannot be split {tp} "
                f"ways (transformers' plan splits q/k/v projections by heads); use a "
                f"--tensor-parallel that divides {count}, or give tp_plan by hand in the cell "
                "leaving the attention whole"
            )
