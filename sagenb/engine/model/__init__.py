"""The model as the cell built it: its blocks, delayed initialisation, activation checkpointing,
BatchNorm over the global batch, and what keeps it from training as one process would.
"""
