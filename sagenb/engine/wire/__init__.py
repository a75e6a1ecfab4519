"""How one engine's ranks talk outside the model: process group, rendezvous store, stop requests,
stack tracing, metric publishing.
"""
