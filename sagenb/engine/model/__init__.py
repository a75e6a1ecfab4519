"""The model as the cell built it: its blocks, delayed initialisation, activation checkpointing,
no key/value cache while it trains, BatchNorm over the global batch, and what keeps it from
training as one process would.
"""
