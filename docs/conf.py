"""Sphinx configuration of sagenb's documentation site (Markdown pages through MyST).

Build: `python -m sphinx -W -b html docs docs/_build/html` (tests/test_docs.py does it with
warnings as errors). The pages are plain Markdown so that GitHub renders them too; the links
between them are relative .md paths, which MyST resolves to the built pages
(https://myst-parser.readthedocs.io/en/latest/syntax/cross-referencing.html).
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

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

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
        candidates = [Path(target + ".md"), Path(target)]
    else:
        candidates = [Path(env.doc2path(node["refdoc"])).parent / target]
    for path in (c.resolve() for c in candidates):
        if path.exists() and REPO in path.parents and DOCS != path and DOCS not in path.parents:
            return path
    return None


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
            if source_url:
                anchor = f"#{node['reftargetid']}" if node.get("reftargetid") else ""
                new = nodes.reference("", "", inner, refuri=f"{source_url}/{rel}{anchor}")
                node.replace_self(new)
            elif inner.astext() == rel:
                node.replace_self(inner)
            else:
                node.replace_self([inner, nodes.Text(" ("), nodes.literal(rel, rel),
                                   nodes.Text(")")])


def setup(app):
    app.add_post_transform(RepoFileLinks)
    return {"parallel_read_safe": True}
