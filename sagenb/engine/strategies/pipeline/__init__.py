"""Pipeline model parallel, and hybrid (data parallel across pipeline replicas): the strategy and
every helper it needs. The model is split into stages at block boundaries (by torch.fx in
`partition`, by torch.export in `export_split`), at cuts chosen from a profile (`balance`,
`cuts`, whose choice the planner's engine side shares), placed on engines and ordered as torch's
schedules do (`orders`), and stepped by those schedules (GPipe and 1F1B by `prefetch_schedule`
on gloo) whose messages carry tensors only (`tensor_messages`);
`metadata_inference` keeps the shape-finding pass PipelineStage makes at the first step from
changing the model or raising. Its options (--partitions, --schedule, the cut options ...) are
its own, declared and checked in `options`; what the registry asks of it, `description`.

What others may use of it is named here, and nothing else: the registry's DESCRIPTIONS, the
options and their choices, and what the planner and the estimate (sagenb/sizing/) ask of a
pipeline: the cuts, the split and the profile the trainer itself would use.
"""

from .balance import BlockProfile, static_profile
from .cuts import MEMORY_FACTOR, choose_cuts, plan_on_engine
from .description import DESCRIPTIONS, bubble_fraction, schedule_bubble
from .options import MULTI_STAGE, PARTITION_METHODS, SCHEDULES, PipelineOptions, parse_cuts
from .orders import engine_of
from .partition import split_model

__all__ = [
    "DESCRIPTIONS",
    "MEMORY_FACTOR",
    "MULTI_STAGE",
    "PARTITION_METHODS",
    "SCHEDULES",
    "BlockProfile",
    "PipelineOptions",
    "bubble_fraction",
    "choose_cuts",
    "engine_of",
    "parse_cuts",
    "plan_on_engine",
    "schedule_bubble",
    "split_model",
    "static_profile",
]
