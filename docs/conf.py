"""Sphinx configuration of the djlocks documentation (``make docs``).

The pages are Markdown (MyST); the API reference is generated from the
docstrings with autodoc, which imports djlocks and therefore needs Django
configured. The demo project's settings on SQLite are enough: building the
documentation opens no database and no Redis connection.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The demo project's settings, on SQLite, with its scratch files out of the way.
os.environ["DJLOCKS_DB"] = "sqlite"
os.environ.setdefault("DJLOCKS_VAR_DIR", "/tmp/docs-var")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

import djlocks  # noqa: E402

# -- Project -------------------------------------------------------------------

project = "djlocks"
author = "The djlocks contributors"
copyright = "the djlocks contributors"  # noqa: A001 - Sphinx's name for it
release = djlocks.__version__
version = ".".join(release.split(".")[:2])

# -- General -------------------------------------------------------------------

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Pages that only exist to be included elsewhere (the generated benchmark
# results come in through performance.md).
exclude_patterns = ["_build", "benchmarks.md", "benchmarks.json"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings: Google-style "Arguments:" sections (napoleon); signatures keep
# their type hints, descriptions come from the docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

# Nitpicky mode (make docs passes -n): every cross-reference must resolve.
# Intersphinx would resolve the standard library's and Django's classes, but
# it downloads their inventories at build time, and the build must work
# offline; so references to those two are the ones allowed to stay plain text.
nitpick_ignore_regex = [
    (r"py:.*", r"(datetime|collections\.abc|contextlib|threading|types)\..*"),
    (r"py:.*", r"django\..*"),
    # Type variables of generic signatures: nothing to link to.
    (r"py:class", r"djlocks\.(core|tasks)\.F|djlocks\.testing\.C|djlocks\.backends\.waiting\.T"),
]

# -- HTML ----------------------------------------------------------------------

html_theme = "furo"
html_title = f"djlocks {release}"
html_static_path: list[str] = []
html_theme_options = {
    "source_repository": "https://github.com/djlocks/djlocks",
    "source_branch": "main",
    "source_directory": "docs/",
}
