"""The documentation: its code runs, it builds with warnings as errors, and every public name has an entry.

The python blocks of each page under docs/ run in order in one namespace (as a reader would paste them), so a
renamed argument fails here, not in the reader's hands. The Sphinx build needs the [docs] extra; without it
that test is skipped with the reason.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

import hdet_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / 'docs'
PAGES = sorted(p for p in DOCS.rglob('*.md') if '_build' not in p.parts)
PYTHON_BLOCK = re.compile(r'^```python\n(.*?)^```', re.S | re.M)
API_ENTRY = re.compile(r'^\.\. auto(?:function|class|data|attribute)::\s+(\S+)', re.M)


def _blocks(page):
  return PYTHON_BLOCK.findall(page.read_text())


PAGES_WITH_CODE = [p for p in PAGES if _blocks(p)]


def test_the_pages_with_code_are_found():
  names = {p.name for p in PAGES_WITH_CODE}
  assert {'getting_started.md', 'how_it_works.md', 'pytorch.md'} <= names, names


@pytest.mark.parametrize('page', PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, monkeypatch):
  monkeypatch.chdir(ROOT)  # the pages' paths are relative to the repository root
  scope = {'__name__': f'docs.{page.stem}'}
  for i, block in enumerate(_blocks(page)):
    exec(compile(block, f'{page.relative_to(ROOT)} (python block {i + 1})', 'exec'), scope)


def test_api_page_has_an_entry_for_every_public_name():
  documented = {name.removeprefix('hdet_jax.') for name in API_ENTRY.findall((DOCS / 'api.rst').read_text())}
  assert set(hdet_jax.__all__) - documented == set()


def _missing_docs_packages():
  return [m for m in ('sphinx', 'myst_parser', 'sphinx_book_theme') if importlib.util.find_spec(m) is None]


@pytest.fixture(scope='module')
def built_docs(tmp_path_factory):
  missing = _missing_docs_packages()
  if missing:
    pytest.skip(f'the docs extra is not installed ({", ".join(missing)} missing): pip install -e ".[docs]"')
  out = tmp_path_factory.mktemp('docs')
  start = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-E', '-q', '-b', 'html', '-d', str(out / 'doctrees'),
       str(DOCS), str(out / 'html')],
      capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS='ignore'), timeout=300)
  return proc, out / 'html', time.perf_counter() - start


def test_sphinx_build_passes_with_warnings_as_errors(built_docs):
  proc, html, seconds = built_docs
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  assert (html / 'index.html').exists() and (html / 'api.html').exists()
  assert seconds < 120, f'the build took {seconds:.0f} s'


def test_objects_inv_has_every_public_name(built_docs):
  from sphinx.util.inventory import InventoryFile
  proc, html, _ = built_docs
  assert proc.returncode == 0, proc.stderr[-5000:]
  with open(html / 'objects.inv', 'rb') as f:
    inventory = InventoryFile.load(f, '', lambda base, uri: base + uri)
  names = {name for kind, entries in inventory.items() if kind.startswith('py:') for name in entries}
  assert {f'hdet_jax.{name}' for name in hdet_jax.__all__} - names == set()


def test_results_pages_include_the_files_rather_than_copy_them():
  for page in (DOCS / 'results').glob('*.md'):
    if page.name == 'index.md':
      continue
    text = page.read_text()
    # results/<page>.md, or a report written into its own folder: results/<page>/<report>.md
    m = re.fullmatch(r'```\{include\} \.\./\.\./results/((\w+)(/\w+)?)\.md\n:relative-images:\n```\n', text)
    assert m and m.group(2) == page.stem, page
    assert (ROOT / 'results' / f'{m.group(1)}.md').exists()


def test_the_stated_jax_range_is_the_pinned_one():
  """pyproject's jax pin, the versions its comment says were tested, and the docs agree; .ci/newest_jax (which
  tests the newest jax the pin allows) is executable."""
  pyproject = (ROOT / 'pyproject.toml').read_text()
  low, cap = re.search(r'"jax>=([\d.]+),<([\d.]+)"', pyproject).groups()
  tested = re.findall(r'(\d+\.\d+\.\d+(?:\.\d+)?) \(', pyproject[:pyproject.index('"jax>=')])
  version = lambda v: tuple(int(x) for x in v.split('.'))
  assert low in tested and all(version(low) <= version(v) < version(cap) for v in tested), (low, cap, tested)
  assert f'`jax>={low},<{cap}`' in (DOCS / 'getting_started.md').read_text()
  assert os.access(ROOT / '.ci' / 'newest_jax', os.X_OK)


def test_package_version_is_pyprojects():
  """hdet_jax.__version__ is the version pyproject.toml (and CHANGELOG.md's newest release) gives."""
  import hdet_jax
  text = open(os.path.join(ROOT, 'pyproject.toml'), encoding='utf-8').read()
  assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == hdet_jax.__version__
  assert f'## [{hdet_jax.__version__}]' in open(os.path.join(ROOT, 'CHANGELOG.md'), encoding='utf-8').read()
