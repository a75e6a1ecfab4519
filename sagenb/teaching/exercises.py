"""Grading the notebooks' exercises from sagenb's own measurements.

Each exercise of a teaching notebook is a task (markdown), an answer cell (`answer_1 = None`)
and a check cell that calls one function below with the answer and what the notebook's runs
measured: memory per rank and kind, a pipeline's busy and idle time per step, a trained model
against a result's `state_dict()`, an estimate. Every check reads the same way:

- a blank answer (None, or `...`) prints "Exercise N: not answered yet", so a notebook runs top
  to bottom as shipped;
- a right one prints "Exercise N: correct" with the measurement it matched;
- a wrong one raises `WrongAnswer`, whose message says the direction or the kind of error ("a
  factor of 2: count both directions of the ring"), never the measurement, its ratio to the
  answer, or which option is right.

Checks grade in trends and ratios, never in absolute CPU seconds: memory is counted in exact
bytes, and a time enters only as a share of its own step.

The solutions live beside the notebooks (`notebooks/solutions/`); tests/test_notebooks.py runs
each after its notebook, in the same kernel, and requires every check to pass.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sagenb.metrics import keys
from sagenb.metrics.stream import StepMetrics

__all__ = [
    "NOT_ANSWERED",
    "WrongAnswer",
    "answered",
    "check_number",
    "check_choice",
    "check_equal",
    "check_same_model",
    "draw",
    "last_step_memory",
    "idle_share",
]

NOT_ANSWERED = "not answered yet"


class WrongAnswer(AssertionError):
    """An answer that the notebook's measurements contradict."""


def answered(answer: Any) -> bool:
    """False for a blank answer: None (as shipped) or `...`."""
    return answer is not None and answer is not Ellipsis


def _say(exercise: int | str, text: str) -> None:
    print(f"Exercise {exercise}: {text}")


def _blank(exercise: int | str, answer: Any) -> bool:
    if answered(answer):
        return False
    _say(exercise, NOT_ANSWERED)
    return True


def _hint(hint: str) -> str:
    return f". Hint: {hint}" if hint else ""


def _wrong(exercise: int | str, text: str) -> WrongAnswer:
    return WrongAnswer(f"Exercise {exercise}: {text}")


#: factors a wrong number often is off by, and what they say of it: the kind of error, never
#: the measurement (checked after an exercise's own `mistakes`)
UNIT_FACTORS: dict[float, str] = {
    100.0: "a factor of 100: a percentage where a fraction is asked, or the other way round",
    1000.0: "a factor of 1000: check the unit (kB against B, ms against s)",
    1024.0: "a factor of 1024: check the unit (KiB against B, MiB against GiB)",
    1e6: "a factor of a million: check the unit (MB against B)",
    2.0**20: "a factor of 2**20: check the unit (MiB against B)",
    1e6 / 2**20: "MB (10**6 bytes) where MiB (2**20) is asked, or the other way round",
}


def check_number(
    exercise: int | str,
    answer: Any,
    *,
    measured: float,
    what: str,
    rel: float = 0.0,
    absolute: float = 0.0,
    hint: str = "",
    mistakes: Mapping[float, str] | None = None,
) -> None:
    """Grade a number against a measured one: right within `rel` (a fraction of the measured
    value) or `absolute`, whichever is wider.

    A wrong answer's message never gives the measurement, its ratio to the answer or their
    distance (answering 1 and inverting the ratio passed): it says whether the answer is too
    high or too low, and the kind of error where the answer is a known factor off. `mistakes`
    maps such a factor (answer / right answer, as a common mistake gives it: 0.5 for a ring
    all-reduce's one direction) to what it says; UNIT_FACTORS (and their inverses) follow."""
    if _blank(exercise, answer):
        return
    value = _number(exercise, answer, what, hint)
    tolerance = max(rel * abs(measured), absolute)
    if math.isfinite(value) and abs(value - measured) <= tolerance:
        _say(exercise, f"correct: {value:.4g} against {what} of {measured:.4g}")
        return
    within = f"{rel:.0%}" if rel * abs(measured) >= absolute else f"{absolute:g}"
    kind = _kind_of_error(value, measured, rel, mistakes or {})
    way = "too high" if value > measured else "too low"
    said = f"{kind} ({way})" if kind else way
    raise _wrong(
        exercise, f"{_shown(answer)} is not {what}: {said}; within {within} needed{_hint(hint)}"
    )


def _number(exercise: int | str, answer: Any, what: str, hint: str) -> float:
    """The answer as a float, or WrongAnswer saying why it is not a number."""
    if isinstance(answer, torch.Tensor) and answer.is_meta:
        raise _wrong(exercise, f"a meta tensor, which holds no value: give the number ({what})")
    if isinstance(answer, torch.Tensor) and answer.numel() == 1:
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        raise _wrong(exercise, f"expected a number ({what}), got {_shown(answer)}")
    try:
        return float(answer)
    except (OverflowError, ValueError):  # an int past float's range
        raise _wrong(exercise, f"{_shown(answer)} is far from {what}{_hint(hint)}") from None


def _kind_of_error(
    answer: float, measured: float, rel: float, mistakes: Mapping[float, str]
) -> str:
    """What a known factor between the answer and the measurement says, or "" where the
    answer is no such factor off (within the exercise's own relative tolerance, at least 2%)."""
    if not (measured and math.isfinite(answer) and answer / measured > 0):
        return ""
    ratio = answer / measured
    close = max(rel, 0.02)
    for factor, says in mistakes.items():
        if abs(ratio / factor - 1) <= close:
            return says
    # the nearest unit factor, either way round (1000 and 1024 are 2.4% apart)
    off = {
        abs(math.log(ratio * f**way)): says for f, says in UNIT_FACTORS.items() for way in (1, -1)
    }
    nearest = min(off)
    return off[nearest] if nearest <= math.log1p(close) else ""


def check_choice(
    exercise: int | str,
    answer: Any,
    *,
    options: Mapping[str, str],
    correct: str,
    wrong: Mapping[str, str],
) -> None:
    """Grade a multiple-choice answer: one of `options`' keys (case and spaces ignored).
    `correct` is the option the measurement supports; `wrong` says, for each other option,
    what the measurement shows against it. A wrong choice's message is that option's own
    text alone: it never names, or rules everything out but, the right one."""
    if _blank(exercise, answer):
        return
    choice = str(answer).strip().lower()
    if choice not in options:
        allowed = ", ".join(repr(k) for k in options)
        raise _wrong(exercise, f"{answer!r} is not an option: answer one of {allowed}")
    if choice == correct:
        _say(exercise, f"correct: ({choice}) {options[choice]}")
        return
    missing = sorted(set(options) - {correct} - set(wrong))
    if missing:
        raise ValueError(f"check_choice: no feedback for the wrong option(s) {missing}")
    says = wrong[choice]
    if options[correct].lower() in says.lower() or f"({correct})" in says:
        raise ValueError(f"check_choice: the feedback for {choice!r} names the right option")
    raise _wrong(exercise, f"not ({choice}) {options[choice]!r}: {says}")


def check_equal(
    exercise: int | str, answer: Any, *, expected: Any, what: str, hint: str = ""
) -> None:
    """Grade an exact answer (a count, a step, a set of names) against what was measured.
    A set given as a list or tuple counts as that set when `expected` is a set."""
    if _blank(exercise, answer):
        return
    if _plain_equal(answer, expected):
        _say(exercise, f"correct: {what} is {expected!r}")
        return
    raise _wrong(exercise, f"{_shown(answer)} is not {what}{_hint(hint)}")


class _NotPlain(Exception):
    """An answer that is not plain data (numbers, text, sequences, sets, dicts of them)."""


def _plain_equal(answer: Any, expected: Any) -> bool:
    """Whether `answer` is `expected` as plain values, compared by Python's own types: the
    answer's own __eq__ is never asked (one that says yes to anything passed), a one-element
    tensor or numpy scalar counts as its number, True is not 1, NaN is nothing, and a list or
    tuple counts as a set where `expected` is one."""
    try:
        if isinstance(expected, (set, frozenset)):
            if not isinstance(answer, (list, tuple, set, frozenset)):
                return False
            return frozenset(_plain(a) for a in answer) == _plain(expected)
        return bool(_plain(answer) == _plain(expected))
    except (_NotPlain, TypeError):  # TypeError: an unhashable member of a set
        return False


def _plain(value: Any) -> Any:
    """`value` as builtin values only; _NotPlain for anything else (a numpy array, a meta
    tensor, an object of its own)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return ("bool", value)  # tagged: True == 1 for Python, not for a grader
    if isinstance(value, torch.Tensor):
        if value.is_meta or value.numel() != 1:
            raise _NotPlain
        return _plain(value.item())
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)  # OverflowError past float's range: a Fraction of 10**400
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass's own __eq__ left behind
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted(((_plain(k), _plain(v)) for k, v in value.items()), key=repr))
    raise _NotPlain


def _shown(value: Any) -> str:
    """The answer as its message shows it: repr, at most 60 characters; an int too long
    for Python to print (over 4,300 digits) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4096:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # an object whose repr raises: its type says enough
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def check_same_model(
    exercise: int | str,
    answer: Any,
    *,
    expected: Mapping[str, torch.Tensor],
    what: str,
    atol: float,
) -> None:
    """Grade a model trained by the student (an nn.Module or its state_dict) against the
    parameters a run ended with (`result.state_dict()`): the same keys, every floating-point
    entry within `atol`."""
    if _blank(exercise, answer):
        return
    if isinstance(answer, nn.Module):
        answer = answer.state_dict()
    if not isinstance(answer, Mapping):
        raise _wrong(exercise, f"expected a model or its state_dict, got {type(answer).__name__}")
    missing = sorted(set(expected) - set(answer))
    if missing:
        raise _wrong(exercise, f"the model has no {', '.join(missing[:3])}: not {what}'s model")
    diff = 0.0
    for key, value in expected.items():
        diff = max(diff, _difference(exercise, key, answer[key], value))
    if diff <= atol:
        _say(exercise, f"correct: largest parameter difference from {what}: {diff:.1e}")
        return
    raise _wrong(
        exercise,
        f"largest parameter difference from {what} is {diff:.1e} (at most {atol:g} needed): "
        "check the seed, the sample order, the batch and the optimizer against the run's config",
    )


def _difference(exercise: int | str, key: str, given: Any, run: torch.Tensor) -> float:
    """The largest difference of one entry from the run's, or WrongAnswer saying why it
    cannot be one: not a tensor, a meta tensor, another shape (broadcasting a (1,) tensor
    against (4, 4) passed), NaN or inf on either side (Python's max skipped a NaN)."""
    if not isinstance(given, torch.Tensor):
        kind = f"{type(given).__module__}.{type(given).__name__}".removeprefix("builtins.")
        raise _wrong(exercise, f"the model's {key} is a {kind}, not a torch.Tensor")
    if given.is_meta:
        raise _wrong(exercise, f"the model's {key} is a meta tensor, which holds no values")
    if given.shape != run.shape:
        raise _wrong(
            exercise, f"the model's {key} is {list(given.shape)}, the run's is {list(run.shape)}"
        )
    if not run.is_floating_point():
        return 0.0
    for side, tensor in (("the model's", given), ("the run's", run)):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = "NaN" if bool(torch.isnan(tensor).any()) else "inf"
            raise _wrong(exercise, f"{side} {key} holds {bad}: not a trained model to compare")
    diff = (given.double() - run.double()).abs().max().item()
    if not math.isfinite(diff):  # finite values whose difference overflows float64
        raise _wrong(exercise, f"the model's {key} differs from the run's past float64's range")
    return diff


def draw(student: Any, choices: Sequence[Any], *, what: str) -> Any:
    """One student's own figure for an exercise: one of `choices`, picked by a hash of
    `student` (the name or number they typed) and `what` the figure is, so that answers
    differ between students and cannot be copied, while one student gets the same figure
    every time the notebook runs. A blank `student` (None, "") is refused with what to type."""
    if student is None or not str(student).strip():
        raise ValueError("student: type your name or a number of your own, e.g. student = 'ada'")
    key = f"{str(student).strip().lower()}\0{what}".encode()
    index = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % len(choices)
    return choices[index]


# -- what the checks read from a result's metrics ---------------------------------------------


def last_step_memory(metrics: Iterable[StepMetrics], kind: str) -> dict[int, float]:
    """MiB of one kind ("params", "grads", "optimizer", "activations") per rank, at the last
    step that reported it (`result.metrics`)."""
    if kind not in keys.MEMORY_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(keys.MEMORY_KINDS)}")
    key = keys.memory(kind)
    records = [m for m in metrics if key in m.values]
    if not records:
        raise ValueError(f"no rank reported {key}: is this a finished run's metrics?")
    last = max(m.step for m in records)
    return {m.rank: float(m.values[key]) for m in records if m.step == last}


def idle_share(metrics: Iterable[StepMetrics], *, skip: int = 2) -> dict[int, float]:
    """A pipeline's measured bubble per rank: idle / (forward + backward + idle), summed over
    the steps after the first `skip` (warm-up), from `result.metrics`."""
    busy: dict[int, float] = {}
    idle: dict[int, float] = {}
    for m in metrics:
        if keys.IDLE not in m.values or m.step <= skip:
            continue
        work = m.values[keys.BUSY_FORWARD] + m.values[keys.BUSY_BACKWARD]
        busy[m.rank] = busy.get(m.rank, 0.0) + work
        idle[m.rank] = idle.get(m.rank, 0.0) + m.values[keys.IDLE]
    if not idle:
        raise ValueError(f"no pipeline step after the first {skip} reported {keys.IDLE}")
    return {rank: idle[rank] / (idle[rank] + busy[rank]) for rank in sorted(idle)}
