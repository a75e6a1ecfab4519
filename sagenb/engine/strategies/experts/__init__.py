"""Mixture-of-experts layers: found by their structure (layers.py), their experts spread over
engines with tokens sent to them (dispatch.py, expert parallel), data parallel across the
groups that spread them (groups.py), the tokens routed to each expert counted for the
dashboard, the option data and sharded both declare (option.py), and what the estimate
attributes to each engine (attribution.py). The strategies reach it through this face."""

from .attribution import ExpertTokens, expert_held, expert_ranks, expert_sends, watch_experts
from .dispatch import RoutingCounts, count_routing
from .groups import ExpertGroups
from .layers import PackedExperts, find_packed, packed_experts
from .option import EXPERT_PARALLEL, check_expert_parallel, experts_layout

__all__ = [
    "EXPERT_PARALLEL",
    "ExpertGroups",
    "ExpertTokens",
    "PackedExperts",
    "RoutingCounts",
    "check_expert_parallel",
    "count_routing",
    "expert_held",
    "expert_ranks",
    "expert_sends",
    "experts_layout",
    "find_packed",
    "packed_experts",
    "watch_experts",
]
