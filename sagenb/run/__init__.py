"""One training run on the notebook's side: submit it to the pool, follow and contain it, explain
its failures, choose the checkpoint it resumes from, and build its trained model again in the
kernel.
"""
