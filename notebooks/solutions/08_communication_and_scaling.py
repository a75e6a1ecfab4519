"""Solutions to the exercises of notebook 08 (08_communication_and_scaling.ipynb).

They use what the notebook defined (psi, fit, P, G, O, step_time, one_engine, strong_4): run
them in its kernel after it ran, `%run -i solutions/08_communication_and_scaling.py`, then run
the check cells again.
"""

# 1. A ring all-reduce sends 2(N-1)/N of the buffer per rank: the gradients' psi bytes, N = 8.
answer_1 = 2 * (8 - 1) / 8 * psi / 1e6  # noqa: F821

# 2. alpha = n x beta where the bandwidth term has grown to the latency.
answer_2 = fit.alpha_s / fit.beta_s_per_byte  # noqa: F821

# 3. ZeRO-2 keeps the parameters whole and shards gradients and optimizer state:
#    P + (G + O) / N < 6 GiB, for the smallest power of 2.
answer_3 = next(2**k for k in range(11) if P + (G + O) / 2**k < 6)  # noqa: F821

# 4. Strong scaling: the same global batch, ideal t(4) = t(1) / 4.
answer_4 = step_time(one_engine) / (4 * step_time(strong_4))  # noqa: F821
