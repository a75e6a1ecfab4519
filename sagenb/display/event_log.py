"""Each step's history as TensorBoard event files (`--log-dir DIR`, issue 17 item 6): runs can
be compared in TensorBoard as people already compare theirs.

A metric sink beside the dashboard, on the notebook side: it reads the session's `History`
(the ranks of a step combined, as `result.history` has them) and writes each finished row with
`torch.utils.tensorboard.SummaryWriter` (https://pytorch.org/docs/stable/tensorboard.html),
timed by the step's own end ("time(unix s)") so TensorBoard's relative and wall-time axes are
the run's. Each run gets a folder of its own under DIR, as SummaryWriter's default
`runs/DATE_HOST` does, since TensorBoard treats each folder as one run. Rows the history
settles after a failure (History.settle) are written when the sink closes.

`torch.utils.tensorboard` needs the `tensorboard` package, an optional extra
(`pip install 'sagenb[tensorboard]'`): `check_available` says so before any engine starts.
"""

from __future__ import annotations

import importlib.util
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sagenb.config.errors import ConfigError
from sagenb.config.options import TrainConfig, describe
from sagenb.metrics import keys
from sagenb.metrics.stream import History

__all__ = ["EventLog", "check_available", "run_folder"]

#: a history row's values written as scalars, when the row has them
SCALARS = (
    keys.LOSS,
    keys.EVAL_LOSS,
    keys.LR,
    keys.STEP_TIME,
    keys.THROUGHPUT,
    keys.TOKEN_THROUGHPUT,
    keys.GRAD_NORM,
    keys.LOSS_SCALE,
    keys.BUSY,
    keys.IDLE,
)


def check_available(config: TrainConfig) -> None:
    """--log-dir without tensorboard installed fails here, naming the extra, before any engine
    runs (torch.utils.tensorboard imports it only when a writer is made)."""
    if config.log_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "log_dir",
            config.log_dir,
            "writing TensorBoard event files needs the `tensorboard` package, sagenb's "
            "optional extra: pip install 'sagenb[tensorboard]' (or pip install tensorboard), "
            "or leave out --log-dir",
        )


def run_folder(config: TrainConfig, engines: int) -> Path:
    """DIR/<date>_<time>_<strategy>-<engines>: a new folder per run, in the order they ran."""
    assert config.log_dir is not None
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    name = re.sub(r"[^A-Za-z0-9.-]+", "-", f"{config.strategy}-{engines}")
    folder = Path(config.log_dir) / f"{stamp}_{name}"
    n = 1
    while folder.exists():  # two runs in one second
        n += 1
        folder = Path(config.log_dir) / f"{stamp}_{name}_{n}"
    return folder


class EventLog:
    """Writes every history row as TensorBoard scalars: the global loss, each replica's loss
    ("loss/replica i"), lr, step time, throughput, ... and each engine's memory by kind
    ("memory/params(MiB)/engine 0")."""

    def __init__(self, config: TrainConfig, history: History, engines: int) -> None:
        check_available(config)
        from torch.utils.tensorboard import SummaryWriter

        self.history, self.folder = history, run_folder(config, engines)
        self.writer = SummaryWriter(log_dir=str(self.folder))
        self.written = 0
        self.writer.add_text("layout", describe(config.strategy).layout(config, engines), 0)

    def log(self, metrics: Mapping[str, Any], step: int, rank: int) -> None:
        self._write_new_rows()

    def close(self) -> None:
        self._write_new_rows()
        self.writer.close()

    def _write_new_rows(self) -> None:
        rows = self.history.steps
        while self.written < len(rows):
            self._write(rows[self.written])
            self.written += 1

    def _write(self, row: Mapping[str, Any]) -> None:
        step = row[keys.STEP]
        ranks = {r.rank: r.values for r in self._records(step)}
        ends = [v[keys.TIME] for v in ranks.values() if keys.TIME in v]
        walltime = max(ends) if ends else None
        add = self.writer.add_scalar
        for key in SCALARS:
            if key in row and _finite(row[key]):
                add(key, row[key], step, walltime=walltime)
        for i, loss in enumerate(row.get(keys.RANK_LOSSES, ())):
            if _finite(loss):
                add(f"loss/replica {i}", loss, step, walltime=walltime)
        for rank, values in sorted(ranks.items()):
            for kind in keys.MEMORY_KINDS:
                if keys.memory(kind) in values:
                    add(f"{keys.memory(kind)}/engine {rank}", values[keys.memory(kind)], step,
                        walltime=walltime)  # fmt: skip

    def _records(self, step: int) -> list[Any]:
        """The ranks' records of `step` (the latest ones: a history's records arrive in
        step order per rank, so they are near its end)."""
        found = []
        for rec in reversed(self.history.records):
            if rec.step == step:
                found.append(rec)
            elif rec.step < step - 1 and len(found) >= self.history.world_size:
                break
        return found


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
