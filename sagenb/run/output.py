"""What rank 0 wrote, shown once under the cell: the cell's prints, logging and warnings, and
the text bars of tqdm (from_pretrained, datasets.map, the cell's loops; engine/wire/output.py).

Every rank runs the cell, so each writes much the same: one copy reads like the one process the
run stands for, where N copies would repeat every line N times. ipyparallel keeps each task's
stdout and stderr as they arrive, a bar's redraws (each begins with "\\r") folded into its
latest; lines are written to this process's stdout and stderr as they complete, the unfinished
last line when the run ends. The other ranks' output stays on their AsyncResults.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["RankOutput"]


class RankOutput:
    """One rank's stdout and stderr, each written here as its lines complete."""

    def __init__(self, async_result: Any) -> None:
        self._lines = _Lines(async_result, "stdout"), _Lines(async_result, "stderr")

    def drain(self, *, final: bool = False) -> None:
        """Write the lines completed since the last call; with `final` (the run has ended and
        its output arrived), the unfinished last line too, and nothing after."""
        for lines in self._lines:
            lines.drain(final=final)


class _Lines:
    def __init__(self, async_result: Any, name: str) -> None:
        self._ar, self.name = async_result, name
        self.written = 0  # lines written so far
        self.ended = False

    def drain(self, *, final: bool) -> None:
        if self.ended:
            return
        text = self._ar.metadata.get(self.name) or ""
        # counted in lines, not characters: ipyparallel folds a line's "\r" redraws when the
        # next chunk with a "\r" arrives, which shortens the text but never drops a newline
        complete = text.count("\n")
        if complete <= self.written and not final:
            return
        parts = text.split("\n")
        shown = parts[self.written : complete] + ([parts[-1]] if final and parts[-1] else [])
        self.written, self.ended = complete, final
        if shown:
            stream = getattr(sys, self.name)  # looked up now: a kernel or a test may swap it
            stream.write("".join(line.rpartition("\r")[2] + "\n" for line in shown))
            stream.flush()
