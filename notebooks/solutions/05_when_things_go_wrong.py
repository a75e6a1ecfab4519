"""Solutions to the exercises of notebook 05 (05_when_things_go_wrong.ipynb).

Run them in its kernel after it ran, `%run -i solutions/05_when_things_go_wrong.py`,
then run the check cells again.
"""

# 1. Checkpoints after steps 7, 14 and 21; the crash in step 23 leaves step 21's the newest.
answer_1 = 21 + 1

# 2. An interrupt stops every rank after the same step and checkpoints it there: the resumed
#    run begins with the next step, and nothing runs twice.
answer_2 = 0
