"""Solutions to the exercises of notebook 07 (07_fine_tune.ipynb).

They use what the notebook defined (trainable): run them in its kernel after it ran,
`%run -i solutions/07_fine_tune.py`, then run the check cells again.
"""

# 1. AdamW's two fp32 moments for each parameter that trains (the adapters), 8 bytes each;
#    data parallel: every engine holds them all.
answer_1 = trainable * 8 / 2**20  # noqa: F821

# 2. Sharded in 2: each engine keeps half of every adapter, so half of its moments.
answer_2 = 1 / 2
