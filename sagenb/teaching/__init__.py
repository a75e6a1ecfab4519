"""What the teaching notebooks use beyond the plain API: the graders of their exercises
(exercises.py). Notebook-side: it reads results and never runs on an engine."""
