"""What the teaching notebooks use beyond the plain API: the graders of their exercises
(exercises.py), notebook 02's bubble lab (bubble_lab.py) and notebook 05's checkpoint interval
(checkpoint_interval.py). Notebook-side: it reads results and never runs on an engine."""
