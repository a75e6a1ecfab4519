"""Dashboards fed known metrics, shared by the dashboard's tests: what every rank publishes
after each step (engine/loop.py, memory.py, the pipeline strategy), each value derived from
(step, rank) so that each trace's expected data is known, and a board per layout."""

from __future__ import annotations

from sagenb.config import TrainConfig
from sagenb.display.dashboard import Dashboard
from sagenb.metrics import keys
from sagenb.sizing.cost import CostMeter, instance_price

STEPS = 12
KINDS = dict(zip(keys.MEMORY_KINDS, (1.0, 2.0, 3.0, 4.0)))  # MiB per kind on rank 0; +rank


def step_metrics(step: int, rank: int, reports: bool, pipeline: bool) -> dict:
    """What `rank` publishes after `step` (engine/loop.py, memory.py, the pipeline strategy):
    every value derived from (step, rank), so each trace's expected data is known here."""
    metrics = {
        keys.STEP: step,
        keys.TOTAL_STEPS: STEPS,
        keys.EPOCH: 0,
        keys.LR: 0.1,
        keys.STEP_TIME: 0.01 * step + 0.001 * rank,
        **{keys.memory(kind): mib + rank for kind, mib in KINDS.items()},
    }
    if reports:  # one rank per replica reports its loss (a pipeline's last stage, ...)
        metrics[keys.LOSS] = 1.0 / step + 0.1 * rank
    if step % 3 == 0 and rank == 0:
        metrics[keys.EVAL_LOSS] = 2.0 / step
    if pipeline:
        metrics[keys.BUSY_FORWARD], metrics[keys.BUSY_BACKWARD], metrics[keys.IDLE] = 1, 2, 3
        stage = rank % 2
        events = [[k, stage, m, 0.001 * m, 0.001 * m + 0.0005] for k in "FB" for m in range(2)]
        metrics[keys.TIMELINE], metrics[keys.TIMELINE_T0] = events, 100.0
    return metrics


def run(board: Dashboard, steps: range, pipeline: bool = False) -> None:
    replicas = board.config.replicas(board.engines)
    for step in steps:
        for rank in range(board.engines):
            board.log(step_metrics(step, rank, rank < replicas, pipeline), step, rank)
        board.cost_points.append((float(step), board.cost.cost(float(step))))


def new_board(config: TrainConfig, live: bool = False) -> Dashboard:
    engines = config.engines or 1
    return Dashboard(config, CostMeter(instance_price(config.instance), engines), live=live)


CONFIGS = {
    "data": TrainConfig(engines=2, batch_size=8),
    "sharded": TrainConfig(engines=2, batch_size=8, strategy="sharded"),
    "tensor": TrainConfig(engines=2, batch_size=8, strategy="tensor"),
    "model": TrainConfig(engines=2, batch_size=8, strategy="model", partitions=2),
    "hybrid": TrainConfig(engines=4, batch_size=8, strategy="hybrid", partitions=2),
}
