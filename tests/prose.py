"""Numbers a notebook's prose quotes, held against what its cells printed (issue 35 item 1).

A student reads "the bubble is 11% at m = 8" and then a cell that prints 26%: the text and the
output disagree, and the student trusts neither. The rule this module checks: every number the
markdown quotes with a unit, a decimal point or four digits or more is one that a code cell of
the same notebook printed or wrote in its source (so "`--microbatches 8`" or "lr 0.05" quote the
code). A number matches when the printed one, rounded to the digits the prose shows, is the
quoted one; a quoted percentage also matches a printed fraction (11% and 0.111).

What the prose may not do is quote a figure measured on this machine: it changes between runs,
and the check fails on the next run that prints another. Measured figures are referred to
("the idle share printed above"), not copied.

Not checked: links' targets, inline code, LaTeX, citations ("Young 1974", "#34242", "issue 15",
"section 3.1", "arXiv 1910.02054"), and names that hold digits (p4d.24xlarge,
fp16, GPT-2, CS336, notebook 04).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: a number as prose writes one: 1,190,000 / 0.0287 / 26 / 1e-5 / 2.4e4
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.]\w)"
_UNIT = r"%|x\b|×|MiB|GiB|KiB|MB|GB|KB|TB|ms|µs|us|s\b|h\b|GB/s|Gbit/s"
#: one figure or a range of two ("26-28%", "0.209-0.233 h": the unit is both ends')
_QUOTED = re.compile(
    rf"(?<![\w.#/-])(?P<cur>\$)?(?P<low>{_NUMBER})(?:\s?[-–]\s?\$?(?P<high>{_NUMBER}))?"
    rf"(?P<unit>\s?(?:{_UNIT}))?"
)
_PRINTED = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?")
# what prose may hold that is not a quoted figure
_SKIP = [
    re.compile(r"`[^`]*`"),  # inline code
    re.compile(r"\]\([^)]*\)"),  # a link's target
    re.compile(r"https?://\S+"),
    re.compile(r"<[^>]+>"),  # HTML tags and their attributes
    re.compile(r"\$(?!\d)[^$\n]+\$"),  # LaTeX: formulas, not figures ($43 is a figure)
    # citations: a year after a name or in parentheses, issue and PR numbers, arXiv ids
    re.compile(r"\b(?:19|20)\d\d[a-z]?\b"),
    re.compile(r"(?:#|issue |issues |PR |arXiv:? ?)\d[\d.]*", re.I),
    re.compile(r"\b(?:section|figure|table|eq\.|equation|chapter) \d[\d.]*", re.I),
    # names that hold digits
    re.compile(r"\b[A-Za-z][\w.-]*\d[\w.-]*|\b\d+[A-Za-z]{2,}[\w.-]*"),
]


@dataclass(frozen=True)
class Quote:
    """A number the prose quotes, and where."""

    cell: int  # the markdown cell's index in the notebook
    text: str  # as written: "26%", "0.0287", "1,190,000"
    context: str  # the words around it

    @property
    def value(self) -> float:
        return float(re.match(r"[\d,.e+-]+", self.text).group().replace(",", "").rstrip("."))

    @property
    def decimals(self) -> int:
        mantissa = re.match(r"[\d,.]+", self.text).group().rstrip(".")
        return len(mantissa.split(".")[1]) if "." in mantissa else 0

    @property
    def percent(self) -> bool:
        return self.text.rstrip().endswith("%")


def _blank(text: str, pattern: re.Pattern[str]) -> str:
    return pattern.sub(lambda m: " " * len(m.group()), text)


def quotes(nb) -> list[Quote]:
    """The figures the notebook's markdown quotes: numbers with a unit, a decimal point, or
    four digits or more. Small bare integers ("2 engines", "m = 8") are the setting of a
    cell, read in its source, and too common to hold against anything."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        text = cell.source
        for pattern in _SKIP:
            text = _blank(text, pattern)
        for m in _QUOTED.finditer(text):
            unit = m.group("unit") or ""
            start, end = max(0, m.start() - 40), min(len(cell.source), m.end() + 40)
            context = " ".join(cell.source[start:end].split())
            for bare in filter(None, (m.group("low"), m.group("high"))):
                digits = bare.replace(",", "").split(".")[0].split("e")[0]
                if not (unit or m.group("cur")) and "." not in bare and len(digits) < 4:
                    continue
                found.append(Quote(index, bare + unit, context))
    return found


def printed(nb) -> list[float]:
    """Every number the notebook's code cells wrote: their sources and their outputs (text,
    plain-text reprs and HTML tables; not images or widget state)."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        texts.append(cell.source)
        for out in cell.get("outputs", []):
            texts.append(out.get("text", ""))
            data = out.get("data", {})
            texts.append(data.get("text/plain", ""))
            texts.append(re.sub(r"<[^>]+>", " ", data.get("text/html", "")))
            texts.append(data.get("text/markdown", ""))
    return [float(m.group().replace(",", "")) for text in texts for m in _PRINTED.finditer(text)]


def matches(quote: Quote, numbers: list[float]) -> bool:
    """Whether a printed number, shown to the quote's digits, is the quoted one."""
    want = quote.value
    for number in numbers:
        for candidate in (number, 100 * number) if quote.percent else (number,):
            if "e" in quote.text.lower():
                if abs(candidate - want) <= 1e-9 * max(abs(want), 1e-30):
                    return True
            elif round(abs(candidate), quote.decimals) == round(want, quote.decimals):
                return True
    return False


def contradictions(nb) -> list[Quote]:
    """The quotes no cell of the notebook printed."""
    numbers = printed(nb)
    return [q for q in quotes(nb) if not matches(q, numbers)]
