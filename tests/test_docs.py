"""The documentation: its code runs, it builds with warnings as errors, every public name has an entry, the
verdict page is what the records give, and the user pages read as a user guide.

The python blocks of each page under docs/ run in order in one namespace (as a reader would paste them), so a
renamed argument fails here, not in the reader's hands. The Sphinx build needs the [docs] extra; without it
those tests are skipped with the reason. The build runs with -W, so a broken internal link (a {doc} role, a
link to a page that does not exist) fails it.
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import hdet_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / 'docs'
PAGES = sorted(p for p in DOCS.rglob('*.md') if '_build' not in p.parts)
PYTHON_BLOCK = re.compile(r'^( *)```python\n(.*?)^\1```', re.S | re.M)  # (some sit inside list items)
API_ENTRY = re.compile(r'^\.\. auto(?:function|class|data|attribute)::\s+(\S+)', re.M)
# The user guide: every page but the research log (docs/results/*, which include the files under results/ as
# the studies wrote them) and the changelog (whose versions carry their dates).
USER_PAGES = [
  p for p in PAGES if not (p.parent.name == 'results' and p.name != 'index.md') and p.name != 'changelog.md'
] + sorted((DOCS / 'api').glob('*.rst'))
# Words of a lab notebook: dates, machine names, passes and sessions, the default controller's internal IDs.
NOTEBOOK = re.compile(
  r'20\d\d-\d\d-\d\d|Xeon|EPYC|\bAMD\b|Intel|\bH100\b|\bH200\b|'
  r'(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|'
  r'\w+teenth|\w+tieth|\d+(?:st|nd|rd|th)) pass\b|'
  r'\bsession|fit_K\d|fit_lr_T|_settle\b|rollback_se2',
  re.I,
)
CODE_WIDTH = 88  # columns a code block shows without scrolling (docs/_static/custom.css)


def _blocks(page):
  return [textwrap.dedent(block) for _, block in PYTHON_BLOCK.findall(page.read_text())]


def _load_verdict():
  spec = importlib.util.spec_from_file_location('docs_verdict', DOCS / 'verdict.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


PAGES_WITH_CODE = [p for p in PAGES if _blocks(p)]


def test_the_pages_with_code_are_found():
  names = {p.name for p in PAGES_WITH_CODE}
  assert {'getting_started.md', 'how_it_works.md', 'own_step.md', 'scaling.md', 'pytorch.md'} <= names, names


@pytest.mark.parametrize('page', PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, monkeypatch):
  monkeypatch.chdir(ROOT)  # the pages' paths are relative to the repository root
  scope = {'__name__': f'docs.{page.stem}'}
  for i, block in enumerate(_blocks(page)):
    exec(compile(block, f'{page.relative_to(ROOT)} (python block {i + 1})', 'exec'), scope)


def test_getting_started_uses_the_shortest_call():
  """The first example builds the measured default in one call and leaves the windows to it."""
  first = _blocks(DOCS / 'getting_started.md')[0]
  assert 'auto_lr=hdet_jax.AutoLR(total_steps=S)' in first and 'sync_every' not in first


def test_api_pages_have_an_entry_for_every_public_name():
  entries = [name for page in (DOCS / 'api').glob('*.rst') for name in API_ENTRY.findall(page.read_text())]
  documented = {name.removeprefix('hdet_jax.') for name in entries if name.count('.') == 1}
  assert set(hdet_jax.__all__) - documented == set()
  assert len(entries) == len(set(entries)), 'a name documented twice'


def test_user_pages_read_as_a_guide():
  """No dates, machine names, pass or session narration, or internal variant IDs outside the research log."""
  hits = {str(p.relative_to(DOCS)): sorted({m.group() for m in NOTEBOOK.finditer(p.read_text())}) for p in USER_PAGES}
  assert {page: words for page, words in hits.items() if words} == {}


# What hdet takes, said wrongly (issue 86): a page that says it takes a factory only, or refuses a built optimizer.
FACTORY_ONLY = re.compile(
  r'not `+optax\.\w+\([^)`]*\)`+|factory only|only a factory|only (?:an )?(?:optax )?(?:optimizer )?factor(?:y|ies)|'
  r'wraps an optax optimizer \*?factory\*?',
  re.I,
)


def test_the_pages_say_one_thing_about_what_hdet_takes():
  """hdet takes the optimizer you built and a factory of the learning rate (tests/test_built_optimizer.py runs
  both): no page, README, API page or the core's docstrings say it takes a factory only, and the pages that
  introduce hdet name both forms."""
  texts = {str(p.relative_to(ROOT)): p.read_text() for p in USER_PAGES + [ROOT / 'README.md']}
  texts.update({str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / 'hdet_jax').glob('*.py'))})
  said = {name: sorted({m.group() for m in FACTORY_ONLY.finditer(text)}) for name, text in texts.items()}
  assert {name: words for name, words in said.items() if words} == {}
  for name in ('docs/getting_started.md', 'hdet_jax/transform.py', 'README.md', 'docs/add_to_trainer.md'):
    assert 'optax.adamw(' in texts[name] and re.search(r'factory', texts[name]), name
  assert FACTORY_ONLY.search('wraps an optax optimizer *factory* (`optax.adamw`, not `optax.adamw(1e-3)`)')


# Where the guarded climb starts, said once (issue 84): a tenth of the learning rate passed, whether hdet is given a
# built optimizer or a factory. The other rule the library had (a built optimizer's climb at its own learning rate),
# in the words the pages used for it.
ONE_START_RULE = 'a tenth of the learning rate you pass'
OTHER_START_RULE = re.compile(
  r"starts? (?:`?c`? )?at 1\b|starts? at (?:your|its|that optimizer's|the optimizer's|the trainer's) own "
  r'(?:learning rate|LR)|starts at your learning rate|factor 1 on it|1 around a built optimizer|'
  r'10 \* lr\b|lr / (?:0\.1|a\.initial_scale)',
  re.I,
)


def _one_line(text: str) -> str:
  return re.sub(r'\s+', ' ', text)


def test_the_pages_say_one_start_rule():
  """Every page and docstring that says where the climb starts says the one rule in the same words, none the other
  (the pages, README, the API pages and the core's modules), and the code has the one rule: the same start around a
  built optimizer and a factory."""
  import jax
  import jax.numpy as jnp
  import optax

  from hdet_jax import settings, transform

  texts = {str(p.relative_to(ROOT)): p.read_text() for p in USER_PAGES + [ROOT / 'README.md']}
  texts.update({str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / 'hdet_jax').glob('*.py'))})
  said = {name: sorted({m.group() for m in OTHER_START_RULE.finditer(_one_line(t))}) for name, t in texts.items()}
  assert {name: words for name, words in said.items() if words} == {}
  speak = {
    **{name: texts[name] for name in ('README.md', 'docs/getting_started.md', 'docs/add_to_trainer.md')},
    **{name: texts[name] for name in ('docs/own_step.md', 'docs/how_it_works.md', 'docs/verdict.md')},
    'AutoLR': hdet_jax.AutoLR.__doc__,
    'hdet': hdet_jax.hdet.__doc__,
    'hdet_jax/transform.py (module)': transform.__doc__,
  }
  assert [name for name, text in speak.items() if ONE_START_RULE not in _one_line(text)] == []
  # The words of the other rule, as add_to_trainer and hdet's docstring said it, are caught.
  for old in ('`AutoLR(total_steps=S)` starts `c` at 1, your own', 'it starts at 1, your own learning rate, and'):
    assert OTHER_START_RULE.search(old), old
  # One rule in the code: the climb's first factor is 0.1 of what is passed, built or factory.
  assert settings.DEFAULT_INITIAL_SCALE == 0.1 and hdet_jax.AutoLR(10).initial_scale is None
  a, params = hdet_jax.AutoLR(total_steps=100), hdet_jax.stack_replicas({'w': jnp.zeros(2)}, 2)
  built = jax.vmap(hdet_jax.hdet(optax.sgd(0.5), num_replicas=2, auto_lr=a).init)(params)
  factory = jax.vmap(hdet_jax.hdet(optax.sgd, 0.5, num_replicas=2, auto_lr=a).init)(params)
  assert float(hdet_jax.hyperparams(built)['base_lr_scale']) == pytest.approx(0.1, rel=1e-6)
  assert float(hdet_jax.hyperparams(factory)['base_learning_rate']) == pytest.approx(0.05, rel=1e-6)


def test_user_pages_code_fits_the_page():
  wide = []
  for page in USER_PAGES:
    fence = None  # 'code' inside a code block, 'directive' inside a {directive} block
    for i, line in enumerate(page.read_text().splitlines()):
      if line.strip().startswith('```'):
        fence = None if fence and line.strip() == '```' else 'directive' if '{' in line else 'code'
      elif fence == 'code' and len(line) > CODE_WIDTH:
        wide.append(f'{page.relative_to(DOCS)}:{i + 1} ({len(line)})')
  assert not wide, wide


def test_verdict_page_is_generated_from_the_records():
  """docs/verdict.md is what docs/verdict.py gives from the committed records (run it after a record changes)."""
  verdict = _load_verdict()
  assert (DOCS / 'verdict.md').read_text() == verdict.render(ROOT / 'results'), 'run: python docs/verdict.py'
  assert subprocess.run([sys.executable, str(DOCS / 'verdict.py'), '--check'], cwd=ROOT).returncode == 0


def _copy_records(verdict, tmp_path):
  results = tmp_path / 'results'
  for name in verdict.RECORDS:
    (results / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / 'results' / name, results / name)
  return results


def test_a_changed_workload_record_changes_the_verdict_page(tmp_path):
  """One HDET run's result on the LM at 1500 steps from 10x low, moved from +1.8% to +12.3% of the sweep's best:
  the table's cell, the answer's span, and the --check of the committed page all follow."""
  verdict = _load_verdict()
  results = _copy_records(verdict, tmp_path)
  before = verdict.render(results)
  records = json.loads((results / 'workloads.json').read_text())
  cell = records['lm']['1500']['adamw']
  cell['hdet']['low']['value'] = cell['grid_best']['value'] * 1.123
  (results / 'workloads.json').write_text(json.dumps(records))
  after = verdict.render(results)
  assert after != before
  row = next(line for line in after.splitlines() if line.startswith('| LM | 1500 |'))
  assert '+12.3\u00a0/' in row, row
  assert 'ends +0.1% to +12.3% from the sweep' in after
  assert (
    subprocess.run(
      [sys.executable, str(DOCS / 'verdict.py'), '--check', '--results', str(results)], cwd=ROOT, capture_output=True
    ).returncode
    == 1
  )


def test_a_changed_bracket_record_changes_the_verdict_page(tmp_path):
  verdict = _load_verdict()
  results = _copy_records(verdict, tmp_path)
  before = verdict.render(results)
  records = json.loads((results / 'wider_rung.json').read_text())
  row = records['rows']['finetune:300:adamw']['best']
  row[verdict.BRACKET_KEY] = row['sweep_best'] * 1.05
  (results / 'wider_rung.json').write_text(json.dumps(records))
  after = verdict.render(results)
  assert after != before
  line = next(line for line in after.splitlines() if line.startswith('| fine-tuning | 300 |'))
  assert line.rstrip(' |').endswith('/\u00a0+5.0\u00a0/\u00a0**0.0**'), line
  assert 'the bracket in 24 of 36' in after and 'the bracket in 25 of 36' in before


def test_a_changed_benchmark_changes_the_verdict_page(tmp_path):
  verdict = _load_verdict()
  results = _copy_records(verdict, tmp_path)
  before = verdict.render(results)
  path = results / 'anchor_memory.md'
  path.write_text(path.read_text().replace('**1.125x**', '**1.250x**', 1))
  after = verdict.render(results)
  assert after != before and '1.250x the state with 8 replicas' in after


def test_every_results_file_is_in_the_research_log():
  """Each results/*.md has a page under docs/results that includes it, in the results index's toctree."""
  index = (DOCS / 'results' / 'index.md').read_text()
  toctree = re.search(r'```\{toctree\}\n(.*?)```', index, re.S).group(1).split()
  for record in sorted((ROOT / 'results').glob('*.md')):
    page = DOCS / 'results' / record.name
    assert page.exists() and f'results/{record.name}' in page.read_text(), record.name
    assert record.stem in toctree, record.stem


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
    [
      sys.executable,
      '-m',
      'sphinx',
      '-W',
      '--keep-going',
      '-E',
      '-q',
      '-b',
      'html',
      '-d',
      str(out / 'doctrees'),
      str(DOCS),
      str(out / 'html'),
    ],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONWARNINGS='ignore'),
    timeout=300,
  )
  return proc, out / 'html', time.perf_counter() - start


def test_sphinx_build_passes_with_warnings_as_errors(built_docs):
  proc, html, seconds = built_docs
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  for page in (
    'index',
    'getting_started',
    'verdict',
    'own_step',
    'scaling',
    'trainer',
    'api/index',
    'results/index',
    'changelog',
    'citing',
  ):
    assert (html / f'{page}.html').exists(), page
  print(f'sphinx -W -E -b html: {seconds:.1f} s')  # a figure, not a bound: no test asserts a time (issue 83)


def test_objects_inv_has_every_public_name(built_docs):
  from sphinx.util.inventory import InventoryFile

  proc, html, _ = built_docs
  assert proc.returncode == 0, proc.stderr[-5000:]
  with open(html / 'objects.inv', 'rb') as f:
    inventory = InventoryFile.load(f, '', lambda base, uri: base + uri)
  names = {name for kind, entries in inventory.items() if kind.startswith('py:') for name in entries}
  assert {f'hdet_jax.{name}' for name in hdet_jax.__all__} - names == set()


def test_the_site_needs_no_network(built_docs):
  """Math renders from the vendored MathJax, and no page loads a script or stylesheet from elsewhere."""
  proc, html, _ = built_docs
  assert proc.returncode == 0, proc.stderr[-5000:]
  page = (html / 'how_it_works.html').read_text()
  assert re.search(r'<script[^>]+src="_static/mathjax/tex-svg\.js', page)
  assert (html / '_static' / 'mathjax' / 'tex-svg.js').stat().st_size > 1_000_000
  remote = {
    str(p.relative_to(html))
    for p in html.rglob('*.html')
    if re.search(r'<(?:script|link)[^>]+(?:src|href)="(?:https?:)?//', p.read_text())
  }
  assert not remote, sorted(remote)


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
  tested = re.findall(r'(\d+\.\d+\.\d+(?:\.\d+)?) \(', pyproject[: pyproject.index('"jax>=')])
  version = lambda v: tuple(int(x) for x in v.split('.'))
  assert low in tested and all(version(low) <= version(v) < version(cap) for v in tested), (low, cap, tested)
  assert f'`jax>={low},<{cap}`' in (DOCS / 'getting_started.md').read_text()
  assert f'`jax>={low},<{cap}`' in (ROOT / 'README.md').read_text()
  assert os.access(ROOT / '.ci' / 'newest_jax', os.X_OK)
  # Every core test file it names exists (a renamed file would leave it collecting nothing: exit 5).
  names = re.search(r'CORE_TESTS=\(([^)]*)\)', (ROOT / '.ci' / 'newest_jax').read_text()).group(1).split()
  missing = [n for n in names if not (ROOT / 'tests' / f'test_{n}.py').exists()]
  assert len(names) >= 10 and not missing, missing


def test_package_version_is_pyprojects():
  """hdet_jax.__version__ is the version pyproject.toml, CHANGELOG.md's newest release and CITATION.cff give."""
  text = (ROOT / 'pyproject.toml').read_text()
  assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == hdet_jax.__version__
  changelog = (ROOT / 'CHANGELOG.md').read_text()
  releases = re.findall(r'^## \[(\d+\.\d+\.\d+)\]', changelog, re.M)
  assert releases[0] == hdet_jax.__version__, releases[:2]
  assert f'\nversion: {hdet_jax.__version__}\n' in (ROOT / 'CITATION.cff').read_text()


def test_project_files():
  """LICENSE is the Apache-2.0 text pyproject names; CITATION.cff cites the paper; pyproject links the paper (the
  project has no public home yet: no made-up URLs)."""
  import tomllib

  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  assert project['license'] == 'Apache-2.0'
  license_text = (ROOT / 'LICENSE').read_text()
  assert 'Apache License' in license_text and 'Version 2.0, January 2004' in license_text
  assert 'END OF TERMS AND CONDITIONS' in license_text
  citation = (ROOT / 'CITATION.cff').read_text()
  assert 'cff-version: 1.2.0' in citation and '2604.24708' in citation and 'preferred-citation:' in citation
  assert project['urls'] == {'Paper': 'https://arxiv.org/abs/2604.24708'}
  assert '2604.24708' in (DOCS / 'citing.md').read_text()


def test_changelog_is_for_users():
  """One line per change: no entry runs past a few lines, and no version section holds measurements."""
  changelog = (ROOT / 'CHANGELOG.md').read_text()
  assert '### Measured' not in changelog
  entries = re.findall(r'^- .*?(?=^- |^#|\Z)', changelog, re.S | re.M)
  long = [e.splitlines()[0][:60] for e in entries if len(e.strip().splitlines()) > 5]
  assert not long, long
