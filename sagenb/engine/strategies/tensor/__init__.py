"""Tensor parallel (Megatron-style column and row splits, data parallel across the groups): the
strategy and every helper it needs. Which layers split and how is a plan (`plan`): shipped by a
transformers model (`hf_plan`), derived from the dataflow (`dataflow`: torch.fx; `recorded`:
one forward recorded with its shapes), or given by the cell; peft's LoRA layers split with
their base layer (`adapters`); its ParallelStyles are in `styles`, and `check` refuses a plan
that cannot work before training.

What others may use of it is named here, and nothing else: the registry's DESCRIPTIONS, and what
the estimate (sagenb/sizing/footprint.py) asks: the plan training would apply, and how each
planned layer splits.
"""

from .check import matches
from .plan import plan_for
from .strategy import DESCRIPTIONS
from .styles import is_conv1d, splits

__all__ = ["DESCRIPTIONS", "is_conv1d", "matches", "plan_for", "splits"]
