"""Run in a notebook's kernel after its solution passed (tests/test_notebooks.py, with
`%run -i`): every exercise's check again, on answers a student might try instead of solving
it, each of which must be rejected with WrongAnswer.

- the solution tampered with: scaled by 1.5 and by 1/1.5, negated, inverted, off by one, a
  model's parameters moved by 1e-3, each other option of a choice;
- the old attack: answer 1, then each number the feedback shows beyond the exercise's own text,
  and its inverse (the feedback gave the ratio to the measurement: 1.0 "is 0.314x", 3.185 then
  passed);
- another student's figures: where an exercise's figure follows from `student`, the solution
  for this student is rejected for one whose figures differ.

Reads `_tamper_checks` (the check cells' sources, in order) and prints one line,
"tamper report: " and a JSON list of what each exercise accepted that it should not have.
"""

import inspect as _inspect
import json as _json
import re as _re

import torch as _torch

from sagenb.teaching import graders as _graders
from sagenb.teaching.exercises import WrongAnswer as _WrongAnswer


def _tampered(right, others=()):
    """(label, answer) pairs a check must reject, made from the right answer; where it is a
    class of the student's (a DDP of notebook 10), the other exercises' classes."""
    if isinstance(right, type):
        return [(f"exercise {k}'s {c.__name__}", c) for k, c in others if c is not right]
    if isinstance(right, str):
        return [(f"option {o!r}", o) for o in "abcd" if o != right.strip().lower()]
    if isinstance(right, _torch.nn.Module):
        moved = {k: v + 1e-3 if v.is_floating_point() else v for k, v in right.state_dict().items()}
        return [("parameters + 1e-3", moved)]
    if isinstance(right, bool) or not isinstance(right, (int, float)):
        return []
    if isinstance(right, int):
        found = [("+1", right + 1), ("-1", right - 1), ("x2", 2 * right)]
    else:
        found = [("x1.5", right * 1.5), ("/1.5", right / 1.5), ("negated", -right)]
        if right and abs(1 / right - right) > 0.1 * abs(right):
            found.append(("inverted", 1 / right))
    return [(label, answer) for label, answer in found if answer != right]  # 0 x 2 is 0


def _grade(source, name, answer):
    """None where the check accepted `answer`, else its WrongAnswer's message."""
    globals()[name] = answer
    try:
        exec(source, globals())
    except _WrongAnswer as wrong:
        return str(wrong)
    return None


def _from_feedback(source, name):
    """Answers built from the numbers that the feedback on a wrong answer (1) shows beyond the
    exercise's own text: a number written in the check cell or in the graders' source (a hint's
    "t(1) / 4", a tolerance, the engines a student may draw) is no leak of the measurement."""
    said = _grade(source, name, 1.0) or ""
    said = said.split(": ", 1)[-1].replace("1.0 is not", "the answer is not")
    written = source + "".join(
        _inspect.getsource(m) for m in vars(_graders).values() if _inspect.ismodule(m)
    )
    number = r"\d+(?:\.\d+)?(?:e[+-]?\d+)?"
    static = {float(n) for n in _re.findall(number, written)}
    tries = set()
    for n in {float(n) for n in _re.findall(number, said)} - static - {0.0}:
        tries |= {n, 1 / n}
    return sorted(tries)


def _other_student(student):
    """A name whose figures differ from `student`'s in every graded notebook's figures."""
    kinds = [m for m in vars(_graders).values() if hasattr(m, "figures")]
    for k in range(1000):
        name = f"another student {k}"
        if all(
            all(a != b for a, b in zip(m.figures(name).values(), m.figures(student).values()))
            for m in kinds
        ):
            return name
    raise AssertionError("no other student's figures differ")


def _tamper(checks):
    accepted = []
    rights = {k: globals()[f"answer_{k}"] for k in range(1, len(checks) + 1)}
    for k, source in enumerate(checks, start=1):
        name = f"answer_{k}"
        classes = [(j, a) for j, a in rights.items() if j != k and isinstance(a, type)]
        for label, answer in _tampered(rights[k], classes):
            if _grade(source, name, answer) is None:
                accepted.append(f"exercise {k}: {label}")
        if isinstance(rights[k], (int, float)) and not isinstance(rights[k], bool):
            for answer in _from_feedback(source, name):
                if _grade(source, name, answer) is None:
                    accepted.append(f"exercise {k}: {answer!r}, read off the feedback")
        globals()[name] = rights[k]
    if "student" in globals():
        mine = globals()["student"]
        globals()["student"] = _other_student(mine)
        for k, source in enumerate(checks, start=1):
            if "student" in source and _grade(source, f"answer_{k}", rights[k]) is None:
                accepted.append(f"exercise {k}: {mine!r}'s answer, copied by another student")
        globals()["student"] = mine
    return accepted


print("tamper report: " + _json.dumps(_tamper(_tamper_checks)))  # noqa: F821
