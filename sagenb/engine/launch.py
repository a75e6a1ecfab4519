"""Train a cell under torchrun, with no notebook: what a script from `%%smp_export` runs.

    torchrun --nproc-per-node 2 train.py [--output PATH] [--metrics-file PATH]
        [--checkpoint-dir DIR] [--checkpoint-every N] [--resume]

Each process is one rank and runs the very code a notebook's engine runs (entry.train_rank: the
cell after seeding, the strategy, the loop), so the script trains the model `%%smp_train`
would. Only the surroundings differ: the rendezvous comes from torchrun's environment, rank 0
writes every step's metrics, combined across ranks as `smp_result.history` rows are, as JSON
lines, and the full state_dict is gathered on rank 0 and saved with torch.save.

A rank dies with its torchrun agent: SIGKILLed (an OOM kill, a scheduler's), the agent cannot
stop its ranks, and they would train on as orphans holding their ports, as they did. On Linux
each rank asks the kernel to SIGKILL it when its parent dies (prctl PR_SET_PDEATHSIG, man 2
PR_SET_PDEATHSIG), as the pool's engines are ended by its watcher (sagenb/pool/reaper.py).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.distributed as dist

from sagenb.config.errors import ConfigError
from sagenb.config.job import Job, JobError
from sagenb.engine.entry import RankResult, RankSpec, merge_states, train_rank
from sagenb.engine.wire import process_group
from sagenb.engine.wire.publish import Publisher
from sagenb.engine.wire.rendezvous import bound_store
from sagenb.metrics import keys
from sagenb.metrics.stream import History

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["TorchrunEnv", "main", "parse_args", "LOG_EVERY"]

#: the steps an exported script logs by default: the first, every 10th and the last
LOG_EVERY = 10


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in the run, from the variables torchrun sets."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    addr: str
    port: int
    #: torchrun's agent already hosts the store at addr:port (every rank is its client)
    agent_store: bool

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> TorchrunEnv:
        """torchrun's variables; without them (`python train.py`) one process on this host."""
        if "RANK" not in env:
            return cls(0, 1, 0, 1, "127.0.0.1", 0, agent_store=False)
        world = int(env["WORLD_SIZE"])
        return cls(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            addr=env["MASTER_ADDR"],
            port=int(env["MASTER_PORT"]),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )

    @property
    def hosts_store(self) -> bool:
        """Whether this process hosts the rendezvous store, decided as torch's own env://
        rendezvous does (torch/distributed/rendezvous.py, _create_c10d_store): torchrun's
        agent hosts it when it says so (static and c10d rendezvous do), otherwise rank 0."""
        return self.rank == 0 and not self.agent_store


def parse_args(
    argv: Sequence[str] | None = None, *, script: str | None = None
) -> argparse.Namespace:
    """The script's own command line (SageMaker passes hyperparameters the same way)."""
    stem = Path(script or sys.argv[0]).stem
    parser = argparse.ArgumentParser(
        prog=Path(script or sys.argv[0]).name,
        description="Train the exported cell; run under torchrun, one process per engine.",
    )
    parser.add_argument(
        "--output",
        default=f"{stem}_state.pt",
        help="where rank 0 saves the trained model's full state_dict (torch.save)",
    )
    parser.add_argument(
        "--metrics-file", help="write the logged steps' metrics as JSON lines here, not stdout"
    )
    parser.add_argument(
        "--log-every",
        type=_positive,
        default=LOG_EVERY,
        help="log the first step, every N-th and the last (gathering the ranks' metrics on "
        "rank 0 costs a collective per logged step; 1: every step)",
    )
    parser.add_argument("--checkpoint-dir", help="as %%smp_train's --checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, help="as %%smp_train's")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        type=_true,
        help="continue from the newest checkpoint in --checkpoint-dir (also --resume True)",
    )
    return parser.parse_args(argv)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 1, got {text!r}")
    return int(text)


def _true(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return text.lower() in ("true", "1")


def main(
    cell: str,
    config: EngineConfig,
    argv: Sequence[str] | None = None,
    *,
    script: str | None = None,
) -> None:
    """Train `cell` with `config` as this torchrun process's rank; rank 0 writes the metrics
    and saves the full state_dict to --output."""
    env = TorchrunEnv.from_environ()
    _die_with_agent()
    args = parse_args(argv, script=script)
    try:
        config = _for_this_run(config, args, env)
        job = Job.from_cell(cell)
    except (ConfigError, JobError) as exc:
        if env.rank == 0:
            print(f"sagenb: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    started = time.perf_counter()
    result, state = _run(job, config, env, args)
    if env.rank == 0:
        assert state is not None  # _gather_state gives rank 0 the whole state_dict
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, output)
        print(
            f"sagenb: {result.steps} steps on {env.world_size} rank(s) ({config.strategy}) in "
            f"{time.perf_counter() - started:.1f} s; full state_dict ({len(state)} tensors) "
            f"saved to {output}",
            file=sys.stderr,
        )
    if result.end_error is not None:  # the parameters are saved above; the run still failed
        if result.end_error:
            print(
                f"sagenb: rank {env.rank}: the checkpoint of step {result.steps} could not be "
                f"written to --checkpoint-dir {config.checkpoint_dir}: {result.end_error}",
                file=sys.stderr,
            )
        raise SystemExit(1)


#: prctl(2)'s option: the signal this process gets when its parent dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1


def _die_with_agent(environ: Mapping[str, str] = os.environ) -> None:
    """Under torchrun on Linux, have the kernel SIGKILL this rank when the agent that started
    it dies; if it already has (before this call, or during it), exit now. Elsewhere nothing:
    a script run as `python train.py` under nohup must outlive its shell."""
    if "TORCHELASTIC_RUN_ID" not in environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        print(f"sagenb: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}", file=sys.stderr)
        return
    # the setting counts from now: an agent gone before it (during `import torch`, say) has
    # re-parented this rank to init (pid 1), or, between the two calls, to another pid
    if os.getppid() != parent or (parent == 1 and not _is_agent(1)):
        print(f"sagenb: torchrun's agent (pid {parent}) has exited; rank stops", file=sys.stderr)
        raise SystemExit(1)


def _is_agent(pid: int) -> bool:
    """Whether `pid` runs torchrun (as pid 1 does where a container starts with it); True
    when its command line cannot be read: never stop a rank on a guess."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"torchrun" in cmdline or b"torch.distributed.run" in cmdline


def _for_this_run(config: EngineConfig, args: argparse.Namespace, env: TorchrunEnv) -> EngineConfig:
    """The exported config with the command line's checkpoint options and torchrun's world
    size (validated again, so an impossible split is refused before any rank trains). Only
    the engine options are kept: a script exported before the config had sections passes
    the notebook's options too."""
    config = config.for_engines()
    overrides = {
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every": args.checkpoint_every,
        "resume": args.resume,
    }
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if config.engines == env.world_size:
        return config
    try:
        resized = config.with_engines(env.world_size)
    except ConfigError as exc:
        raise ConfigError(
            exc.name,
            exc.value,
            f"{exc.allowed} (the script was exported for {config.engines} processes and runs "
            f"on {env.world_size}: start it with torchrun --nproc-per-node {config.engines})",
        ) from None
    if env.rank == 0:
        print(
            f"sagenb: exported for {config.engines} processes, training on {env.world_size} "
            "(the same model: every strategy trains as one process would)",
            file=sys.stderr,
        )
    return resized


def _run(
    job: Job, config: EngineConfig, env: TorchrunEnv, args: argparse.Namespace
) -> tuple[RankResult, dict[str, torch.Tensor] | None]:
    """Train as this rank; returns its result and, on rank 0, the full state_dict."""
    store = _host_store(env, config.collective_timeout)
    spec = RankSpec(
        env.rank,
        env.world_size,
        env.addr,
        store.port if store is not None else env.port,
        config.threads_per_engine(env.local_size),
        config,
        job,
        local_rank=env.local_rank,
        local_size=env.local_size,
    )
    writer = _StepWriter(
        env, config.batch_size, args.metrics_file, append=config.resume, every=args.log_every
    )
    try:
        result = train_rank(spec, Publisher(writer, interval=0.0))  # each step to the writer
        return result, _gather_state(result, env)
    finally:
        writer.close()
        process_group.shutdown()


def _host_store(env: TorchrunEnv, timeout_s: float) -> dist.TCPStore | None:
    """The rendezvous store, when this process is the one to host it; the ranks (this one
    too) then connect to it as the notebook's engines connect to the notebook's."""
    if not env.hosts_store:
        return None
    # listening on MASTER_ADDR only, as the notebook's store listens on loopback only; port 0
    # (a plain `python train.py`): the OS picks a free one
    return bound_store(env.addr, env.world_size, timeout_s, port=env.port)


class _StepWriter:
    """The Publisher's `send` under torchrun: the metrics of the steps it logs (the first,
    every `every`-th and the last) are gathered from every rank on rank 0 (every rank
    publishes once per step and decides alike by the step's number, so the gathers line up),
    which combines them as the notebook does (metrics.History) and writes one JSON line per
    logged step. A gather_object per step cost ~2.2 ms of every step (docs/export.md); the
    other steps cost nothing here."""

    def __init__(
        self,
        env: TorchrunEnv,
        batch_size: int,
        path: str | None,
        *,
        append: bool,
        every: int = 1,
    ) -> None:
        self.env, self.batch_size, self.every = env, batch_size, every
        self.started = False
        self.out: TextIO | None = None
        if env.rank == 0:
            self.out = open(path, "a" if append else "w") if path else sys.stdout

    def logged(self, metrics: Mapping[str, Any]) -> bool:
        """Whether this step is logged: the run's first here (a resumed run's too), every
        `every`-th, the last (a stream's last is known only when --steps bounds it)."""
        step, total = metrics[keys.STEP], metrics.get(keys.TOTAL_STEPS)
        first, self.started = not self.started, True
        return first or step % self.every == 0 or step == total

    def __call__(self, batch: dict[str, Any]) -> None:
        for metrics in batch.values():
            if not self.logged(metrics):
                continue
            gathered: list[Any] | None = [None] * self.env.world_size if self.out else None
            dist.gather_object(metrics, gathered, dst=0)
            if self.out is not None and gathered is not None:
                self._write(self.out, gathered)

    def _write(self, out: TextIO, ranks: list[dict[str, Any]]) -> None:
        history = History(self.env.world_size, self.batch_size)
        for rank, metrics in enumerate(ranks):
            history.log(metrics, metrics[keys.STEP], rank)
        row = {**history.steps[0], keys.TOTAL_STEPS: ranks[0][keys.TOTAL_STEPS]}
        out.write(json.dumps(row, default=str) + "\n")
        out.flush()

    def close(self) -> None:
        if self.out is not None and self.out is not sys.stdout:
            self.out.close()


def _gather_state(result: RankResult, env: TorchrunEnv) -> dict[str, torch.Tensor] | None:
    """The full state_dict on rank 0 from every rank's part, in the unsplit model's key
    order (as the notebook merges the parts its engines return)."""
    parts: list[Any] | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(result.state_dict, parts, dst=0)
    if parts is None:
        return None
    return merge_states(parts, result.key_order)
