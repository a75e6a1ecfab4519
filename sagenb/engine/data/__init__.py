"""The data side of a run on one engine: the contract's sample order (order.py), streams read in
order (stream.py), the cell's collate_fn (collation.py) and the loader that hands the loop each
step's batches (loader.py)."""
