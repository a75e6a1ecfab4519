"""The graders of the notebooks' exercises (sagenb/teaching/exercises.py): a blank answer is
"not answered yet" and passes, a right one passes, a wrong one fails with a message that says
what the measurement shows. Fast lane: no engines; the metrics are records as the engines
publish them. tests/test_notebooks.py grades the real answers on the notebooks' real runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sagenb.metrics import keys
from sagenb.metrics.stream import StepMetrics
from sagenb.teaching.exercises import (
    NOT_ANSWERED,
    WrongAnswer,
    check_choice,
    check_equal,
    check_number,
    check_same_model,
    idle_share,
    last_step_memory,
)


@pytest.mark.parametrize("blank", [None, ...])
def test_a_blank_answer_is_not_answered_yet(blank, capsys):
    check_number(1, blank, measured=2.0, what="the measured MiB", rel=0.05)
    check_choice(2, blank, options={"a": "x", "b": "y"}, correct="a", why="")
    check_equal(3, blank, expected=4, what="the steps")
    check_same_model(4, blank, expected={}, what="the run", atol=1e-5)
    assert capsys.readouterr().out.splitlines() == [
        f"Exercise {n}: {NOT_ANSWERED}" for n in (1, 2, 3, 4)
    ]


def test_a_number_within_the_tolerance_passes_and_outside_fails_with_its_ratio(capsys):
    check_number(1, 1.04, measured=1.0, what="the measured MiB", rel=0.05)
    check_number(2, torch.tensor(0.98), measured=1.0, what="the measured MiB", rel=0.05)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Exercise 1: correct: 1.04 against the measured MiB of 1")
    assert out[1].startswith("Exercise 2: correct: 0.98")
    with pytest.raises(WrongAnswer) as wrong:
        check_number(1, 2.0, measured=1.0, what="the measured MiB", rel=0.05, hint="AdamW: 2")
    text = str(wrong.value)
    assert "2x the measured MiB (within 5% needed). Hint: AdamW: 2" in text
    assert "1.0 " not in text  # the ratio, not the measurement to copy


def test_an_absolute_tolerance_and_a_zero_measurement(capsys):
    check_number(1, 0.12, measured=0.10, what="the idle share", absolute=0.03)
    assert "Exercise 1: correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match=r"\+2 from the steps computed twice"):
        check_number(1, 2, measured=0, what="the steps computed twice", absolute=0.5)


@pytest.mark.parametrize("bad", ["0.5", True, [1]])
def test_a_number_exercise_names_what_it_expected(bad):
    with pytest.raises(WrongAnswer, match=r"expected a number \(the MiB\), got"):
        check_number(1, bad, measured=1.0, what="the MiB", rel=0.05)


def test_a_choice_right_wrong_and_not_an_option(capsys):
    options = {"a": "the network", "b": "the epochs"}
    check_choice(1, " A ", options=options, correct="a", why="")
    assert "correct: (a) the network" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="not \\(b\\) 'the epochs': comm is 2 ms"):
        check_choice(1, "b", options=options, correct="a", why="comm is 2 ms")
    with pytest.raises(WrongAnswer, match="answer one of 'a', 'b'"):
        check_choice(1, "c", options=options, correct="a", why="")


def test_an_exact_answer_and_a_set_given_as_a_list(capsys):
    check_equal(1, 22, expected=22, what="the step it resumes at")
    check_equal(2, ["grads", "params"], expected={"params", "grads"}, what="the kinds")
    out = capsys.readouterr().out
    assert "Exercise 1: correct: the step it resumes at is 22" in out
    assert "Exercise 2: correct: the kinds is" in out
    with pytest.raises(WrongAnswer, match="21 is not the step it resumes at. Hint: one more$"):
        check_equal(1, 21, expected=22, what="the step it resumes at", hint="one more")


def test_a_model_against_a_run(capsys):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    check_same_model(1, model, expected=state, what="the run", atol=1e-6)
    assert "Exercise 1: correct: largest parameter difference from the run: 0.0e+00" in (
        capsys.readouterr().out
    )
    with torch.no_grad():
        model.weight += 1e-3
    with pytest.raises(WrongAnswer, match=r"is 1.0e-03 \(at most 1e-06 needed\)"):
        check_same_model(1, model, expected=state, what="the run", atol=1e-6)
    with pytest.raises(WrongAnswer, match="has no bias"):
        check_same_model(1, {"weight": state["weight"]}, expected=state, what="the run", atol=1)
    with pytest.raises(WrongAnswer, match="expected a model or its state_dict, got float"):
        check_same_model(1, 0.5, expected=state, what="the run", atol=1)


def _memory(step: int, rank: int, optimizer: float) -> StepMetrics:
    return StepMetrics(step, rank, {keys.STEP: step, keys.MEMORY_OPTIMIZER: optimizer})


def test_last_step_memory_reads_each_rank_at_the_last_step():
    records = [_memory(1, 0, 1.0), _memory(1, 1, 1.0), _memory(2, 1, 2.5), _memory(2, 0, 2.0)]
    assert last_step_memory(records, "optimizer") == {0: 2.0, 1: 2.5}
    with pytest.raises(ValueError, match="kind='moments': expected one of params, grads"):
        last_step_memory(records, "moments")
    with pytest.raises(ValueError, match="no rank reported memory/params"):
        last_step_memory(records, "params")


def _stage(step: int, rank: int, forward: float, backward: float, idle: float) -> StepMetrics:
    values = {keys.BUSY_FORWARD: forward, keys.BUSY_BACKWARD: backward, keys.IDLE: idle}
    return StepMetrics(step, rank, values)


def test_idle_share_leaves_out_the_warm_up_steps():
    records = [_stage(1, 0, 1, 1, 8), _stage(2, 0, 1, 2, 1), _stage(3, 0, 1, 2, 1)]
    records += [_stage(2, 1, 2, 2, 0), _stage(3, 1, 1, 1, 2)]
    assert idle_share(records, skip=1) == {0: 2 / 8, 1: 2 / 8}
    assert idle_share(records, skip=0)[0] == pytest.approx(10 / 18)
    with pytest.raises(ValueError, match="no pipeline step after the first 3"):
        idle_share(records, skip=3)


# -- wrong answers that looked right, or crashed the grader -----------------------------------


class _EqualToAll:
    """An answer whose __eq__ says yes to anything."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def _run_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"weight": torch.randn(4, 4), "bias": torch.randn(4)}


def _with(state, key, value):
    return {**state, key: value}


@pytest.mark.parametrize(
    "case, says",
    [
        ("nan in the second entry", "bias holds NaN"),
        ("nan in the run's", "bias holds NaN"),
        ("a (1,) tensor for (4, 4)", r"weight is \[1\], the run's is \[4, 4\]"),
        ("a (4, 4) tensor for (4,)", r"bias is \[4, 4\], the run's is \[4\]"),
        ("numpy", "weight is a numpy.ndarray, not a torch.Tensor"),
        ("meta", "weight is a meta tensor, which holds no values"),
        ("huge", "weight differs from the run's past float64's range"),
        ("not a tensor", "bias is a str, not a torch.Tensor"),
    ],
)
def test_a_wrong_model_is_never_correct_and_never_crashes(case, says):
    """NaN in any entry but the first passed (Python's max skips it), as did a (1,) tensor
    broadcast against (4, 4); numpy arrays and meta tensors crashed the grader."""
    state = _run_state()
    expected = state
    bias_nan = state["bias"].clone()
    bias_nan[2] = float("nan")
    answer = {
        "nan in the second entry": _with(state, "bias", bias_nan),
        "nan in the run's": state,
        "a (1,) tensor for (4, 4)": _with(state, "weight", torch.zeros(1)),
        "a (4, 4) tensor for (4,)": _with(state, "bias", state["bias"].expand(4, 4)),
        "numpy": _with(state, "weight", state["weight"].numpy()),
        "meta": _with(state, "weight", state["weight"].to("meta")),
        "huge": _with(state, "weight", torch.full((4, 4), 1.5e308, dtype=torch.float64)),
        "not a tensor": _with(state, "bias", "0.5"),
    }[case]
    if case == "nan in the run's":
        expected = _with(state, "bias", bias_nan)
    if case == "huge":  # finite on both sides, their difference is not
        expected = _with(state, "weight", torch.full((4, 4), -1.5e308, dtype=torch.float64))
    if case == "a (1,) tensor for (4, 4)":
        expected = _with(state, "weight", torch.zeros(4, 4))
    with pytest.raises(WrongAnswer, match=says):
        check_same_model(1, answer, expected=expected, what="the run", atol=1e-5)


@pytest.mark.parametrize(
    "answer, expected, says",
    [
        (_EqualToAll(), 22, "is not the step"),
        (np.array([22]), 22, "is not the step"),
        (np.array([22, 22]), 22, "is not the step"),
        (torch.tensor(22.0, device="meta"), 22, "is not the step"),
        (10**5000, 22, "an int of 16610 bits is not the step"),
        (True, 1, "is not the step"),
        ([_EqualToAll()], {"params"}, "is not the step"),
        (float("nan"), float("nan"), "is not the step"),
    ],
    ids=["always-equal", "numpy-1", "numpy-2", "meta", "huge", "bool", "set-of-odd", "nan"],
)
def test_an_exact_answer_is_compared_as_plain_values(answer, expected, says):
    """An always-true __eq__ passed; a numpy array crashed ("truth value of an array is
    ambiguous"), as did an int too long to print."""
    with pytest.raises(WrongAnswer, match=says):
        check_equal(1, answer, expected=expected, what="the step")


def test_plain_answers_still_pass(capsys):
    check_equal(1, 22.0, expected=22, what="the step")
    check_equal(2, torch.tensor(22), expected=22, what="the step")
    check_equal(3, np.int64(22), expected=22, what="the step")
    check_equal(4, ("grads", "params"), expected={"params", "grads"}, what="the kinds")
    assert capsys.readouterr().out.count("correct") == 4


@pytest.mark.parametrize(
    "answer, says",
    [
        (10**400, "is far from the measured MiB"),
        (torch.tensor(1.0, device="meta"), "a meta tensor, which holds no value"),
        (np.array([1.0, 2.0]), "expected a number"),
    ],
    ids=["huge", "meta", "numpy"],
)
def test_a_number_that_cannot_be_compared_is_wrong_not_a_crash(answer, says):
    with pytest.raises(WrongAnswer, match=says):
        check_number(1, answer, measured=1.0, what="the measured MiB", rel=0.05)
