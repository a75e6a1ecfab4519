"""Mixture-of-experts layers: found by their structure (layers.py), their experts spread over
engines with tokens sent to them (dispatch.py, expert parallel), data parallel across the
groups that spread them (groups.py), and the tokens routed to each expert counted for the
dashboard."""

from .dispatch import RoutingCounts, count_routing
from .groups import ExpertGroups
from .layers import PackedExperts, find_packed, packed_experts

__all__ = [
    "ExpertGroups",
    "PackedExperts",
    "RoutingCounts",
    "count_routing",
    "find_packed",
    "packed_experts",
]
