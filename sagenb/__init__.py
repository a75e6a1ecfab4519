"""sagenb: distributed PyTorch training from a Jupyter cell on a warm ipyparallel engine pool.

    %load_ext sagenb
    %smp_cluster start -n 2
    %%smp_train --strategy data --batch-size 64 --epochs 1

or, from a script, `sagenb.train(job, strategy="data", engines=2, batch_size=64)`;
`%%smp_export --to torchrun train.py` (`sagenb.export`) writes a script that trains the same
way under torchrun, without a notebook.

This module imports nothing heavy: the engine side (`sagenb.engine`) must load without IPython,
ipywidgets or plotly, and the public names below are resolved on first use. It tells the config
how to load the strategies (config/registry.py), since the config imports no strategy, and the
estimate who draws its chart (sizing/drawer.py), since sizing imports no display: every way in,
a notebook, a script or an engine unpickling a config, passes here first.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from sagenb.config import registry as _registry
from sagenb.sizing import drawer as _drawer

__version__ = "0.1.0"

_PUBLIC = {
    "train": "sagenb.run.session",
    "TrainingError": "sagenb.run.failures",
    "TrainingInterrupted": "sagenb.run.failures",
    "OutOfMemoryError": "sagenb.run.failures",
    "EngineDiedError": "sagenb.run.failures",
    "StalledError": "sagenb.run.failures",
    "PoolDiedError": "sagenb.pool.waits",
    "PoolBusyError": "sagenb.pool.run_lock",
    "TrainConfig": "sagenb.config.options",
    "ConfigError": "sagenb.config.errors",
    "JobError": "sagenb.config.job",
    "TrainResult": "sagenb.metrics.result",
    "EquivalenceWarning": "sagenb.engine.model.equivalence",
    "start_pool": "sagenb.pool.cluster",
    "stop_pool": "sagenb.pool.cluster",
    "restart_pool": "sagenb.pool.cluster",
    "current_pool": "sagenb.pool.cluster",
    "attach_pool": "sagenb.pool.cluster",
    "prewarm": "sagenb.pool.cluster",
    "Dashboard": "sagenb.display.dashboard",
    "plan": "sagenb.sizing.planner",
    "estimate": "sagenb.sizing.estimates",
    "Estimate": "sagenb.sizing.estimates",
    "load_checkpoint": "sagenb.run.checkpoints",
    "CheckpointError": "sagenb.run.checkpoints",
    "ControlPanel": "sagenb.notebook.panel",
    "fit_scaling": "sagenb.sizing.whatif",
    "Scaling": "sagenb.sizing.whatif",
    "what_if": "sagenb.sizing.whatif",
    "teaching_case": "sagenb.sizing.whatif",
    "Plan": "sagenb.sizing.planner",
    "export": "sagenb.notebook.export",
    "compare": "sagenb.display.comparison",
}

__all__ = [*sorted(_PUBLIC), "load_ipython_extension"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'sagenb' has no attribute {name!r}")


def _load_strategies() -> None:
    """The strategies' package fills the config's registry as it loads."""
    import sagenb.engine.strategies  # noqa: F401


_registry.loads_with(_load_strategies)


def _draw_estimate(estimate: Any) -> Any:
    """The estimate's chart is plotly's: the display draws it (sizing imports no display)."""
    from sagenb.display.estimate_chart import scaling_figure

    return scaling_figure(estimate)


_drawer.draws_with(_draw_estimate)


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext sagenb`: registers %smp_cluster, %%smp_train, %%smp_plan and %%smp_export,
    and starts the default engine pool in the background (SAGENB_PREWARM=0 in the environment
    turns that off), so that the seconds a pool takes to start (benchmarks/results/first_step.md)
    pass while the first cell is written."""
    from sagenb.pool import cluster

    with cluster.IMPORTS:  # the start's first seconds overlap this thread's import of torch
        if cluster.prewarm_wanted():
            # a failing start never breaks %load_ext: its error is raised by the first run
            cluster.prewarm()
        from sagenb.notebook.magics import SmpMagics

    ipython.register_magics(SmpMagics)
