"""Checkpoints: written and resumed by every strategy, read without unpickling arbitrary objects."""
