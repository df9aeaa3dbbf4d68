"""Sphinx configuration of moectl's documentation site (MyST markdown, furo, autodoc, sphinx-click).

Build: ``sphinx-build -W -b html docs docs/_build/html`` (``pip install -e '.[docs]'``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's moectl, whatever is installed
sys.path.insert(0, str(HERE / "_ext"))  # moectl_cli: the command-line reference
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import moectl  # noqa: E402 - after the path above: this checkout's moectl

project = "moectl"
author = "moectl contributors"
copyright = "moectl contributors"
release = version = moectl.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "moectl_cli"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
smartquotes = False  # `--tiny` stays two hyphens, quotes stay as typed in commands

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures show them; resolving every forward reference warns
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "moectl"
