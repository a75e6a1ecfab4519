"""Solutions to the exercises of notebook 06 (06_bring_your_own_model.ipynb).

They use what the notebook defined (data_run, llama, resnet_run): run them in its kernel after
it ran, `%run -i solutions/06_bring_your_own_model.py`, then run the check cells
again.
"""

# 1. Engine 0's counted tokens over the global batch's.
counted = {
    m.rank: m.values["counted"]
    for m in data_run.metrics  # noqa: F821
    if m.step == 2 and "counted" in m.values
}
answer_1 = counted[0] / sum(counted.values())

# 2. Every tensor in the plan is halved; the RMSNorm weights, not in it, stay whole.
total = sum(p.numel() for p in llama.parameters())  # noqa: F821
whole = sum(p.numel() for name, p in llama.named_parameters() if "norm" in name)  # noqa: F821
answer_2 = whole / total

# 3. Normalised over the global batch: one forward per optimizer step, as in one process.
answer_3 = len(resnet_run.history)  # noqa: F821
