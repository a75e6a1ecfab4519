"""Solutions to the exercises of notebook 09 (09_working_in_steps.ipynb).

They use what the notebook defined (smp_result, reference): run them in its kernel after it
ran, `%run -i solutions/09_working_in_steps.py`, then run the check cells again.
"""

import math

# 1. --steps is the run's total, as with --resume: the second cell went on from step 24 to 40.
answer_1 = 40 - 24

# 2. FSDP2 cuts each parameter's first dimension as torch.chunk(2) does: rank 0 takes
#    ceil(n / 2) rows. model.parameters() lists the tied embedding and head once.
answer_2 = sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in reference.parameters())  # noqa: F821
