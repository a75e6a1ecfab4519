"""What the notebook shows of runs: the live dashboard, its charts and their drawing, comparisons
and event logs.
"""
