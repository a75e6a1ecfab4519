"""`%smp_cluster`, `%%smp_train`, `%%smp_plan`, `%%smp_export`: thin adapters from a magic
line to the plain Python API.

The flags are generated from TrainConfig's options, its fields and those the strategies declare
(config.every_option, config.flag_arguments), so the magic, the Python call and the help text
(`%%smp_train?`) cannot drift apart. Bad input raises UsageError
before any engine runs.
"""

from __future__ import annotations

import argparse
import ast
import shlex
import typing
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from sagenb.config.errors import ConfigError
from sagenb.config.flags import flag_arguments
from sagenb.config.job import JobError
from sagenb.config.options import TrainConfig, describe, every_option
from sagenb.metrics.result import TrainResult
from sagenb.notebook.export import TARGETS, ExportError, export
from sagenb.pool import cluster
from sagenb.run import kept
from sagenb.run.session import train

__all__ = [
    "SmpMagics",
    "MagicParser",
    "parse_cluster_line",
    "train_parser",
    "cluster_parser",
    "parse_train_line",
    "export_parser",
    "parse_export_line",
]


class _HelpShown(Exception):
    """`--help` printed the help text; nothing else is to be done."""


class MagicParser(argparse.ArgumentParser):
    """argparse whose errors are IPython UsageErrors (no SystemExit inside a kernel)."""

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> typing.NoReturn:
        if status:
            raise UsageError(message or f"{self.prog}: error")
        raise _HelpShown()


def train_parser(*, given_only: bool = False) -> MagicParser:
    """`%%smp_train`'s flags; `given_only`: an option the line leaves out is not in the
    parsed namespace (a --continue takes it from the run it goes on from)."""
    parser = MagicParser(
        prog="%%smp_train",
        epilog="%%smp_train --config panel trains with the options of the last "
        "sagenb.ControlPanel().",
        description=(
            "Train the model the cell defines on the engine pool. The cell runs on every engine "
            "after seeding torch and must define model, dataset and loss_fn; optionally "
            "make_optimizer(params), make_scheduler(optimizer), eval_dataset and "
            "collate_fn(samples) -> batch (DataLoader's, e.g. a transformers data collator)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    _add_config_flags(parser, given_only=given_only)
    return parser


def export_parser() -> MagicParser:
    parser = MagicParser(
        prog="%%smp_export",
        description=(
            "Write a script that trains the cell with these options under torchrun "
            "(torchrun --nproc-per-node N FILE), with no notebook; --to sagemaker also writes "
            "FILE_stem_sagemaker.py (a SageMaker PyTorch estimator), requirements.txt and a "
            "copy of sagenb beside it. The flags are those of %%smp_train."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--to", choices=TARGETS, default="torchrun", help="what to run it with")
    parser.add_argument("file", metavar="FILE", help="the script to write (a .py file)")
    _add_config_flags(parser)
    return parser


def _add_config_flags(parser: MagicParser, *, given_only: bool = False) -> None:
    """One flag per option of TrainConfig, a strategy's own included, spelled as its type and
    default say (config/options.py); `given_only`: none has a default."""
    for option in every_option(TrainConfig):
        names, keywords = flag_arguments(option)
        if given_only:
            keywords["default"] = argparse.SUPPRESS
        parser.add_argument(*names, **keywords)


def cluster_parser() -> MagicParser:
    parser = MagicParser(
        prog="%smp_cluster",
        description="Manage the warm pool of ipyparallel engines that %%smp_train uses.",
        epilog="Examples: %smp_cluster start -n 4 --launcher mpi; %smp_cluster start -n 8 "
        "--launcher slurm --launcher-option SlurmEngineSetLauncher.partition=gpu; "
        "%smp_cluster start --profile mine --cluster-id abc (a pool started by ipcluster).",
        allow_abbrev=False,
    )
    parser.add_argument("action", choices=("start", "status", "stop", "restart"))
    parser.add_argument("-n", "--engines", type=int, default=None, help="number of engines")
    parser.add_argument(
        "--launcher",
        choices=cluster.LAUNCHERS,
        default="local",
        help="ipyparallel's engine launcher; all but local may put engines on other hosts "
        "(the controller then listens beyond 127.0.0.1)",
    )
    parser.add_argument(
        "--launcher-option",
        action="append",
        default=[],
        metavar="CLASS.TRAIT=VALUE",
        help="a setting of ipyparallel's launcher, e.g. MPILauncher.mpi_args=['--oversubscribe']"
        " (repeatable; values read as Python literals, else as text)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        metavar="SECONDS",
        help="start: how long to wait for the engines to register (a Slurm job may wait in "
        "the queue; its state is shown meanwhile); default 120",
    )
    parser.add_argument("--profile", default=None, help="attach: the pool's IPython profile")
    parser.add_argument(
        "--cluster-id", default=None, help="attach to the pool `ipcluster start` started"
    )
    return parser


def _seconds(text: str) -> float:
    """--timeout's value: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds above 0")
    return value


def _launcher_options(items: list[str]) -> dict[str, Any]:
    options = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or "." not in key:
            raise UsageError(
                f"%smp_cluster: --launcher-option {item!r}: must be CLASS.TRAIT=VALUE, e.g. "
                "MPILauncher.mpi_args=['--oversubscribe']"
            )
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def _parse(parser: MagicParser, line: str) -> argparse.Namespace | None:
    """Parsed flags, or None when the line asked for --help (printed)."""
    try:
        return parser.parse_args(shlex.split(line))
    except ValueError as exc:  # shlex: an unclosed quote
        raise UsageError(f"{parser.prog}: cannot read the line: {exc}") from None
    except _HelpShown:
        return None


def _panel_config(line: str) -> TrainConfig:
    from sagenb.notebook.panel import current_panel

    if len(line.split()) > 2:
        raise UsageError("%%smp_train --config panel takes no other flags: set them in the panel")
    panel = current_panel()
    if panel is None:
        raise UsageError("%%smp_train --config panel: no panel yet; run sagenb.ControlPanel()")
    if panel.config is None:
        raise UsageError(
            f"%%smp_train --config panel: the panel's options are invalid: {panel.error}"
        )
    return panel.config


def parse_cluster_line(line: str) -> argparse.Namespace | None:
    """The action and engine count of a `%smp_cluster` line (None for --help)."""
    args = _parse(cluster_parser(), line)
    if args is not None and args.engines is not None and args.engines < 1:
        raise UsageError(f"%smp_cluster: -n {args.engines}: must be an integer >= 1")
    return args


def parse_train_line(line: str) -> TrainConfig | None:
    """The TrainConfig of a `%%smp_train` line (None for --help); UsageError names the flag
    and what is allowed. `--config panel` takes the options of the last ControlPanel."""
    if line.split()[:2] == ["--config", "panel"]:
        return _panel_config(line)
    args = _parse(train_parser(), line)
    return None if args is None else _config(vars(args), "%%smp_train")


def given_train_options(line: str) -> dict[str, Any]:
    """The options a `%%smp_train` line gives, and only those (a --continue takes the rest
    from the run it goes on from)."""
    args = _parse(train_parser(given_only=True), line)
    return {} if args is None else vars(args)


def parse_export_line(line: str) -> tuple[str, str, TrainConfig] | None:
    """(--to, FILE, the TrainConfig) of a `%%smp_export` line (None for --help); bad input
    gets the same UsageErrors as %%smp_train's."""
    args = _parse(export_parser(), line)
    if args is None:
        return None
    options = vars(args)
    target, path = options.pop("to"), options.pop("file")
    return target, path, _config(options, "%%smp_export")


def _config(options: dict[str, Any], prog: str) -> TrainConfig:
    try:
        return TrainConfig(**options)
    except ConfigError as exc:
        raise UsageError(f"{prog}: {exc}") from None


@magics_class
class SmpMagics(Magics):
    #: the last %%smp_plan's estimate: the next %%smp_train with the same flags is projected
    #: on --instance from it (sagenb.train's `estimate`)
    _estimate: Any = None

    @property
    def _user_ns(self) -> dict[str, Any]:
        """The kernel's namespace. Magics types its shell as optional; register_magics, which
        load_ipython_extension calls with the class, makes the instance with its shell."""
        assert self.shell is not None, "SmpMagics made without a shell"
        return self.shell.user_ns

    @line_magic
    def smp_cluster(self, line: str) -> Any:
        args = parse_cluster_line(line)
        if args is None:
            return None
        pool: cluster.EnginePool | None  # None only while nothing runs (the status branch)
        if args.action == "start" and (args.profile is not None or args.cluster_id is not None):
            pool = _guard(
                cluster.attach_pool, profile=args.profile, cluster_id=args.cluster_id or ""
            )
        elif args.action == "start":
            options = _launcher_options(args.launcher_option)
            pool = _guard(
                cluster.start_pool,
                args.engines or cluster.DEFAULT_ENGINES,
                launcher=args.launcher,
                options=options,
                timeout=args.timeout,
                say=print,
            )
        elif args.action == "restart":
            kept.released("%smp_cluster restart")
            pool = _guard(cluster.restart_pool, args.engines)
        elif args.action == "stop":
            kept.released("%smp_cluster stop")
            print(
                "stopped the engine pool" if cluster.stop_pool() else "no engine pool was running"
            )
            return None
        else:
            pool = cluster.current_pool()
            if pool is None and cluster.starting():
                print("the engine pool `%load_ext sagenb` started is still starting: waiting")
                pool = _guard(cluster.ensure_pool, cluster.starting())
            if pool is None:
                print("no engine pool is running: %smp_cluster start -n N")
                return None
            pool.heal()  # engines lost in a failed run are replaced on the pool's next use
        _print_status(pool)
        return None

    @cell_magic
    def smp_train(self, line: str, cell: str) -> None:
        config = parse_train_line(line)
        if config is None:
            return
        pool = cluster.current_pool()
        try:
            # the last %%smp_plan's estimate projects the run when it has the same flags
            if config.continue_:  # what the line leaves out is the kept run's
                given = given_train_options(line)
                result = train(cell, pool=pool, estimate=self._estimate, **given)
            else:
                result = train(cell, config, pool=pool, estimate=self._estimate)
        except BaseException as exc:
            self._keep_failed(exc)
            if isinstance(exc, (ConfigError, JobError)):
                raise UsageError(f"%%smp_train: {exc}") from None
            raise
        out = result.config.out
        self._user_ns[out] = result
        _summary_line(result, f"result in `{out}`")
        if result.live is not None:  # what the engines keep for --continue, and its memory
            print(result.live.describe(out))

    def _keep_failed(self, exc: BaseException) -> None:
        """A run that failed or was interrupted still leaves what it did in its --out (status,
        history so far, parameters when they could be collected), not the previous run."""
        failed = getattr(exc, "result", None)
        if isinstance(failed, TrainResult):
            out = failed.config.out
            self._user_ns[out] = failed
            _summary_line(failed, f"what was done is in `{out}`")
            if failed.live is not None:  # stopped at a step boundary: --continue goes on
                print(failed.live.describe(out))

    @cell_magic
    def smp_plan(self, line: str, cell: str) -> None:
        """Answer, in seconds and without starting an engine, what `%%smp_train` with the same
        flags would need on --instance: memory per rank and whether it fits, step time, hours
        and dollars as ranges, and the assumptions (sagenb.estimate; the Estimate is stored in
        `smp_estimate`). For --strategy model or hybrid, when an engine pool runs, the measured
        partition plan follows (cut points, time and memory per stage, the bubble: sagenb.plan,
        which profiles the blocks on one engine), stored in the variable named by --out
        (default smp_plan_result); without a pool it says how to get it."""
        config = parse_train_line(line)
        if config is None:
            return
        from sagenb.sizing.estimates import estimate

        pool = cluster.current_pool()
        try:
            est = estimate(cell, _plan_config(config, pool))
        except (ConfigError, JobError) as exc:
            raise UsageError(f"%%smp_plan: {exc}") from None
        self._user_ns["smp_estimate"] = est
        self._estimate = est
        _show(est, est.figure)
        if not describe(config.strategy).pipelined:
            return
        if pool is None:
            print(
                "the measured partition plan (cut points, time per stage) profiles the blocks "
                "on an engine: %smp_cluster start, then %%smp_plan again (or sagenb.plan)"
            )
            return
        from sagenb.sizing.planner import plan

        try:
            result = plan(cell, config, pool=pool)
        except (ConfigError, JobError) as exc:
            raise UsageError(f"%%smp_plan: {exc}") from None
        name = config.out if config.out != "smp_result" else "smp_plan_result"
        self._user_ns[name] = result
        _show(result, result.figure)

    @cell_magic
    def smp_export(self, line: str, cell: str) -> None:
        parsed = parse_export_line(line)
        if parsed is None:
            return
        target, path, config = parsed
        try:
            exported = export(cell, path, config, to=target)
        except (ConfigError, JobError, ExportError) as exc:
            raise UsageError(f"%%smp_export: {exc}") from None
        print(exported.summary())


def _plan_config(config: TrainConfig, pool: cluster.EnginePool | None) -> TrainConfig:
    """The config the estimate uses: --engines, else what a run on the running pool would
    use, else what the strategy starts a pool with."""
    if config.engines is not None or pool is None:
        return config
    return config.with_engines(describe(config.strategy).engines_for(config, pool.size))


def _summary_line(result: TrainResult, where: str) -> None:
    """The run's summary and where its result is. In a kernel, while the run's projection on
    --instance is still being made, the line is a display that the projection redraws when it
    comes (or says why none came), after the cell has ended, where the user reads it."""
    from sagenb.display.dashboard import _in_kernel

    projection = result.projection
    if projection is None or not projection.pending or not _in_kernel():
        print(f"{result.summary()}\n{where}")
        return
    from IPython.display import Pretty, display

    handle = display(Pretty(f"{result.summary()}\n{where}"), display_id=True)
    projection.on_end(lambda: handle.update(Pretty(f"{result.summary()}\n{where}")))


def _show(answer: Any, figure: Any) -> None:
    """The answer's text, and its chart where a kernel shows it."""
    print(answer.table())
    from sagenb.display.dashboard import _in_kernel

    if _in_kernel():
        from IPython.display import display

        display(figure())


def _guard(start: Any, *args: Any, **kwargs: Any) -> cluster.EnginePool:
    """Start or attach; a bad launcher setting or a missing cluster reads as a usage error."""
    try:
        return start(*args, **kwargs)
    except ValueError as exc:
        raise UsageError(f"%smp_cluster: {exc}") from None


def _print_status(pool: cluster.EnginePool) -> None:
    rows = pool.status()
    how = "attached" if not pool.owned else f"{pool.launcher} launcher"
    print(f"{len(rows)} engines (ipyparallel, {how}, controller on {pool.controller_host})")
    columns = ("rank", "engine", "pid", "threads", "device", "memory(MiB)", "host")
    print("{:>4} {:>6} {:>8} {:>7} {:<8} {:>11}  {}".format(*columns))
    for r in rows:
        host = r.host if r.address == cluster.LOOPBACK else f"{r.host} ({r.address})"
        row = (r.rank, r.engine_id, r.pid, r.threads, r.device, f"{r.rss_mib:.0f}", host)
        print("{:>4} {:>6} {:>8} {:>7} {:<8} {:>11}  {}".format(*row))
    for r in rows:  # what each engine keeps of a run, for --continue
        if r.kept:
            held = f"step {r.kept['step']} of `{r.kept['cell']}`, {r.kept['mib']:.1f} MiB"
            print(f"rank {r.rank} keeps {held} (--continue goes on from it)")


SmpMagics.smp_train.__doc__ = train_parser().format_help()
SmpMagics.smp_cluster.__doc__ = cluster_parser().format_help()
SmpMagics.smp_export.__doc__ = export_parser().format_help()
SmpMagics.smp_plan.__doc__ = f"{SmpMagics.smp_plan.__doc__}\n{train_parser().format_help()}"
