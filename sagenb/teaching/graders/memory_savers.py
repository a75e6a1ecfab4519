"""The checks of notebook 03 (03_memory_savers.ipynb)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sagenb.teaching.exercises import check_choice, check_number, last_step_memory

STATE = ("params", "grads", "optimizer")
KINDS = (*STATE, "activations")


def _memory(result: Any) -> dict[str, float]:
    """MiB per kind at the last step, the largest over the engines (as the notebook's table)."""
    return {kind: max(last_step_memory(result.metrics, kind).values()) for kind in KINDS}


def exercise_1(answer: Any, adamw_4: Any) -> None:
    """Sharded AdamW's model state per engine on 4 engines."""
    state = [last_step_memory(adamw_4.metrics, kind) for kind in STATE]
    per_engine = {rank: sum(kind[rank] for kind in state) for rank in state[0]}
    check_number(
        1,
        answer,
        measured=max(per_engine.values()),
        rel=0.05,
        what="the model state each of the 4 engines measured",
        hint="count the bytes per parameter first (fp32 parameter, gradient, two AdamW "
        "moments), then what one engine of 4 keeps of them",
        mistakes={
            4.0: "a factor of 4: that is the whole model's state; FSDP splits it in 4",
            0.75: "a quarter short: AdamW keeps two moments, as many bytes as two copies of "
            "the parameters",
        },
    )


def exercise_2(answer: Any, recomputed: Any) -> None:
    """The global batch at which checkpointed activations would equal the model state."""
    kept = _memory(recomputed)
    state = sum(kept[kind] for kind in STATE)
    check_number(
        2,
        answer,
        measured=recomputed.config.batch_size * state / kept["activations"],
        rel=0.10,
        what="the batch at which the measured activations would equal the model state",
        hint="activations per sample = the measured activations / the batch they came from",
    )


def exercise_3(answer: Any, savers: Mapping[str, Any]) -> None:
    """Which saver cut the total MiB per engine the most: `savers` maps the options "a"-"d"
    to their runs (sharded, tensor parallel, activation checkpointing, bf16)."""
    totals = {key: sum(_memory(run).values()) for key, run in savers.items()}
    options = {
        "a": "sharded",
        "b": "tensor parallel",
        "c": "activation checkpointing",
        "d": "bf16",
    }
    what_each = {
        "a": "sharding splits the parameters, gradients and optimizer state; is that the "
        "larger part of an engine's memory here?",
        "b": "tensor parallel splits the weights of its layers, and what their outputs save; "
        "compare its row's total with the others'",
        "c": "checkpointing keeps only each block's input; how large are the activations "
        "against the model state in the data-parallel row?",
        "d": "bf16 halves what autocast saves, not the fp32 parameters, gradients or moments",
    }
    check_choice(
        3, answer, options=options, correct=min(totals, key=totals.__getitem__), wrong=what_each
    )
