"""The check cells' graders, one module a teaching notebook (issue 55).

A check cell calls one function here with the student's answer and the notebook's runs, e.g.
`quickstart.exercise_1(answer_1, smp_result)`. The function derives the exercise's right answer
from the runs out of the student's sight and grades the answer with sagenb.teaching.exercises,
whose feedback says the direction or the kind of error, never the measurement. Where an
exercise's figure is drawn per student (`figures(student)`), two students' answers differ.
"""
