"""The live run between cells: its state kept on the engine (kept.py) for --continue, and what
the notebook runs against it (calls.py: on_engines, evaluate, generate)."""
