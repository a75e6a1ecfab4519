"""The prose check of tests/prose.py, on notebooks made here: it finds a quoted figure no cell
printed, and lets through what the prose may say (issue 35 item 1). The check on the real
notebooks runs in tests/test_notebooks.py, on their executed copies."""

from __future__ import annotations

import nbformat

from .prose import contradictions, quotes


def _nb(markdown: str, source: str = "", printed: str = "") -> nbformat.NotebookNode:
    code = nbformat.v4.new_code_cell(source)
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(markdown), code])


def _texts(nb) -> list[str]:
    return [q.text for q in contradictions(nb)]


def test_a_figure_the_cells_did_not_print_is_named():
    nb = _nb("The bubble is 26% here, 0.0287 h on p4d, $43 in all.", printed="idle 0.281\n")
    assert _texts(nb) == ["26%", "0.0287 h", "43"]
    (first, *_) = contradictions(nb)
    assert first.cell == 0 and "bubble is 26%" in first.context


def test_a_figure_printed_to_more_digits_matches_when_rounded():
    nb = _nb(
        "Idle 28% of the step; 1.30x the activations; 1,190,000 steps; 2.4e4 tokens/s.",
        printed="idle share 0.2812\nratio 1.2996\nsteps: 1190000\ntokens/s 24000.0\n",
    )
    assert _texts(nb) == []
    # one digit off is a contradiction
    nb = _nb("Idle 27% of the step.", printed="idle share 0.2812\n")
    assert _texts(nb) == ["27%"]


def test_both_ends_of_a_range_are_figures():
    nb = _nb("Idle 26-28% here; 0.209-0.233 h.", printed="0.26 0.279 0.209\n")
    assert _texts(nb) == ["0.233 h"]


def test_the_code_may_be_quoted():
    nb = _nb("A learning rate of 0.05 over 1024 samples.", source="lr = 0.05\nn = 1024\n")
    assert _texts(nb) == []


def test_names_citations_code_and_small_settings_are_not_figures():
    text = (
        "On ml.p4d.24xlarge (8 A100s) with fp16, see ZeRO (Rajbhandari et al., 2020), "
        "transformers #34242, issue 15, section 3.1 and [the docs](https://x.org/v2.13/a). "
        "Run `--microbatches 16` on 2 engines with m = 8; GPT-2 and CS336."
    )
    assert [q.text for q in quotes(_nb(text))] == []


def test_a_percentage_matches_a_printed_fraction_and_a_printed_percentage():
    assert _texts(_nb("11% at m = 8", printed="bubble 0.111\n")) == []
    assert _texts(_nb("11% at m = 8", printed="bubble 11.1%\n")) == []
    assert _texts(_nb("12% at m = 8", printed="bubble 0.111\n")) == ["12%"]
