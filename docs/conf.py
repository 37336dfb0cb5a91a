"""Sphinx configuration of the torch_openreg guide (built by `make docs` into docs/_build/html).

The pages are plain Markdown (MyST): the same files read on GitHub and in the built site. Code on
the pages is quoted from the sources by markers (tools/docs_quotes.py), never written by hand.
"""

project = "torch_openreg"
author = "torch_openreg developers"
copyright = "2026, torch_openreg developers"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
# The site's entry page is index.md (the overview); docs/README.md, the table of mechanisms GitHub
# shows for the folder, is a page of the site too. Every other page is picked up by the glob of
# index.md's second toctree, so a new docs/<mechanism>.md needs no change here.
root_doc = "index"
exclude_patterns = ["_build", "_probe_*"]
# The pages are written for GitHub first; some skip heading levels (H1 then H3), which is fine there.
suppress_warnings = ["myst.header"]

myst_enable_extensions = ["colon_fence"]
# `## Heading` gets an anchor, so `page.md#heading` links are checked too.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "torch_openreg guide"
html_theme_options = {"description": "A simulated accelerator for PyTorch, and how it is built"}

# Unknown languages in fenced blocks (e.g. text diagrams) must not fail the -W build.
highlight_language = "none"
nitpicky = False
