"""What runs report: the metric keys (shared with the engines), each rank's stream read in order
into a history, and the result a run leaves.
"""
