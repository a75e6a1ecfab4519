"""The function each engine runs for one training run: set up, train, report, clean up.

ipyparallel calls `run_rank` on every engine as its own task, so the notebook sees the first
failure on its own. Whatever happens, the process group is destroyed before the task returns,
so a failing rank releases its peers instead of leaving them in a collective until the timeout.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from sagenb.config import cell_module
from sagenb.config.errors import ConfigError
from sagenb.config.job import Job, JobError
from sagenb.engine import clean_slate, edited_modules
from sagenb.engine.data.stream import StreamSource
from sagenb.engine.live import kept
from sagenb.engine.loop import train_loop
from sagenb.engine.memory import check_offload
from sagenb.engine.model.equivalence import EquivalenceWarning, equivalence_warnings
from sagenb.engine.model.kv_cache import cache_off
from sagenb.engine.model.recompute import checkpoint_blocks
from sagenb.engine.objective import summed_note
from sagenb.engine.precision import check_supported
from sagenb.engine.scratch import UnsafeDirectory
from sagenb.engine.strategies import make_strategy
from sagenb.engine.torch_private import warm_dynamo
from sagenb.engine.wire import process_group
from sagenb.engine.wire.output import text_output
from sagenb.engine.wire.publish import Publisher
from sagenb.engine.wire.tracing import Tracer, report_crashes
from sagenb.engine.workspace import Workspace, build_workspace
from sagenb.metrics import keys

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = [
    "RankSpec",
    "RankResult",
    "RankFailure",
    "RendezvousFailed",
    "run_rank",
    "train_rank",
    "merge_states",
    "probe",
    "warm",
]


@dataclass(frozen=True)
class RankSpec:
    """Everything one engine needs for one run."""

    rank: int
    world_size: int
    addr: str
    port: int
    threads: int
    config: EngineConfig
    job: Job
    #: the engine's position among the run's engines on its host, and how many there are
    local_rank: int = 0
    local_size: int = 1
    #: the run's random token: only messages carrying it can stop the run (stopping.py)
    token: str = ""
    #: the run's lineage (engine/live/kept.py): when set, the state is kept on the
    #: engine after a run that ends at a step boundary, for --continue; "" for a script
    lineage: str = ""
    #: whether this run goes on from the state its lineage kept (--continue)
    continues: bool = False


@dataclass
class RankResult:
    rank: int
    steps: int
    published: int
    state_dict: dict[str, torch.Tensor] | None
    key_order: list[str]
    device: str
    #: why the run's last checkpoint could not be written ("" on a rank that only heard of
    #: another's failure), or None: the parameters are returned either way
    end_error: str | None = None
    #: MiB the engine keeps of the run for --continue (engine/live/kept.py), or None
    kept_mib: float | None = None


class RankFailure(RuntimeError):
    """A rank failed; carries the original traceback as text (no live frames, no tensors)."""


class RendezvousFailed(RankFailure):
    """The rank's init_process_group raised: the notebook replaces its engine (run/training_run.py),
    as torch keeps state of a failed init that no public API resets."""


def run_rank(spec: RankSpec, publish: Publisher | None = None) -> RankResult:
    publish = publish if publish is not None else Publisher()
    error: Exception | None = None
    tracer = _tracer(spec)  # where this rank is, should the notebook find the run stalled
    result: RankResult | None = None
    try:
        # text bars, no widgets, the run's own warning filters (wire/output.py); equivalence
        # warnings travel with the first step instead, warned once by the notebook
        # (run/training_run.py)
        with text_output(ignore=(EquivalenceWarning,)):
            result = train_rank(spec, publish)
            return result
    except JobError as exc:
        error = JobError(str(exc))
    except ConfigError as exc:  # an option this engine cannot honour (--precision on its device)
        error = ConfigError(exc.name, exc.value, exc.allowed)
    except RendezvousFailed as exc:
        error = exc
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt too: release the peers either way
        where = f"rank {spec.rank} on {socket.gethostname()}, pid {os.getpid()}"
        error = RankFailure(f"{where}:\n{traceback.format_exc()}")
    finally:
        try:
            publish.flush()  # the steps done so far reach the notebook, also after a failure
        except Exception:  # noqa: BLE001 - reporting must not hide the run's own error
            pass
        if result is not None and result.kept_mib is not None:
            process_group.end_segment()  # the group stays up for --continue
        else:
            kept.release()  # a continued run that failed drops what it kept
            process_group.shutdown()
        if tracer is not None:
            tracer.close()
    raise error


def _tracer(spec: RankSpec) -> Tracer | None:
    """The rank's Tracer (tracing.py); None when it cannot be set up: a run that
    cannot show where it stalled still runs."""
    try:
        return Tracer(
            addr=spec.addr,
            port=spec.port,
            rank=spec.rank,
            timeout=timedelta(seconds=spec.config.collective_timeout),
        )
    except UnsafeDirectory as exc:  # said under the cell (rank 0's stderr), every run
        print(f"sagenb: a stalled run cannot show its stacks: {exc}", file=sys.stderr)
        return None
    except Exception:  # noqa: BLE001 - the same store fails init_process_group, with its error
        return None


def train_rank(spec: RankSpec, publish: Publisher) -> RankResult:
    """One rank's whole run (process group, the cell, the strategy, the loop), whoever
    launched the process: an ipyparallel engine (run_rank) or torchrun (launch.py). The
    cell's module (config/cell_module.py) lives as long as the run, and no longer; the
    modules beside the notebook whose files changed since are imported again
    (edited_modules.py). With `spec.lineage` the run's state is kept after it ends at a step
    boundary, its module with it, and `spec.continues` goes on from it (live/kept.py)."""
    if spec.continues:
        return _go_on(spec, publish)
    edited = edited_modules.drop_edited()
    if edited and spec.rank == 0:  # said under the cell (rank 0's output)
        print(
            f"sagenb: {', '.join(edited)} changed since the engines imported "
            f"{'it' if len(edited) == 1 else 'them'}: the modules beside the notebook are "
            "imported again"
        )
    with cell_module.scope() as made:
        try:
            return _train_rank(spec, publish, made)
        finally:
            edited_modules.note()  # what the run imported while it trained


def _train_rank(spec: RankSpec, publish: Publisher, made: list[str]) -> RankResult:
    torch.set_num_threads(spec.threads)
    device = process_group.pick_device(spec.local_rank, spec.local_size)
    _join(spec, device)
    check_supported(spec.config.precision, device)
    check_offload(spec.config.offload_activations, device.type)
    ws = build_workspace(spec.job, spec.config.seed, delay_init=spec.config.delay_init)
    edited_modules.note()  # the files as the cell imported them
    # what keeps this run from training as one process would, from the model as the cell built it
    notes = (
        equivalence_warnings(ws.model, spec.config, collate_draws=ws.collate_draws) + _summed(ws)
        if spec.rank == 0
        else []
    )
    if spec.config.activation_checkpointing:
        checkpoint_blocks(ws.model)  # before any strategy wraps or splits the model
    strategy = make_strategy(spec.config, rank=spec.rank, world_size=spec.world_size, device=device)
    restore_cache = cache_off(ws.model)  # before a pipeline traces it (engine/model/kv_cache.py)
    keeping = False
    try:
        strategy.setup(ws)
        if spec.rank == 0:  # what the strategy left as the cell had it, and why
            notes += getattr(strategy, "notes", [])
        steps, unsaved, segment = train_loop(
            ws,
            strategy,
            spec.config,
            device=device,
            publish=_first_step_with(notes, publish, _read_figure(ws)),
            rank=spec.rank,
            should_stop=process_group.stop_requested,
        )
        result = _rank_result(spec, publish, strategy, steps, device, unsaved)
        if spec.lineage and unsaved is None:
            state = kept.Kept(
                spec.lineage, spec.job.first_line(), spec.config, ws, strategy, segment,
                device, modules=list(made), restore_cache=restore_cache,
            )  # fmt: skip
            made.clear()  # the cell's module stays with the state
            result.kept_mib, keeping = kept.keep(state), True
        return result
    finally:
        if not keeping:
            restore_cache()


def _go_on(spec: RankSpec, publish: Publisher) -> RankResult:
    """The next segment of the run whose state this engine keeps (--continue): the same
    objects, the process group and its store the kept run's, this segment's stop watch; the
    loop goes on after the last step done. A stream is read again from its start up to there
    (engine/data/stream.py), as --resume reads it: the plan read ahead of the last step."""
    state = kept.take(spec.lineage)
    torch.set_num_threads(spec.threads)
    process_group.new_segment(
        rank=spec.rank,
        world_size=spec.world_size,
        addr=spec.addr,
        port=spec.port,
        timeout_s=spec.config.collective_timeout,
        token=spec.token,
    )
    state.segment.go_on(spec.config, state.config)
    if isinstance(state.ws.dataset, StreamSource):
        state.ws.dataset = StreamSource(state.ws.dataset.stream, name=state.ws.dataset.name)
    steps, unsaved, segment = train_loop(
        state.ws,
        state.strategy,
        spec.config,
        device=state.device,
        publish=publish,
        rank=spec.rank,
        should_stop=process_group.stop_requested,
        segment=state.segment,
    )
    result = _rank_result(spec, publish, state.strategy, steps, state.device, unsaved)
    if unsaved is None:
        state.config = spec.config
        result.kept_mib = kept.keep(state)
    return result


def _rank_result(
    spec: RankSpec,
    publish: Publisher,
    strategy: Any,
    steps: int,
    device: torch.device,
    unsaved: str | None,
) -> RankResult:
    return RankResult(
        rank=spec.rank,
        steps=steps,
        published=publish.count,
        state_dict=strategy.full_state_dict(),
        key_order=strategy.key_order,
        device=str(device),
        end_error=unsaved,
    )


def _summed(ws: Workspace) -> list[str]:
    """A loss_fn that sums over the batch, read from the loss_fn (objective.py)."""
    note = summed_note(ws.loss_fn)
    return [note] if note else []


def _join(spec: RankSpec, device: torch.device) -> None:
    """The run's process group; one whose init raises is a RendezvousFailed, so that its
    engine is replaced: torch numbers the default group before it connects
    (pytorch/pytorch#46561, undone by process_group.shutdown) and caches some settings in C++
    for the process's life (gloo's GLOO_DEVICE_TRANSPORT, read once), so a kept engine could
    fail or hang every later run."""
    try:
        process_group.init_process_group(
            rank=spec.rank,
            world_size=spec.world_size,
            addr=spec.addr,
            port=spec.port,
            timeout_s=spec.config.collective_timeout,
            device=device,
            token=spec.token,
        )
    except Exception:  # noqa: BLE001 - whatever failed, this engine is not trusted again
        where = f"rank {spec.rank} on {socket.gethostname()}, pid {os.getpid()}"
        raise RendezvousFailed(
            f"{where}: init_process_group failed; this engine is replaced before the next "
            f"run:\n{traceback.format_exc()}"
        ) from None


def _first_step_with(
    notes: list[str], publish: Publisher, first: dict[str, float]
) -> Callable[[dict], None]:
    """`publish`, adding `notes` to the first step's metrics as "warnings" (the notebook shows
    them, run/training_run.py), and `first`; notes are also warned here, for a script under
    torchrun (launch.py)."""
    for note in notes:
        warnings.warn(note, EquivalenceWarning, stacklevel=2)
    pending: dict[str, Any] = {**first, **({keys.WARNINGS: list(notes)} if notes else {})}

    def send(metrics: dict) -> None:
        nonlocal pending
        if pending:  # the loop's own warnings (--resume's) are kept, after these
            both = [*pending.get(keys.WARNINGS, ()), *metrics.get(keys.WARNINGS, ())]
            metrics = {**metrics, **pending, **({keys.WARNINGS: both} if both else {})}
            pending = {}
        publish(metrics)

    return send


def _read_figure(ws: Workspace) -> dict[str, float]:
    """What this rank read of the cell's pretrained checkpoint, for its first step."""
    if ws.checkpoint is None:
        return {}
    return {keys.PRETRAINED_READ: ws.checkpoint.bytes_read / 2**20}


def merge_states(
    parts: list[dict[str, torch.Tensor] | None], key_order: list[str]
) -> dict[str, torch.Tensor]:
    """The full state_dict from the ranks' parts, in the unsplit model's key order."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    missing = [k for k in key_order if k not in merged]
    if missing:
        raise RuntimeError(f"no rank returned {', '.join(missing[:5])}")
    return {k: merged[k] for k in key_order}


def warm() -> None:
    """Import what the first run would otherwise pay for: DDP's constructor imports
    torch._dynamo lazily, more than a second (benchmarks/results/measured_in_code.md).

    Then freeze what is imported (https://docs.python.org/3/library/gc.html#gc.freeze): the
    ~300,000 objects of torch and its dynamo are never garbage, and the full collection of
    process_group.shutdown() walked them all, about a second per rank, the most of the time
    an interrupted or failed run took to end (a stalled run interrupts its ranks and a peer
    waits for the stuck rank's shutdown); frozen, next to nothing (the figures:
    benchmarks/results/measured_in_code.md)."""
    warm_dynamo()
    import torch.nn.parallel  # noqa: F401

    gc.collect()
    gc.freeze()
    report_crashes()  # a segfault or an abort is named in the cell, not only "died"
    clean_slate.remember()  # the state every run starts from (clean_slate.py)


def probe() -> dict:
    """What `%smp_cluster status` shows of one engine; also warms torch's import."""
    import psutil

    cuda = torch.cuda.is_available()
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cuda_devices": torch.cuda.device_count() if cuda else 0,
        "rss_mib": psutil.Process().memory_info().rss / 2**20,
        "torch": torch.__version__,
        "kept": kept.summary(),  # a run's state kept for --continue (live/kept.py)
    }
