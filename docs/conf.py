"""Sphinx configuration of jbps's documentation: Markdown pages (MyST, as jax,
flax and optax write theirs) and the API reference from the docstrings.

    pip install ".[docs]" && sphinx-build -W -b html docs docs/_build/html
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # the checkout's jbps, for autodoc

project = "jbps"
author = "the jbps developers"
copyright = "2026, the jbps developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
myst_heading_anchors = 3  # links to a page's sections: page.md#a-heading
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# The reference documents the public API as jbps/__init__.py exports it.
autodoc_default_options = {"members": True, "undoc-members": False}
html_theme = "alabaster"
html_title = "jbps: BytePS for JAX"
nitpicky = False
