"""Where the ranks of a stalled run are, read before any of them is stopped: each rank's
Python stack (dumped by faulthandler on SIGUSR1) and the collectives it has started and not
finished (torch's flight recorder), as engine/wire/tracing.py leaves them.

A rank whose innermost frame is in torch and that has a collective in flight, or that waits in
data parallel's shared-memory all-reduce (engine/wire/shared_memory.py), is *waiting*: the
victim of a peer that does not reach the same collective. A rank busy anywhere else (the cell's
loop, a sleep, a data loader) is *busy*: the culprit.
"""

from __future__ import annotations

import json
import linecache
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sagenb.config.job import CELL_FILE
from sagenb.engine.scratch import read_private
from sagenb.engine.wire.tracing import (
    EXITED,
    STACK_SIGNAL,
    collectives_key,
    crash_path,
    request_key,
    stack_path,
)

__all__ = ["RankTrace", "collect", "describe", "CELL_FILE"]

DUMP_WAIT_S = 1.0  # the most a dump may take to appear (ten times an idle machine's: see
# benchmarks/results/measured_in_code.md)
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
#: where a rank waits for its peers with sagenb's own code innermost: data parallel's gradient
#: all-reduce through shared memory (in Python), and a pipeline stage on gloo waiting for its
#: neighbour's activation or gradient (in a Work.wait called from sagenb's own schedule loop)
_WAITS_IN = tuple(
    os.path.join("sagenb", "engine", *parts)
    for parts in (
        ("wire", "shared_memory.py"),
        ("strategies", "pipeline", "prefetch_schedule.py"),
    )
)
SHOWN_FRAMES = 10  # the outermost 2 and innermost 8 frames, and every frame of the cell


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    name: str


@dataclass
class RankTrace:
    """What one rank was doing when the run stalled."""

    rank: int
    frames: list[Frame] = field(default_factory=list)  # innermost first, as dumped
    collectives: list[dict] = field(default_factory=list)  # in flight, oldest first
    collected: bool = False  # whether a stack was dumped at all
    _last_read: str = field(default="", repr=False)

    @property
    def waiting(self) -> bool:
        """Blocked in a collective (or torch.distributed), not busy in code of its own."""
        inner = self.frames[0].file if self.frames else ""
        if "/torch/distributed/" in inner or inner.endswith(_WAITS_IN):
            return True
        return bool(self.collectives) and (not self.frames or "/torch/" in inner)

    def collective(self) -> str:
        """'gloo:all_reduce (seq 12, sizes [[1000]])' for the oldest in flight, else ''."""
        if not self.collectives:
            return ""
        c = self.collectives[0]
        return f"{c['op']} (seq {c['seq']}, sizes {c['sizes']})"

    def stack(self, source: str = "") -> str:
        """The rank's frames as a Python traceback reads (innermost last), trimmed to the
        frames that matter: the outermost, the innermost, and every one in the cell."""
        if not self.collected:
            return "  (no stack: the rank did not dump one; is its engine on another host?)"
        frames = self.frames[::-1]
        keep = {i for i, f in enumerate(frames) if f.file == CELL_FILE}
        keep |= set(range(2)) | set(range(len(frames) - (SHOWN_FRAMES - 2), len(frames)))
        lines, skipped = [], 0
        for i, f in enumerate(frames):
            if i not in keep:
                skipped += 1
                continue
            if skipped:
                lines.append(f"  ... {skipped} frame{'s' * (skipped > 1)} ...")
                skipped = 0
            lines.append(f'  File "{f.file}", line {f.line}, in {f.name}')
            code = _source_line(f, source)
            if code:
                lines.append(f"    {code}")
        return "\n".join(lines)


def collect(
    pool, store, engine_ids: Mapping[int, int], *, wait_s: float = DUMP_WAIT_S
) -> dict[int, RankTrace]:
    """Ask each rank in `engine_ids` ({rank: engine id}) where it is, and read the answers;
    whatever has not come within `wait_s` is left out (never raises: the run still has to
    be stopped)."""
    port = store.port  # the run's store: its port names the ranks' stack files
    for rank, eid in engine_ids.items():
        _quietly(store.set, request_key(rank), "dump")
        pool.send_signal([eid], STACK_SIGNAL)
    traces = {rank: RankTrace(rank) for rank in engine_ids}
    deadline = time.monotonic() + wait_s
    pending = set(engine_ids)
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(pending):
            if _read(traces[rank], store, port):
                pending.discard(rank)
    for rank in engine_ids:
        try:
            os.remove(stack_path(port, rank))
        except OSError:
            pass
    return traces


def _read(trace: RankTrace, store, port: int) -> bool:
    """Fill in what has come; True when both the stack and the collectives have."""
    if not trace.collected:
        # faulthandler writes line by line from the signal handler: a dump is complete
        # when it reads the same twice, a poll apart
        text = _read_file(stack_path(port, trace.rank))
        frames = _main_frames(text) if text and text == trace._last_read else None
        if frames is not None:
            trace.frames, trace.collected = frames, True
        trace._last_read = text
    key = collectives_key(trace.rank)
    got = _quietly(store.check, [key])
    if got:
        trace.collectives = json.loads(store.get(key).decode())
    return trace.collected and bool(got)


def _read_file(path: str) -> str:
    """The dump, read only from the private directory the rank writes it to (scratch.py),
    never through a link."""
    try:
        return read_private(path)
    except OSError:  # UnsafeDirectory too: the rank refused to dump there
        return ""


#: faulthandler's words for the fatal signals it reports, and the signals' names
_FATAL = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
CRASH_LINES = 12  # of the crashing thread's stack, innermost first


def crash_report(pid: int | None) -> str:
    """How the engine of process `pid` died, from its crash report (engine/wire/tracing.py):
    the signal and the stack of the thread it hit; '' when it reported none. The report is
    removed once read."""
    if pid is None:
        return ""
    path = crash_path(pid)
    text = _read_file(path)
    _quietly(os.remove, path)
    lines = text.splitlines()
    if lines and lines[0].startswith(EXITED):
        where = "\n".join(_crashed_thread(lines)[:CRASH_LINES])
        return (
            f"not killed: its process called {lines[0].removeprefix(EXITED).strip()}, which "
            f"ends it at once, with no exception to report (sys.exit raises SystemExit, which "
            f"is reported as the rank's error), in (most recent call first):\n{where}"
        )
    if not lines or not lines[0].startswith("Fatal Python error: "):
        return ""
    what = lines[0].removeprefix("Fatal Python error: ").strip()
    name = _FATAL.get(what)
    head = f"{name} ({what})" if name else what
    frames = _crashed_thread(lines)
    if any("torch/distributed/" in f for f in frames[:3]):
        head += (
            " in a collective: gloo aborts when the ranks' collectives do not match (one rank "
            "calling an all_reduce the others do not, or with other sizes); every rank must "
            "call the same collectives in the same order"
        )
    where = "\n".join(frames[:CRASH_LINES])
    return f"{head}, in (most recent call first):\n{where}" if where else head


def _crashed_thread(lines: list[str]) -> list[str]:
    """The frames of the thread the signal hit ("Current thread"); when it hit a thread with
    no Python frames (gloo aborting in its own thread), the rank's thread, which runs
    run_rank: where the cell was (in which collective)."""
    blocks: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith(("Current thread", "Thread 0x")):
            blocks.append((line, []))
        elif blocks and line.startswith("  File "):
            blocks[-1][1].append(line)
    for head, frames in blocks:
        if head.startswith("Current thread") and frames:
            return frames
    return next((frames for _, frames in blocks if any("in run_rank" in f for f in frames)), [])


def _main_frames(text: str) -> list[Frame] | None:
    """The frames of the thread that runs the rank (named on the file's first line), cut at
    the engine's entry: what ipyparallel ran it from is noise. None until a complete dump."""
    header, _, dump = text.partition("\n")
    main = header.rsplit(" ", 1)[-1]
    blocks = {m.group(1): m.start() for m in _THREAD.finditer(dump)}
    if main not in blocks or not dump.endswith("\n"):
        return None
    frames = []
    for line in dump[blocks[main] :].splitlines()[1:]:
        m = _FRAME.match(line)
        if m is None:
            break
        frame = Frame(m.group(1), int(m.group(2)), m.group(3))
        if frame.name == "run_rank" and frame.file.endswith(os.path.join("engine", "entry.py")):
            break
        frames.append(frame)
    return frames


def _source_line(frame: Frame, source: str) -> str:
    if frame.file == CELL_FILE:
        lines = source.splitlines()
        return lines[frame.line - 1].strip() if 0 < frame.line <= len(lines) else ""
    return linecache.getline(frame.file, frame.line).strip()


def _quietly(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - the store or an engine may be what failed
        return None


def describe(
    traces: Mapping[int, RankTrace], stuck: Sequence[int], ids: Sequence[int], source: str
) -> str:
    """Each stuck rank's stack, then each waiting one's, for the error's message."""
    parts = []
    for rank in [*stuck, *(r for r in traces if r not in stuck)]:
        t = traces[rank]
        what = "stuck" if rank in stuck else ("waiting" if t.waiting else "running")
        where = f", in {t.collective()}" if t.collective() else ""
        parts.append(f"rank {rank} (engine {ids[rank]}), {what}{where}:\n{t.stack(source)}")
    return "\n".join(parts)


def culprits(traces: Mapping[int, RankTrace], steps: Mapping[int, int]) -> tuple[list, list]:
    """(stuck, waiting) ranks: stuck are those busy in code of their own; when every rank
    waits in a collective (ranks in different collectives), those whose last reported step is
    lowest."""
    waiting = [r for r, t in traces.items() if t.waiting]
    busy = [r for r in traces if r not in waiting]
    if busy:
        return busy, waiting
    lowest = min((steps.get(r, 0) for r in traces), default=0)
    return [r for r in traces if steps.get(r, 0) == lowest], waiting


#: what a rank reading its eval stream is doing (engine/data/stream.py ReadOnce.items)
READING_EVAL = (
    "(reading eval_dataset, a stream read whole at its first evaluation: one that never ends "
    "never lets the evaluation start; give it an end, e.g. itertools.islice(stream, N))"
)


def _reading_eval(trace: RankTrace | None) -> bool:
    return trace is not None and any(
        f.name == "items" and f.file.endswith(os.path.join("engine", "data", "stream.py"))
        for f in trace.frames
    )


def summary(
    traces: Mapping[int, RankTrace],
    stuck: Sequence[int],
    waiting: Sequence[int],
    steps: Mapping[int, int],
) -> str:
    """'rank 1 did not finish step 4 (busy in its own code); rank 0 was waiting for it in
    gloo:all_reduce (seq 12, sizes [[16, 8]])'."""

    def step(r: int) -> str:
        return f"step {steps.get(r, 0) + 1}"

    said = [
        f"rank {r} did not finish {step(r)} "
        + (
            "(waiting in a collective too)"
            if r in waiting
            else READING_EVAL
            if _reading_eval(traces.get(r))
            else "(busy in its own code)"
        )
        for r in stuck
    ]
    for r in waiting:
        if r not in stuck:
            said.append(
                f"rank {r} was waiting for it in {traces[r].collective() or 'a collective'}"
            )
    return "; ".join(said)
