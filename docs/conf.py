"""Sphinx configuration of the hdet-jax documentation (``sphinx-build -W -b html docs docs/_build/html``)."""

import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # autodoc imports hdet_jax from this checkout (no install needed)

project = 'hdet-jax'
author = 'hdet-jax authors'
copyright = 'hdet-jax authors'  # noqa: A001
# The version scheme (CHANGELOG.md) lives in pyproject.toml.
release = version = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['version']

extensions = [
  'myst_parser',
  'sphinx.ext.autodoc',
  'sphinx.ext.napoleon',
  'sphinx.ext.mathjax',
  'sphinx.ext.viewcode',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
root_doc = 'index'
exclude_patterns = ['_build', 'Thumbs.db', '.DS_Store', '_static']

# Markdown (MyST): $...$ math, ::: fences, heading anchors for [text](page.md#anchor) links.
myst_enable_extensions = ['dollarmath', 'colon_fence', 'deflist']
myst_heading_anchors = 3

# The API reference: Google-style docstrings (Args:, Returns:, Attributes:), members in source order.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
autodoc_member_order = 'bysource'
autodoc_typehints = 'none'  # the Args sections give types and shapes in words; optax's aliases expand unreadably
autodoc_preserve_defaults = True
# The docstrings' cross-references name private helpers and NamedTuple fields that have no page of their
# own; an unresolved Python reference is then plain text, not a warning. Every public name has a page
# entry, which tests/test_docs.py checks against hdet_jax.__all__ in objects.inv.
nitpicky = False

# Math renders offline: MathJax 3's self-contained SVG build (one file, no fonts to fetch), vendored from the PyPI
# package django-static-mathjax 3.2.2.1 (MathJax 3.2.2, Apache-2.0: _static/mathjax/LICENSE). Without this Sphinx
# would load MathJax from a CDN, and a browser with no network would show raw TeX.
html_static_path = ['_static']
html_css_files = ['custom.css']  # a narrower right-hand contents column, so tables get the width
mathjax_path = 'mathjax/tex-svg.js'

html_theme = 'sphinx_book_theme'
html_title = f'hdet-jax {version}'
html_theme_options = {
  'show_toc_level': 2,
  'use_download_button': False,
  'use_fullscreen_button': False,
}
