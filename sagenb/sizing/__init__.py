"""Sizing a run before and after it: memory and FLOPs per rank (the footprint), step time,
hardware, prices and cost, the partition planner, what-if scaling.
"""
