"""The README: its example runs as written (with a loss, initial parameters and batches supplied), and it stays
a short front page (at most 200 lines of at most 100 characters, the example near the top, links that resolve,
no lab-notebook narration)."""

import pathlib
import re
import textwrap

import numpy as np

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / 'README.md'

# What the example leaves to the reader: a loss, initial parameters and batches.
PRELUDE = """
import jax, jax.numpy as jnp
def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)
init_params = {'w': jnp.zeros((4, 1)), 'b': jnp.zeros((1,))}
_key = jax.random.key(0)
_x = jax.random.normal(_key, (8, 16, 4))
_y = _x @ (0.05 * jnp.arange(1.0, 5.0)[:, None])
class _OneStepInFlight:
  # The batches, handed out only once the step before has finished (it blocks on the loop's params). Dispatched
  # asynchronously, the 200 steps queue up as multi-device programs with collectives, and on a loaded 2-core
  # machine XLA:CPU's in-process all-reduce has deadlocked among them (aborted after its 60 s collective timeout;
  # CONTRIBUTING.md, "Known XLA:CPU limit"). One program in flight avoids that and changes no number.
  def __init__(self, items):
    self.items = items
  def __iter__(self):
    for item in self.items:
      jax.block_until_ready(globals().get('params'))
      yield item
    jax.block_until_ready(globals().get('params'))  # (the last step too, before the example averages)
batches = _OneStepInFlight([(_x, _y)] * 200)
"""

# Words of a lab notebook, not of a front page: dates, machine names, passes and sessions, internal IDs.
NOTEBOOK = re.compile(
  r'20\d\d-\d\d-\d\d|Xeon|EPYC|\bAMD\b|Intel|\bH100\b|\bH200\b|'
  r'(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|'
  r'\w+teenth|\w+tieth|\d+(?:st|nd|rd|th)) pass\b|'
  r'\bsession|fit_K\d|fit_lr_T|_settle\b|rollback_se2',
  re.I,
)


def _blocks():
  """The README's python blocks, dedented (some sit inside list items)."""
  return [textwrap.dedent(b) for b in re.findall(r' *```python\n(.*?) *```', README.read_text(), re.S)]


def _run_example():
  main = next(b for b in _blocks() if 'shard_map_replicas' in b)
  scope = {}
  exec(compile(PRELUDE + main, 'README.md', 'exec'), scope)
  return scope


def test_readme_example_runs():
  """The example with the measured default (AutoLR(total_steps=S), sync_every left to it: T = round(300 / 15))
  averages every 20 steps, keeps the replicas' permutations in agreement and trains."""
  scope = _run_example()
  opt_state = scope['opt_state']
  assert int(opt_state.sync_count[0]) == 10 and int(opt_state.count[0]) == 200
  np.testing.assert_allclose(np.asarray(opt_state.controller.perm[0]), np.asarray(opt_state.controller.perm[-1]))
  initial = float(scope['loss_fn'](scope['init_params'], (scope['_x'][0], scope['_y'][0])))
  assert float(scope['loss'].mean()) < 0.8 * initial, (float(scope['loss'].mean()), initial)


def test_readme_is_short_and_narrow():
  lines = README.read_text().splitlines()
  assert len(lines) <= 200, len(lines)
  long = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > 100]
  assert not long, long
  first_python = next(i for i, line in enumerate(lines) if line.strip() == '```python')
  assert first_python < 80, first_python
  assert 'hdet_jax.AutoLR(total_steps=S)' in _blocks()[0] and 'sync_every' not in _blocks()[0]


def test_readme_keeps_the_two_commands_of_a_fresh_machine():
  """The set-up-and-train command and the test command are the README's first two bash blocks (.ci/run runs the
  second)."""
  bash = re.findall(r'```bash\n(.*?)```', README.read_text(), re.S)
  assert bash[0] == (
    "python3 -m venv .venv && .venv/bin/pip install -e '.[trainer,test]' && .venv/bin/python train.py\n"
  )
  assert bash[1] == '.venv/bin/python -m pytest -q -n 2 --dist loadfile tests\n'


def test_readme_reads_as_a_front_page():
  hits = sorted({m.group() for m in NOTEBOOK.finditer(README.read_text())})
  assert not hits, hits


def test_readme_links_resolve():
  """Every relative link of the README names a file of this repository."""
  links = re.findall(r'\]\(([^)#\s]+)(?:#[^)]*)?\)', README.read_text())
  local = [link for link in links if '://' not in link]
  assert local, links
  missing = [link for link in local if not (ROOT / link).exists()]
  assert not missing, missing
