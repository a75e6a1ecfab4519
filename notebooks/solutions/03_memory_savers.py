"""Solutions to the exercises of notebook 03 (03_memory_savers.ipynb).

They use what the notebook defined (n_params, memory, data_run, recomputed): run them in its
kernel after it ran, `%run -i solutions/03_memory_savers.py`, then run the check
cells again.
"""

# 1. fp32 AdamW: 4 bytes of parameter, 4 of gradient, 8 of moments = 16 bytes per parameter;
#    sharded on 4 engines, each keeps a quarter of every tensor.
answer_1 = n_params * 16 / 4 / 2**20  # noqa: F821

# 2. Activations grow with the batch, the model state does not: the batch at which the
#    activations per sample, times the batch, reach the model state.
kept = memory(recomputed["data"])  # noqa: F821
per_sample = kept["activations"] / data_run.config.batch_size  # noqa: F821
answer_2 = (kept["params"] + kept["grads"] + kept["optimizer"]) / per_sample

# 3. Activations are most of an engine's memory here: recomputing them saves most.
answer_3 = "c"
