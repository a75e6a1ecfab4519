"""What sagenb asks of a strategy, answered by the strategy itself.

Each strategy module (data_parallel.py, pipeline.py, sharded.py, tensor.py) defines a
`Description` subclass next to its engine-side implementation and lists its instances in a
module-level `DESCRIPTIONS`; the package finds them (strategies/__init__.py `describe`). The
rest of sagenb asks the description instead of comparing strategy names:

- the config: the options it owns (`options`: each a flag, a keyword, a row of the flag
  reference and a widget, with nothing to edit elsewhere; the other strategies refuse any
  value but the default), their checks (`check`), how the global batch splits (`split`),
  engines to start and replicas. The config asks through its registry
  (config/registry.py `Described`), which the package fills (strategies/__init__.py);
- the notebook: the layout line of the dashboard (`layout`), whether the schedule panel and
  the planner apply (`pipelined`), the engines a run or an export uses (`engines_for`);
- the engines: the implementation that trains (`build`);
- the checks of equivalence with one process (`syncs_norm`).

torchtitan keeps the same kind of answers in one object (`ParallelDims`, torchtitan
`distributed/parallel_dims.py`). Adding a strategy is one new module here; docs/architecture.md
shows one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from sagenb.config.registry import DEFAULT_ENGINES

if TYPE_CHECKING:
    import torch

    from sagenb.config.options import EngineConfig
    from sagenb.config.spec import Option
    from sagenb.engine.strategies.attribution import Attribution
    from sagenb.engine.strategies.base import Strategy

__all__ = ["DEFAULT_ENGINES", "Description", "plural", "require_divides"]


def plural(count: int, word: str) -> str:
    """'1 engine', '2 engines'."""
    return f"{count} {word}{'s' * (count != 1)}"


def require_divides(option: str, size: int, engines: int | None, groups: str) -> None:
    """ConfigError unless `size` (the value of `option`) divides --engines, when given:
    `groups` says what the engines form (for the message)."""
    from sagenb.config.errors import ConfigError

    if engines is not None and engines % size:
        raise ConfigError(option, size, f"must divide --engines ({engines}): {groups}")


class Description:
    """One strategy as the rest of sagenb sees it. Subclasses set the class attributes and
    override what differs from plain data parallel."""

    #: the value of --strategy
    name: ClassVar[str]
    #: a few words for --strategy's help and the docs
    summary: ClassVar[str]
    #: where it comes in --strategy's list (data parallel, the default, first)
    menu_order: ClassVar[int] = 100
    #: the model is split into pipeline stages: --partitions, --microbatches, --schedule and
    #: the cut options apply, `%%smp_plan` plans it, the dashboard draws the schedule
    pipelined: ClassVar[bool] = False
    #: BatchNorm statistics are synchronised across every engine that takes its own samples,
    #: so a BatchNorm model trains as in one process (engine/model/sync_batchnorm.py)
    syncs_norm: ClassVar[bool] = False
    #: every rank holds the whole model and its optimizer state: where it does not fit, the
    #: estimate suggests --strategy sharded
    whole_model_per_rank: ClassVar[bool] = False
    #: options of its own, declared here rather than as fields of the config (sagenb.config's
    #: Option, in an engine section): each becomes a keyword of the config and sagenb.train, a
    #: flag, a row of the flag reference and a widget of the control panel; the config holds
    #: the values (`strategy_options`), the engines read them with `config.option(name)`, and
    #: the other strategies refuse any value but the default
    options: ClassVar[tuple[Option, ...]] = ()

    def check(self, config: EngineConfig) -> None:
        """Refuse option values this strategy cannot run (ConfigError), before any engine
        starts. `config.engines` may be None (resolved later from the pool)."""

    def engines_to_start(self, config: EngineConfig) -> int:
        """Engines a pool needs for `config` when none runs and --engines is not given."""
        return DEFAULT_ENGINES

    def engines_for(self, config: EngineConfig, available: int) -> int:
        """Engines a run uses on a pool of `available`: --engines, else all of them."""
        return config.engines if config.engines is not None else available

    def replicas(self, config: EngineConfig, engines: int) -> int:
        """Groups of engines that each take their own share of a global batch."""
        return engines

    def split(self, config: EngineConfig, engines: int) -> tuple[int, str]:
        """How many equal pieces a global batch is cut into, and the product that says so
        (for the error when --batch-size does not divide)."""
        replicas = self.replicas(config, engines)
        word = "engines" if replicas == engines else "replicas"
        product = f"{replicas} x {config.grad_accum}"
        return replicas * config.grad_accum, f"{word} x grad-accum = {product}"

    def layout(self, config: EngineConfig, engines: int) -> str:
        """The dashboard's one-line layout, without the memory savers ('data parallel on 2
        engines')."""
        return f"{self.name} parallel on {plural(engines, 'engine')}"

    def attribution(self) -> Attribution | None:
        """How its ranks hold the bytes of a traced step and what they send, for the estimate
        (attribution.py, asked by sizing/footprint.py); None: no estimate."""
        return None

    def bubble(self, config: EngineConfig) -> float:
        """The fraction of a step its schedule leaves each engine idle (a pipeline's bubble),
        for the estimate and the planner; 0: every engine works the whole step."""
        return 0.0

    def splits_backward(self, config: EngineConfig) -> bool:
        """Whether the schedule runs each backward as the input's gradient, then the weights'
        later (a zero-bubble pipeline schedule): the schedule panel draws the two apart."""
        return False

    def inner_collectives(self, config: EngineConfig, engines: int) -> tuple[int, tuple[str, ...]]:
        """The collective kinds that run only within groups of consecutive ranks, and the
        groups' size: on instances that each hold whole groups they go at the instance's own
        link, not the network (hybrid sharding's gathers and reduce-scatters); default: every
        collective spans all the engines."""
        return engines, ()

    def build(
        self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device
    ) -> Strategy:
        """The engine-side implementation for one rank."""
        raise NotImplementedError(f"strategy {self.name!r} has no engine implementation")

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"
