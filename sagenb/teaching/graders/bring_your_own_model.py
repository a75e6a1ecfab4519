"""The checks of notebook 06 (06_bring_your_own_model.ipynb)."""

from __future__ import annotations

from typing import Any

from sagenb.teaching.exercises import check_equal, check_number, last_step_memory


def exercise_1(answer: Any, data_run: Any) -> None:
    """Engine 0's weight in step 2's token-weighted loss."""
    counted = {
        m.rank: m.values["counted"]
        for m in data_run.metrics
        if m.step == 2 and "counted" in m.values
    }
    check_number(
        1,
        answer,
        measured=counted[0] / sum(counted.values()),
        absolute=0.005,
        what="engine 0's share of step 2's counted tokens",
        hint="the weight is engine 0's counted tokens over the tokens of the global batch",
    )


def exercise_2(answer: Any, data_run: Any, tensor_run: Any) -> None:
    """The share of the model's parameter bytes that Llama's plan leaves whole. An engine of
    tensor_run holds whole + split / 2 of data_run's whole + split, so whole / (whole + split)
    is 2 x their ratio - 1."""
    tensor = max(last_step_memory(tensor_run.metrics, "params").values())
    data = max(last_step_memory(data_run.metrics, "params").values())
    check_number(
        2,
        answer,
        measured=2 * tensor / data - 1,
        rel=0.05,
        what="the measured share of the parameters the plan leaves whole",
        hint="look at the plan printed above: which of the model's tensors are not in it? "
        "Count their parameters against the model's",
        mistakes={2.0: "a factor of 2: the share of the whole model, not of one engine's half"},
    )


def exercise_3(answer: Any, resnet_run: Any) -> None:
    """num_batches_tracked after the data-parallel ResNet run."""
    tracked = {
        int(v) for k, v in resnet_run.state_dict().items() if k.endswith("num_batches_tracked")
    }
    if len(tracked) != 1:
        raise ValueError(f"the BatchNorm layers counted differently: {sorted(tracked)}")
    check_equal(
        3,
        answer,
        expected=tracked.pop(),
        what="the forwards each BatchNorm layer counted",
        hint="one forward per optimizer step over the whole global batch, as one process: how "
        "many steps did the run make?",
    )
