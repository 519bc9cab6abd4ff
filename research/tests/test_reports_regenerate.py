"""Every results page is what its command writes (issue 67).

research/README.md's "Reproducing them" table lists every study, its page and whether ``--report-only`` redraws it.
Each one that does runs here, in this process, into a temporary folder (``--out``): every ``.md`` and ``.json`` it
writes must equal the committed file beside its page byte for byte (nothing under results/ is written). The others
must say on their page that they are not regenerable, and a live one's ``--report-only`` must say so too and write
nothing. The table is checked against the studies tables above it (live and archived), the modules in research/ and
research/archive/ and the records under results/, so a new study cannot be left out of it. The archived studies' pages
redraw here too (``research.archive.<study>``): the one check of them in CI, their own tests being out of it.
"""

import difflib
import importlib
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / 'research' / 'README.md'
REDRAWS, NOT_REGENERABLE = 'redraws it', 'not regenerable'


def _table(text: str, header: str) -> list[list[str]]:
  """The rows (their cells) of the markdown table whose header line starts with ``header``."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header))
  rows = []
  for line in lines[start + 2 :]:
    if not line.startswith('|'):
      break
    rows.append([c.strip() for c in line.strip().strip('|').split('|')])
  return rows


def _index() -> dict[str, dict]:
  """The "Reproducing them" table: study -> its page (a path under the repository) and its ``--report-only`` cell."""
  rows = _table(README.read_text(encoding='utf-8'), '| study | results page | reproduce | `--report-only` |')
  return {r[0]: {'page': r[1].strip('`'), 'report_only': r[3]} for r in rows}


INDEX = _index()
REGENERABLE = [s for s, row in INDEX.items() if row['report_only'] == REDRAWS]
NOT_REGENERABLE_STUDIES = [s for s, row in INDEX.items() if row['report_only'] != REDRAWS]


def _studies(kind: str) -> list[str]:
  """The studies of the README's ``kind`` table ('live' or 'archived'), in its order, the retired ones included."""
  rows = _table(README.read_text(encoding='utf-8'), f'| {kind} study | question | answer')
  return [re.match(r'\[(\w+)\]', r[0]).group(1) for r in rows]


LIVE, ARCHIVED = _studies('live'), _studies('archived')


def _retired() -> set[str]:
  rows = _table(README.read_text(encoding='utf-8'), '| archived study | question | answer')
  return {re.match(r'\[(\w+)\]', r[0]).group(1) for r in rows if '(retired)' in r[0]}


def _module(study: str) -> str:
  return f'research.archive.{study}' if study in ARCHIVED else f'research.{study}'


def test_the_index_lists_every_study_once_and_every_module_and_record_is_in_it():
  text = README.read_text(encoding='utf-8')
  assert LIVE + ARCHIVED == list(INDEX)  # the same studies, in the same order, in the studies tables and this one
  assert len(INDEX) == 20 and len(REGENERABLE) == 17  # (a new study, or one no longer regenerable, changes these)
  assert len(LIVE) == 9 and len(ARCHIVED) == 11  # (a study archived, or brought back, changes these)
  links = dict(re.findall(r'^\[(\w+)\]: \.\./(\S+)$', text, flags=re.M))
  assert links == {s: row['page'] for s, row in INDEX.items()}  # every study's link is its page
  for study, row in INDEX.items():
    assert row['report_only'] in (REDRAWS, NOT_REGENERABLE), (study, row['report_only'])
    assert (REPO / row['page']).is_file(), row['page']
  # Every module in research/ is a study of the index (one that is not retired) or a helper the README names.
  helpers_text = text[text.index('Helpers, not studies:') :]
  helpers = set(re.findall(r'`(\w+)\.py`', helpers_text[: helpers_text.index('\n\n')]))
  assert helpers == {'records', 'autolr_report', 'peers', 'heldout_corpus', 'table1_report', 'digits_npz'}
  live = {p.stem for p in (REPO / 'research').glob('*.py')} - {'__init__'}
  archived = {p.stem for p in (REPO / 'research' / 'archive').glob('*.py')} - {'__init__'}
  retired = _retired()
  assert retired == {'noise_scale', 'annealed_rung', 'noise_cost'}
  assert live - helpers == set(LIVE), f'research/ is the live studies and the helpers: {live ^ (set(LIVE) | helpers)}'
  assert archived - helpers == set(ARCHIVED) - retired, f'research/archive/ is the archived studies: {archived}'
  # CI's research step (`pytest research/tests`) runs the live studies' tests alone: an archived study's are in
  # research/archive/tests/, and no live study or live test imports the archive.
  ci_tests = {p.stem.removeprefix('test_') for p in (REPO / 'research' / 'tests').glob('test_*.py')}
  assert not ci_tests & set(ARCHIVED), ci_tests & set(ARCHIVED)
  archived_tests = {p.stem.removeprefix('test_') for p in (REPO / 'research' / 'archive' / 'tests').glob('test_*.py')}
  assert archived_tests <= set(ARCHIVED) | helpers, archived_tests
  for path in [*(REPO / 'research').glob('*.py'), *(REPO / 'research' / 'tests').glob('test_*.py')]:
    if path.name == pathlib.Path(__file__).name:
      continue  # (this file redraws the archived pages by module name, importlib)
    assert 'research.archive import' not in path.read_text(encoding='utf-8'), f'{path.name} (live) imports the archive'
  # Every study's JSON at the top of results/ and every records folder results/<study>/runs/ is an indexed study's.
  jsons = {p.stem for p in (REPO / 'results').glob('*.json')}
  runs = {p.parent.name for p in (REPO / 'results').glob('*/runs')}
  assert jsons <= set(INDEX) and runs <= set(INDEX), f'not in the index: {(jsons | runs) - set(INDEX)}'
  assert {'autolr', 'workloads', 'model_size', 'noise_scale', 'table1', 'lowcomm'} <= runs


def _first_difference(got: bytes, want: bytes) -> str:
  diff = difflib.unified_diff(
    want.decode('utf-8', 'replace').splitlines(),
    got.decode('utf-8', 'replace').splitlines(),
    'committed',
    'redrawn',
    n=0,
    lineterm='',
  )
  return '\n'.join(line[:300] for line in list(diff)[:12])


@pytest.mark.parametrize('study', REGENERABLE)
def test_report_only_redraws_the_committed_page_byte_for_byte(study, tmp_path, monkeypatch, capsys):
  from hdet_jax.trainer import process

  monkeypatch.setattr(process, 'setup_jax', lambda *a, **k: None)  # nothing trains: leave this process's JAX as it is
  importlib.import_module(_module(study)).main(['--report-only', '--out', str(tmp_path)])
  capsys.readouterr()
  page = REPO / INDEX[study]['page']
  written = sorted(p.name for p in tmp_path.iterdir() if p.suffix in ('.md', '.json'))
  assert written == sorted([page.name, page.stem + '.json'])
  for name in written:
    got, want = (tmp_path / name).read_bytes(), (page.parent / name).read_bytes()
    assert got == want, (
      f'{page.parent.relative_to(REPO) / name} is not what `python -m {_module(study)} '
      f'--report-only` writes:\n{_first_difference(got, want)}'
    )


# The pages beside the index's: each screened variant's workloads report (``research.workloads --variant V``) and each
# other task's autolr report (``research.autolr --config.X=Y ...``, the overrides its page names).
SCREENS = sorted(p.name for p in (REPO / 'results' / 'workloads_screens').iterdir())
TASKS = sorted(p.name for p in (REPO / 'results' / 'autolr' / 'tasks').iterdir())


def _redraws_byte_for_byte(out: pathlib.Path, page: pathlib.Path, command: str) -> None:
  written = sorted(p.name for p in out.iterdir() if p.suffix in ('.md', '.json'))
  assert written == sorted([page.name, page.stem + '.json'])
  for name in written:
    got, want = (out / name).read_bytes(), (page.parent / name).read_bytes()
    assert got == want, (
      f'{page.parent.relative_to(REPO) / name} is not what `{command}` writes:\n{_first_difference(got, want)}'
    )


def _figures_not_rendered(monkeypatch, *modules) -> None:
  """The modules' figures drawn but not laid out or written (most of a report's time; the pages are compared, not the
  PNGs): ``save_figure`` closes the figure and returns its path."""
  import matplotlib.pyplot as plt

  def save_figure(fig, folder, name, dpi=None):
    plt.close(fig)
    return str(pathlib.Path(folder) / name)

  for module in modules:
    monkeypatch.setattr(module, 'save_figure', save_figure)


def test_the_screens_are_of_live_variants_and_the_tasks_have_records():
  from research import autolr

  assert len(SCREENS) == 22 and len(TASKS) == 9  # (a screen or task added or retired changes these)
  live = set(autolr.VARIANT_SETTINGS) - {autolr.DEFAULT_VARIANT}  # (the default's page is results/workloads.md)
  assert set(SCREENS) <= live, f'screens of no live variant: {set(SCREENS) - live}'
  assert all((REPO / 'results' / 'autolr' / 'runs' / t).is_dir() for t in TASKS)


@pytest.mark.parametrize('variant', SCREENS)
def test_a_screen_redraws_byte_for_byte(variant, tmp_path, monkeypatch, capsys):
  from hdet_jax.trainer import process
  from research import workloads

  monkeypatch.setattr(process, 'setup_jax', lambda *a, **k: None)
  _figures_not_rendered(monkeypatch, workloads)
  workloads.main(['--variant', variant, '--report-only', '--out', str(tmp_path)])
  capsys.readouterr()
  page = REPO / 'results' / 'workloads_screens' / variant / 'workloads.md'
  _redraws_byte_for_byte(tmp_path, page, f'python -m research.workloads --variant {variant} --report-only')


@pytest.mark.parametrize('tag', TASKS)
def test_a_task_page_redraws_byte_for_byte(tag, tmp_path, monkeypatch, capsys):
  from hdet_jax.trainer import process
  from research import autolr, autolr_report

  page = REPO / 'results' / 'autolr' / 'tasks' / tag / 'autolr.md'
  command = re.search(r'`python -m research\.autolr ((?:--config\.\S+ ?)+)`', page.read_text(encoding='utf-8'))
  assert command, f'{page.relative_to(REPO)} names no `python -m research.autolr --config.X=Y ...` command'
  args = command.group(1).split()
  assert autolr.task_tag(autolr.parse_overrides(args)[1], False) == tag  # the command's task is this folder's
  monkeypatch.setattr(process, 'setup_jax', lambda *a, **k: None)
  _figures_not_rendered(monkeypatch, autolr_report)
  autolr.main(['--report-only', '--out', str(tmp_path), *args])
  capsys.readouterr()
  _redraws_byte_for_byte(tmp_path, page, f'python -m research.autolr --report-only {" ".join(args)}')


@pytest.mark.parametrize('study', NOT_REGENERABLE_STUDIES)
def test_a_page_that_cannot_be_redrawn_says_so(study, capsys):
  text = (REPO / INDEX[study]['page']).read_text(encoding='utf-8')
  assert NOT_REGENERABLE in text.lower()
  if study in _retired():
    return  # (its code is gone: the page names the commit that has it)
  assert not re.search(r'\bexperiments\.\w', text)  # a live study's page names research.<study>
  before = sorted(p.relative_to(REPO) for p in (REPO / 'results').rglob('*'))
  with pytest.raises(SystemExit, match=f'results/{study}.md.* not regenerable'):
    importlib.import_module(_module(study)).main(['--report-only'])
  assert sorted(p.relative_to(REPO) for p in (REPO / 'results').rglob('*')) == before  # nothing written
