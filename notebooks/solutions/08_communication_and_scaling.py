"""Solutions to the exercises of notebook 08 (08_communication_and_scaling.ipynb).

They use what the notebook defined (student, communication_and_scaling, psi, fit, P, G, O,
step_time, one_engine, strong_4): run them in its kernel after it ran,
`%run -i solutions/08_communication_and_scaling.py`, then run the check cells again.
"""

import math

# 1. A ring all-reduce sends 2(N-1)/N of the buffer per rank: the gradients' psi bytes.
mine = communication_and_scaling.figures(student)  # noqa: F821
n = mine["engines"]
answer_1 = 2 * (n - 1) / n * psi / 1e6  # noqa: F821

# 2. alpha = n x beta where the bandwidth term has grown to the latency.
answer_2 = fit.alpha_s / fit.beta_s_per_byte  # noqa: F821

# 3. ZeRO-2 keeps the parameters whole and shards gradients and optimizer state:
#    P + (G + O) / N < limit, so N > (G + O) / (limit - P): the next whole number.
answer_3 = math.floor((G + O) / (mine["limit_gib"] - P)) + 1  # noqa: F821

# 4. Strong scaling: the same global batch, ideal t(4) = t(1) / 4.
answer_4 = step_time(one_engine) / (4 * step_time(strong_4))  # noqa: F821
