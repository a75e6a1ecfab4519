"""Pipeline model parallel, and hybrid (data parallel across pipeline replicas): the strategy and
every helper it needs. The model is split into stages at block boundaries (by torch.fx in
`partition`, by torch.export in `export_split`), at cuts chosen from a profile (`balance`,
`cuts`, shared with the planner through `planning`), and stepped by GPipe or 1F1B schedules
(`prefetch_schedule` on gloo) whose messages carry tensors only (`tensor_messages`).
"""

from .strategy import DESCRIPTIONS

__all__ = ["DESCRIPTIONS"]
