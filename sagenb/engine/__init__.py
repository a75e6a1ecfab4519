"""The engine side: code that runs inside each ipyparallel engine.

Nothing here imports IPython, ipywidgets or plotly (a test checks it); the only link back to the
notebook is `publish.py`, which imports ipyparallel's data publisher lazily on the engine.
What the engines write outside the user's own folders goes into `scratch.py`'s directory, private
to the user (the notebook reads the ranks' stack dumps from it too).
"""
