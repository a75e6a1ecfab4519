"""Tensor parallel (Megatron-style column and row splits, data parallel across the groups): the
strategy and every helper it needs. Which layers split and how is a plan (`plan`): shipped by a
transformers model (`hf_plan`), derived from the dataflow (`dataflow`), or given by the cell;
its ParallelStyles are in `styles`, and `check` refuses a plan that cannot work before training.
"""

from .strategy import DESCRIPTIONS

__all__ = ["DESCRIPTIONS"]
