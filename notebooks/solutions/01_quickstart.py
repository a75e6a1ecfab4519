"""Solutions to the exercises of notebook 01 (01_quickstart.ipynb).

They use what the notebook defined: run them in its kernel after it ran,
`%run -i solutions/01_quickstart.py`, then run the check cells again.
"""

# 1. Data parallel splits each global batch among the engines: 64 samples on 4 engines.
answer_1 = 64 // 4

# 2. AdamW keeps two fp32 moments, 8 bytes per parameter, and with data parallel every
#    engine holds the whole model. `model` is the one-process model of "Same model as one
#    process": the same parameters as the engines'.
answer_2 = sum(p.numel() for p in model.parameters()) * 8 / 2**20  # noqa: F821
