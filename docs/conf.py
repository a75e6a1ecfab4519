"""Sphinx configuration of sagenb's documentation site (Markdown pages through MyST).

Build: `python -m sphinx -W -b html docs docs/_build/html` (warnings as errors, as the tests
build it: tests/test_docs.py without running the notebooks, tests/test_notebooks.py with).
The pages are plain Markdown so that GitHub renders them too; the links between them are
relative .md paths, which MyST resolves to the built pages
(https://myst-parser.readthedocs.io/en/latest/syntax/cross-referencing.html).

The teaching notebooks are pages too: `docs/notebooks` is a link to the repository's
`notebooks/`, and MyST-NB (https://myst-nb.readthedocs.io) executes each one while it builds,
minutes in all. `-D nb_execution_mode=off` renders them without outputs, in seconds.
tests/test_notebooks.py runs each notebook itself (then its exercises' solutions, in the same
kernel) and builds the site with `-D nb_execution_mode=cache` from a jupyter-cache of those runs,
so that no notebook runs twice.
"""

import os
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent

project = "sagenb"
author = "sagenb contributors"
copyright = "sagenb contributors, Apache-2.0"

# myst_nb brings myst_parser's Markdown and adds the .ipynb pages
extensions = ["myst_nb"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "notebooks/checkpoints*"]

# The notebooks are stored without outputs; the build runs each one in a fresh kernel, in a
# temporary directory (notebook 05 writes checkpoints beside itself), and a cell that raises
# is a warning, which -W makes an error. "cache" reruns a notebook only when its code changed
# (jupyter-cache, in the build folder), not when sagenb did: `-D nb_execution_mode=force` then.
nb_execution_mode = "cache"
nb_execution_in_temp = True
nb_execution_timeout = 300  # per cell, as tests/test_notebooks.py's nbclient has
nb_execution_show_tb = True
nb_kernel_rgx_aliases = {".*": "python3"}  # the kernel of the Python that builds, sagenb in it
# A finished dashboard's output carries the live widget and a static HTML copy of its charts
# (sagenb/display/dashboard.py); a page has no kernel, so it shows the copy. Its plotly.js comes from
# the CDN, as the copy asks. Widgets with no copy (the control panel): WidgetsWithoutCopy.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

# "#section" links between pages, with GitHub's slugs (lower case, spaces to hyphens), so the
# same link works on GitHub and in the built site
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "sagenb"

# Where the repository's files outside docs/ (README.md, notebooks/, benchmarks/results/) are
# browsable, e.g. https://github.com/OWNER/sagenb/blob/main. The pages link to them with
# relative paths, which GitHub follows but a built site cannot; with this set they link there,
# without it they show as their path in the repository.
source_url = os.environ.get("SAGENB_SOURCE_URL", "").rstrip("/")


def _repo_file(node: addnodes.pending_xref, env) -> Path | None:
    """The file or folder of the repository, outside docs/, that a page's link points at."""
    target = node["reftarget"]
    if node["refdomain"] == "doc":  # MyST took it for a page: an absolute path, suffix dropped
        if not os.path.isabs(target):
            return None
        candidates = [Path(target + ".md"), Path(target + ".ipynb"), Path(target)]
    else:
        candidates = [Path(env.doc2path(node["refdoc"])).parent / target]
    for path in (c.resolve() for c in candidates):
        if path.exists() and REPO in path.parents and DOCS != path and DOCS not in path.parents:
            return path
    return None


def _notebook_page(path: Path, env) -> str | None:
    """The page of a notebook of notebooks/ (docs/notebooks links there), or None."""
    if path.suffix != ".ipynb" or path.parent != REPO / "notebooks":
        return None
    docname = f"notebooks/{path.stem}"
    return docname if docname in env.found_docs else None


class RepoFileLinks(SphinxPostTransform):
    """Turn links to repository files outside docs/ into links to source_url (or their path),
    before MyST's resolver (priority 9) reports them as missing pages."""

    default_priority = 8

    def run(self, **kwargs) -> None:
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst":
                continue
            path = _repo_file(node, self.env)
            if path is None:
                continue
            rel = path.relative_to(REPO).as_posix()
            inner = node[0].deepcopy()
            page = _notebook_page(path, self.env)
            if page is not None:  # a notebook: its page in this site, outputs included
                uri = self.app.builder.get_relative_uri(node["refdoc"], page)
                node.replace_self(nodes.reference("", "", inner, internal=True, refuri=uri))
            elif source_url:
                anchor = f"#{node['reftargetid']}" if node.get("reftargetid") else ""
                new = nodes.reference("", "", inner, refuri=f"{source_url}/{rel}{anchor}")
                node.replace_self(new)
            elif inner.astext() == rel:
                node.replace_self(inner)
            else:
                node.replace_self([inner, nodes.Text(" ("), nodes.literal(rel, rel),
                                   nodes.Text(")")])


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class WidgetsWithoutCopy(SphinxPostTransform):
    """A widget output with no static copy (the control panel, a progress bar) would show its
    Python repr, "VBox(children=(...))": say what it is instead. Runs before MyST-NB picks
    one type of each output bundle (its SelectMimeType, priority 4)."""

    default_priority = 3

    def run(self, **kwargs) -> None:
        for bundle in list(self.document.findall(nodes.container)):
            if bundle.get("nb_element") != "mime_bundle":
                continue
            kinds = {child.get("mime_type") for child in bundle.children}
            if WIDGET_VIEW in kinds and "text/html" not in kinds:
                note = "(an interactive widget: it shows when the notebook runs in Jupyter)"
                bundle.replace_self(nodes.paragraph("", "", nodes.emphasis(note, note)))


def drop_widget_state(app, doctree) -> None:
    """Keep the executed notebooks' widget state out of their pages.

    MyST-NB embeds a notebook's saved ipywidgets state in its page, for widgets to come alive
    without a kernel (https://ipywidgets.readthedocs.io/en/stable/embedding.html): for sagenb's
    dashboards that is several MB of figure state per run, and the pages show each dashboard's
    static copy instead (nb_mime_priority_overrides above). MyST-NB keeps the state as a page
    script named "ipywidgets_state" (myst_nb/core/render.py, render_nb_finalise), beside the
    html-manager scripts "ipywidgets_<i>" that would read it; drop them all."""
    js_files = getattr(app.env, "nb_metadata", {}).get(app.env.docname, {}).get("js_files", {})
    for key in [k for k in js_files if k.startswith("ipywidgets_")]:
        del js_files[key]


def setup(app):
    app.add_post_transform(RepoFileLinks)
    app.add_post_transform(WidgetsWithoutCopy)
    app.connect("doctree-read", drop_widget_state)
    return {"parallel_read_safe": True}
