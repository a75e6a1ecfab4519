"""The graders of the notebooks' exercises (sagenb/teaching/exercises.py): a blank answer is
"not answered yet" and passes, a right one passes, a wrong one fails with a message that says
what the measurement shows. Fast lane: no engines; the metrics are records as the engines
publish them. tests/test_notebooks.py grades the real answers on the notebooks' real runs.
"""

from __future__ import annotations

import re

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
    draw,
    idle_share,
    last_step_memory,
)


@pytest.mark.parametrize("blank", [None, ...])
def test_a_blank_answer_is_not_answered_yet(blank, capsys):
    check_number(1, blank, measured=2.0, what="the measured MiB", rel=0.05)
    check_choice(2, blank, options={"a": "x", "b": "y"}, correct="a", wrong={"b": ""})
    check_equal(3, blank, expected=4, what="the steps")
    check_same_model(4, blank, expected={}, what="the run", atol=1e-5)
    assert capsys.readouterr().out.splitlines() == [
        f"Exercise {n}: {NOT_ANSWERED}" for n in (1, 2, 3, 4)
    ]


def test_a_number_within_the_tolerance_passes_and_outside_says_only_which_way(capsys):
    check_number(1, 1.04, measured=1.0, what="the measured MiB", rel=0.05)
    check_number(2, torch.tensor(0.98), measured=1.0, what="the measured MiB", rel=0.05)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Exercise 1: correct: 1.04 against the measured MiB of 1")
    assert out[1].startswith("Exercise 2: correct: 0.98")
    with pytest.raises(WrongAnswer) as wrong:
        check_number(1, 3.0, measured=1.3, what="the measured MiB", rel=0.05, hint="AdamW: 2")
    assert str(wrong.value) == (
        "Exercise 1: 3.0 is not the measured MiB: too high; within 5% needed. Hint: AdamW: 2"
    )
    with pytest.raises(WrongAnswer, match="too low; within 0.03 needed"):
        check_number(1, 0.01, measured=0.10, what="the idle share", absolute=0.03)


def test_an_absolute_tolerance_and_a_zero_measurement(capsys):
    check_number(1, 0.12, measured=0.10, what="the idle share", absolute=0.03)
    assert "Exercise 1: correct" in capsys.readouterr().out
    with pytest.raises(
        WrongAnswer, match="2 is not the steps computed twice: too high; within 0.5"
    ):
        check_number(1, 2, measured=0, what="the steps computed twice", absolute=0.5)


def test_a_known_factor_off_says_the_kind_of_error():
    ring = {0.5: "a factor of 2: count both halves of the ring"}
    with pytest.raises(WrongAnswer, match=r"count both halves of the ring \(too low\)"):
        check_number(1, 0.876, measured=1.75, what="the MB", rel=0.02, mistakes=ring)
    with pytest.raises(WrongAnswer, match=r"a factor of 1024: check the unit.*\(too high\)"):
        check_number(1, 3.5 * 1024, measured=3.5, what="the MiB", rel=0.05)
    with pytest.raises(WrongAnswer, match=r"a percentage where a fraction is asked.*\(too high\)"):
        check_number(1, 45.0, measured=0.45, what="the idle share", absolute=0.02)
    with pytest.raises(WrongAnswer, match=r"MB \(10\*\*6 bytes\) where MiB .* \(too high\)"):
        check_number(1, 2.0 * 2**20 / 1e6 / 1.1, measured=2.0 / 1.1, what="the MiB", rel=0.02)


@pytest.mark.parametrize(
    "measured, rel, absolute",
    [(3.1853, 0.02, 0.0), (0.3545, 0.0, 0.02), (1.75e6, 0.02, 0.0), (0.0123, 0.05, 0.0)],
)
def test_feedback_never_leads_to_the_answer(measured, rel, absolute):
    """The attack that beat the old feedback: answer 1, read the ratio (or any number) the
    message gives, and answer it, its inverse, or the first answer scaled by it."""

    def grade(answer):
        check_number(1, answer, measured=measured, what="the figure", rel=rel, absolute=absolute)

    for probe in (1.0, 2.0, measured * 3.7, -measured):
        with pytest.raises(WrongAnswer) as wrong:
            grade(probe)
        text = str(wrong.value).replace(repr(probe), "the answer")  # its own answer, echoed
        assert f"{measured:.3g}" not in text
        for number in map(float, re.findall(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?", text)):
            for tried in {number, probe * number, probe / number if number else 0.0}:
                for answer in (tried, 1 / tried) if tried else (tried,):
                    with pytest.raises(WrongAnswer):
                        grade(answer)
                        print(f"{answer} passed, from {number} in {text!r}")


@pytest.mark.parametrize("bad", ["0.5", True, [1]])
def test_a_number_exercise_names_what_it_expected(bad):
    with pytest.raises(WrongAnswer, match=r"expected a number \(the MiB\), got"):
        check_number(1, bad, measured=1.0, what="the MiB", rel=0.05)


def test_a_choice_right_wrong_and_not_an_option(capsys):
    options = {"a": "the network", "b": "the epochs", "c": "the price"}
    wrong = {"b": "both count the same epochs", "c": "hours have no price in them"}
    check_choice(1, " A ", options=options, correct="a", wrong=wrong)
    assert "correct: (a) the network" in capsys.readouterr().out
    with pytest.raises(WrongAnswer) as said:
        check_choice(1, "b", options=options, correct="a", wrong=wrong)
    assert str(said.value) == "Exercise 1: not (b) 'the epochs': both count the same epochs"
    with pytest.raises(WrongAnswer, match="answer one of 'a', 'b', 'c'"):
        check_choice(1, "d", options=options, correct="a", wrong=wrong)


def test_a_choice_feedback_that_names_the_right_option_is_refused():
    """04's old feedback ruled out every option but the right one, by name; the grader now
    takes a text per wrong option and refuses one that names the right option."""
    options = {"a": "the network", "b": "the epochs"}
    with pytest.raises(ValueError, match="the feedback for 'b' names the right option"):
        check_choice(1, "b", options=options, correct="a", wrong={"b": "it is the network"})
    with pytest.raises(ValueError, match="the feedback for 'b' names the right option"):
        check_choice(1, "b", options=options, correct="a", wrong={"b": "(a) fits"})
    with pytest.raises(ValueError, match=r"no feedback for the wrong option\(s\) \['b'\]"):
        check_choice(1, "b", options=options, correct="a", wrong={})


def test_each_student_draws_their_own_figure():
    choices = tuple(range(3, 40))
    mine = draw("ada", choices, what="05 every")
    assert mine == draw(" Ada ", choices, what="05 every")  # the same student, each run
    assert mine in choices
    others = {draw(f"student {k}", choices, what="05 every") for k in range(40)}
    assert len(others) > 10  # spread over the choices, not one answer for all
    for blank in (None, "", "  "):
        with pytest.raises(ValueError, match="student: type your name or a number"):
            draw(blank, choices, what="05 every")


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


def test_the_graders_figures_and_a_derived_answer():
    """sagenb/teaching/graders: a notebook's figures follow from the student alone, and 08's
    ZeRO-2 count is the fewest whole GPUs, not a power of 2."""
    from sagenb.teaching.graders import communication_and_scaling as nb08
    from sagenb.teaching.graders import time_and_money as nb04
    from sagenb.teaching.graders import when_things_go_wrong as nb05

    assert nb08.figures("ada") == nb08.figures("ada")
    assert nb08.figures("ada")["limit_gib"] in nb08.LIMIT_GIB
    assert nb04.figures("ada")["engines"] in nb04.ENGINES
    assert nb05.figures("ada")["every"] in nb05.EVERY
    # P + (G + O) / N < limit: 4 + 12 / N < 6.5 from N = 5 (4.8 would do), not from 8
    assert nb08.smallest_zero2_gpus(4.0, 4.0, 8.0, 6.5) == 5
    assert nb08.smallest_zero2_gpus(4.0, 4.0, 8.0, 7.0) == 5  # 4 gives exactly 7: not under
    with pytest.raises(ValueError, match="limit=4.0: the parameters alone take 4.00 GiB"):
        nb08.smallest_zero2_gpus(4.0, 4.0, 8.0, 4.0)
