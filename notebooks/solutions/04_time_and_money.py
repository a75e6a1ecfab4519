"""Solutions to the exercises of notebook 04 (04_time_and_money.ipynb).

They use what the notebook defined (scaling, instance_price, student, time_and_money): run
them in its kernel after it ran, `%run -i solutions/04_time_and_money.py`, then run the check
cells again.
"""

import math

# 1. Amdahl's law with the fitted parallel fraction.
p = scaling.parallel_fraction  # noqa: F821
answer_1 = 1 / ((1 - p) + p / 4)

# 2. The estimate adds the inter-instance all-reduce; the fit came from one machine.
answer_2 = "b"

# 3. n engines: ceil(n / 4) instances of 4 GPUs, or n of one.
n = time_and_money.figures(student)["engines"]  # noqa: F821
big, small = instance_price("ml.g5.12xlarge"), instance_price("ml.g5.xlarge")  # noqa: F821
answer_3 = math.ceil(n / 4) * big.usd_per_hour / (n * small.usd_per_hour)
