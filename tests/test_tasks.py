"""The task seam (hdet_jax/trainer/tasks/): the LM bit for bit through it, mnist1d's data, CNN and .npz checks."""

import json
import os

import jax
import numpy as np
import pytest

import cli_testing
from hdet_jax.trainer import ConfigError, checkpoints, tasks

from trainer_testing import train_and_evaluate
from hdet_jax.trainer.tasks import lm_input_pipeline as input_pipeline
from hdet_jax.trainer.tasks import lm_model as model_lib
from hdet_jax.trainer.metrics import read_metrics
from hdet_jax.trainer.tasks import mnist1d
import trainer_testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, 'configs', 'tiny.py')
MNIST1D = os.path.join(ROOT, 'configs', 'mnist1d.py')
REFERENCE = os.path.join(ROOT, 'tests', 'data', 'lm_seam_reference.json')


def _config(path, **overrides):
  return trainer_testing.load(path, **overrides)


def _settings(config):
  """The task's own settings of ``config`` (what every Task method reads)."""
  return trainer_testing.resolve(config).task_settings


def _load(task, config, num_replicas=8):
  """``task``'s data for ``config``, at the run's seed."""
  return task.load(_settings(config), num_replicas, trainer_testing.resolve(config).seed)


def small_mnist1d(**overrides):
  """mnist1d at test size: 400 generated examples, 16 steps, 4 examples per replica, syncs every 8."""
  return _config(
    MNIST1D,
    **{
      'data.num_samples': 400,
      'data.batch_size': 4,
      'num_train_steps': 16,
      'hdet.sync_every': 8,
      'log_every': 4,
      'eval_every': 0,
      'checkpoint_every': 0,
      'plots': False,
      'tensorboard': False,
      'progress_bar': False,
      'compilation_cache': '',
      **overrides,
    },
  )


def _cpu() -> str:
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    return next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), '')


def _cpu_id() -> str:
  """The processor's family, model and stepping: two CPUs with one model name (e.g. 'AMD EPYC') can round
  differently in XLA:CPU's code, as two machines of that name did here (1 ulp in the step-39 losses)."""
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    lines = f.read().split('\n\n')[0].splitlines()
  fields = dict(map(str.strip, line.split(':', 1)) for line in lines if ':' in line)  # (keys end in tabs there)
  return '/'.join(fields.get(k, '') for k in ('cpu family', 'model', 'stepping'))


# ---- The LM through the seam ----


def unpacked_fingerprint(config, workdir, step, devices=None):
  """The fingerprint of checkpoint ``step``'s state in the layout before state format 5: the optimizer state
  an unpacked HDETState (format 5 packs HDET's small fields into one vector, bit for bit), without the fields
  formats 6 and 7 added."""
  from hdet_jax.trainer import mesh as mesh_lib, optimizer as optimizer_lib, programs

  n = config.hdet.num_replicas
  run = trainer_testing.resolve(config)
  tx = optimizer_lib.make_optimizer(run.optimizer, n, seed=run.seed)
  mesh = mesh_lib.make_mesh(n, devices=devices)
  abstract = jax.eval_shape(
    lambda k: dict(zip(('params', 'opt_state'), programs.make_init(run.task, run.task_settings, tx, mesh, n)(k))),
    jax.random.key(0),
  )
  abstract = mesh_lib.with_layout(mesh, abstract)
  abstract['rng'] = jax.ShapeDtypeStruct((2,), np.uint32, sharding=mesh_lib.replicated(mesh))
  if run.guard.rollback:  # the rollback's anchor (formats 7 and 9), which the reference predates
    abstract['anchor'] = mesh_lib.anchor_shapes(mesh, abstract)
  ckpt = checkpoints.Checkpointer(workdir, 0)
  state, _ = ckpt.restore(step, abstract)
  ckpt.close()
  state.pop('anchor', None)
  state['opt_state'] = jax.jit(jax.vmap(lambda p, s: programs.unpack(tx, p, s)))(state['params'], state['opt_state'])
  # Format 6 adds three controller fields the reference predates (the fit's asked step, its slope's stderr and the
  # window's training loss), format 7 the window's squared loss changes, the last loss, the training loss's stderr and
  # the back-off flag, format 8 the settled flags.
  added = (
    '.asked',
    '.stderr',
    '.train_loss',
    '.loss_diff_sq_sum',
    '.last_loss',
    '.train_loss_se',
    '.backed_off',
    '.settled',
  )
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  return [f for f, p in zip(checkpoints.fingerprint(state), paths) if not p.endswith(added)]


def test_lm_runs_bit_for_bit_as_before_the_seam(straight):
  """configs/tiny.py's losses, evaluations and step-40 checkpoint fingerprint equal those recorded by the trainer
  before the task seam (bitwise on the processor that recorded them; XLA:CPU rounds differently on others,
  so there the losses and evaluations to float32 rounding). The state's fingerprint is taken in the layout it was
  recorded in (the optimizer state unpacked, see unpacked_fingerprint); the averaged parameters' as saved.

  The run is the session's shared `straight` (tests/conftest.py: train.py on configs/tiny.py with the tests' tuning,
  as this test's own in-process run was; its plots and TensorBoard files change no number, and test_trainer.py's
  resume test holds such a run bit for bit to the in-process one); only read here."""
  ref = json.load(open(REFERENCE, encoding='utf-8'))
  workdir, _ = straight
  summary = json.load(open(os.path.join(workdir, 'summary.json'), encoding='utf-8'))
  m = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  got_evals = [{'step': r['step'], 'val_loss': r['val_loss']} for r in m['eval']]
  got_train = {
    str(r['step']): list(np.asarray(r['loss'], float)) for r in m['train'] if str(r['step']) in ref['train_loss']
  }
  assert summary['task'] == 'lm' and summary['metric'] == 'val_bits_per_byte'
  assert (
    summary['final_metric'] == summary['final_val_bits_per_byte'] == model_lib.bits_per_byte(summary['final_val_loss'])
  )
  # Bitwise only where the reference names this machine: the processor (its model name and, where recorded, its
  # family, model and stepping; the reference of this file names only 'AMD EPYC', which proved too coarse), jax and
  # XLA's flags (tests/conftest.py's or XLA's defaults: they round differently too). This reference names no processor
  # id, so it is compared to float32 rounding everywhere: 40 steps apart by at most 1e-6 relative here (AMD EPYC
  # 26/2/1) under the suite's flags, 8e-8 under XLA's defaults; the bound is a hundred times that.
  from hdet_jax.trainer import process

  if (
    ref['cpu']
    and _cpu().startswith(ref['cpu'])
    and ref.get('cpu_id') == _cpu_id()
    and ref.get('jax') == jax.__version__
    and ref.get('xla_flags') == process.machine()['xla_flags']
  ):
    assert got_evals == ref['evals']
    assert got_train == ref['train_loss']
    fingerprint = checkpoints.read_meta(workdir, 40)['fingerprint']
    assert fingerprint['avg_params'] == ref['fingerprint_step40']['avg_params']
    assert unpacked_fingerprint(_config(TINY), workdir, 40) == ref['fingerprint_step40']['state']
  else:
    assert [e['step'] for e in got_evals] == [e['step'] for e in ref['evals']] and set(got_train) == set(
      ref['train_loss']
    )
    np.testing.assert_allclose([e['val_loss'] for e in got_evals], [e['val_loss'] for e in ref['evals']], rtol=1e-4)
    for step, losses in ref['train_loss'].items():
      np.testing.assert_allclose(got_train[step], losses, rtol=1e-4)


def test_lm_task_is_the_model_and_pipeline_it_wraps():
  """The LM task's loss, eval metrics, batches and common batches are lm_model.py's and lm_input_pipeline.py's."""
  config = _config(TINY)
  task = tasks.get(config.task)
  assert task is tasks.get() and task.name == 'lm'
  data = _load(task, config)
  corpus = input_pipeline.load_corpus(None)
  train, val = input_pipeline.split(corpus, config.data.val_fraction)
  want = input_pipeline.TrainBatches(train, 32, 4, 8, config.seed)
  np.testing.assert_array_equal(data.batches.chunk(25, 3), want.chunk(25, 3))
  np.testing.assert_array_equal(data.eval_batch, input_pipeline.validation_windows(val, 32, 8, config.eval_windows))
  np.testing.assert_array_equal(data.probe(3), input_pipeline.probe_windows(train, 32, 16, config.seed, 3))
  graphdef, params = task.init_model(_settings(config), jax.random.key(0))
  batch = want.batch(0)[0]
  got = task.eval_metrics(graphdef, params, batch)
  assert list(got) == ['loss'] and float(got['loss']) == float(model_lib.loss_fn(graphdef, params, batch))


def test_unknown_task_is_one_config_error(tmp_path):
  with pytest.raises(ConfigError, match="task must be one of 'lm', 'mnist1d', got 'cifar'"):
    train_and_evaluate(_config(TINY, task='cifar'), str(tmp_path / 'w'))
  assert not os.path.exists(tmp_path / 'w')


# ---- mnist1d: data ----


def test_mnist1d_data_is_the_packages_generator_deterministic_and_leaves_numpy_alone():
  np.random.seed(123)
  before = np.random.get_state()[1].copy()
  a = mnist1d.generate(200, 0.8, 42)
  assert np.array_equal(np.random.get_state()[1], before)  # the package's global seeding is undone
  assert a['x'].shape == (160, 40) and a['x_test'].shape == (40, 40) and a['x'].dtype == np.float32
  assert a['y'].dtype == np.int32 and set(np.unique(a['y'])) <= set(range(10))
  mnist1d.generate.cache_clear()
  b = mnist1d.generate(200, 0.8, 42)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(mnist1d.generate(200, 0.8, 7)['x'], a['x'])  # dataset_seed picks another set


def test_mnist1d_batches_are_a_function_of_seed_and_step():
  config = small_mnist1d()
  data = _load(mnist1d.TASK, config)
  chunk = data.batches.chunk(4, 3)
  assert chunk['x'].shape == (8, 3, 4, 40, 1) and chunk['y'].shape == (8, 3, 4)
  np.testing.assert_array_equal(chunk['x'][:, 1], data.batches.batch(5)['x'])  # a chunk is its steps' batches
  idx = data.batches.indices(0)
  assert len(np.unique(idx)) == idx.size  # within an epoch no two replicas share an example
  again = _load(mnist1d.TASK, config).batches.indices(7)
  np.testing.assert_array_equal(again, data.batches.indices(7))
  other = _load(mnist1d.TASK, _config(MNIST1D, **{'data.num_samples': 400, 'data.batch_size': 4, 'seed': 1}))
  assert not np.array_equal(other.batches.indices(0), idx)
  assert data.eval_batch['x'].shape == (8, 10, 40, 1)  # 80 test examples, 10 per replica
  probe = data.probe(2)
  assert probe['x'].shape == (16, 40, 1) and np.array_equal(probe['y'], data.probe(2)['y'])


# ---- mnist1d: the CNN against a numpy oracle ----


def _conv1d(x, kernel, bias, stride=2, pad=1):
  """x [B, L, C], kernel [k, C, O]: the strided, zero-padded 1-D convolution, written out."""
  x = np.pad(x, ((0, 0), (pad, pad), (0, 0)))
  k = kernel.shape[0]
  out_len = (x.shape[1] - k) // stride + 1
  return (
    np.stack([np.einsum('bkc,kco->bo', x[:, i * stride : i * stride + k], kernel) for i in range(out_len)], 1) + bias
  )


def test_cnn_loss_on_a_fixed_batch_matches_a_numpy_oracle():
  config = small_mnist1d(**{'model.channels': 5})
  graphdef, params = mnist1d.TASK.init_model(_settings(config), jax.random.key(3))
  data = _load(mnist1d.TASK, config)
  batch = data.batches.batch(0)
  batch = {'x': batch['x'][0], 'y': batch['y'][0]}
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  h = batch['x'].astype(np.float64)
  for name in ('conv1', 'conv2', 'conv3'):
    h = np.maximum(_conv1d(h, p[name]['kernel'], p[name]['bias']), 0.0)
  logits = h.reshape(len(h), -1) @ p['linear']['kernel'] + p['linear']['bias']
  logp = logits - logits.max(1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
  ce = -logp[np.arange(len(logp)), batch['y']].mean()
  eps = 0.1
  smoothed = ((1 - eps) * -logp[np.arange(len(logp)), batch['y']] + eps * -logp.mean(1)).mean()
  train, plain = mnist1d.TASK.losses(graphdef, params, batch, tasks.Regularization(), eps)
  np.testing.assert_allclose(float(plain), ce, rtol=2e-5)
  np.testing.assert_allclose(float(train), smoothed, rtol=2e-5)
  m = mnist1d.TASK.eval_metrics(graphdef, params, batch)
  np.testing.assert_allclose(float(m['loss']), ce, rtol=2e-5)
  assert float(m['accuracy']) == np.mean(np.argmax(logits, 1) == batch['y'])
  assert sum(a.size for a in jax.tree.leaves(params)) == (5 * 1 * 5 + 5) + 2 * (3 * 5 * 5 + 5) + (5 * 5 * 10 + 10)


def test_mnist1d_trains_through_the_trainer(tmp_path):
  """16 HDET steps on 8 replicas: the summary names the task and its metric (test cross-entropy), with accuracy."""
  s = train_and_evaluate(small_mnist1d(**{'optim.max_lr': 3e-2, 'hdet.initial_scale': 1.0}), str(tmp_path / 'm'))
  assert s['task'] == 'mnist1d' and s['metric'] == 'val_loss' and s['final_metric'] == s['final_val_loss']
  assert s['final_val_loss'] < np.log(10) - 0.05 and 0.1 < s['final_val_accuracy'] <= 1.0
  assert s['unit'] == 'examples' and s['num_params'] > 0
  evals = read_metrics(os.path.join(s['workdir'], 'metrics.jsonl'))['eval']
  assert set(evals[-1]) >= {'val_loss', 'val_accuracy'}


# ---- mnist1d: the MLP (model.kind='mlp') ----


def test_mlp_loss_on_a_fixed_batch_matches_a_numpy_oracle():
  config = small_mnist1d(**{'model.kind': 'mlp', 'model.hidden': 7})
  graphdef, params = mnist1d.TASK.init_model(_settings(config), jax.random.key(4))
  assert sorted(params) == ['dense1', 'dense2', 'linear']
  assert sum(a.size for a in jax.tree.leaves(params)) == (40 * 7 + 7) + (7 * 7 + 7) + (7 * 10 + 10)
  batch = _load(mnist1d.TASK, config).batches.batch(0)
  batch = {'x': batch['x'][0], 'y': batch['y'][0]}
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  h = batch['x'].astype(np.float64).reshape(len(batch['x']), -1)
  for name in ('dense1', 'dense2'):
    h = np.maximum(h @ p[name]['kernel'] + p[name]['bias'], 0.0)
  logits = h @ p['linear']['kernel'] + p['linear']['bias']
  logp = logits - logits.max(1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
  _, plain = mnist1d.TASK.losses(graphdef, params, batch, tasks.Regularization(), 0.0)
  np.testing.assert_allclose(float(plain), -logp[np.arange(len(logp)), batch['y']].mean(), rtol=2e-5)


def test_mlp_hidden_kernels_are_the_conv_group():
  """Per-group LRs: the MLP's dense kernels fall in the group the CNN's convolutions form ('conv')."""
  from hdet_jax.param_groups import group_labels

  config = small_mnist1d(**{'model.kind': 'mlp', 'model.hidden': 7})
  _, params = mnist1d.TASK.init_model(_settings(config), jax.random.key(0))
  labels = group_labels(params, mnist1d.TASK.param_groups)
  assert labels['dense1']['kernel'] == labels['dense2']['kernel'] == 'conv'
  assert labels['linear']['kernel'] == 'head' and labels['dense1']['bias'] == 'no_decay'


def test_mlp_trains_through_the_trainer_and_is_a_run_of_its_own(tmp_path):
  config = small_mnist1d(**{'model.kind': 'mlp', 'model.hidden': 16, 'optim.max_lr': 3e-2, 'hdet.initial_scale': 1.0})
  s = train_and_evaluate(config, str(tmp_path / 'm'))
  assert s['num_params'] == (40 * 16 + 16) + (16 * 16 + 16) + (16 * 10 + 10)
  assert s['final_val_loss'] < np.log(10) - 0.05
  # The CNN at the same fields is another run (model.kind is in its identity); the default CNN's identity has
  # neither new field, so workdirs and records made before the MLP existed still resume.
  cnn = trainer_testing.resolve(small_mnist1d()).training_fields(8)
  assert trainer_testing.resolve(config).training_fields(8)['model.kind'] == 'mlp'
  assert 'model.kind' not in cnn and 'model.hidden' not in cnn


def test_an_unknown_model_kind_is_one_config_error(tmp_path):
  with pytest.raises(ConfigError, match=r"model.kind='rnn' is not a model of this task; use one of cnn, mlp"):
    train_and_evaluate(small_mnist1d(**{'model.kind': 'rnn'}), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


# ---- mnist1d: a user's .npz ----


def _npz(path, **arrays):
  rng = np.random.default_rng(0)
  base = {
    'x': rng.normal(size=(64, 12, 2)),
    'y': rng.integers(0, 10, 64),
    'x_test': rng.normal(size=(16, 12, 2)),
    'y_test': rng.integers(0, 10, 16),
  }
  base.update(arrays)
  np.savez(path, **{k: v for k, v in base.items() if v is not None})
  return str(path)


def test_a_users_npz_trains(tmp_path):
  path = _npz(tmp_path / 'ok.npz')
  s = train_and_evaluate(
    small_mnist1d(**{'data.path': path, 'num_train_steps': 8, 'hdet.sync_every': 4}), str(tmp_path / 'w')
  )
  assert s['step'] == 8 and np.isfinite(s['final_val_loss'])


@pytest.mark.parametrize(
  'arrays, message',
  [
    ({'y_test': None}, r"^data.path='[^']*bad.npz' lacks the arrays y_test; it needs"),  # one message, not wrapped
    ({'x_test': np.full((16, 12, 2), 'a')}, r'x_test must hold numbers .* got dtype <U1'),
    ({'y': np.zeros(63, int)}, 'same n'),
    ({'y': np.full(64, 10)}, r'integer labels in \[0, model.num_classes=10\)'),
    ({'x': np.full((64, 12, 2), np.nan)}, 'non-finite'),
  ],
)
def test_a_bad_npz_is_one_error_before_anything_is_written(tmp_path, arrays, message):
  workdir = tmp_path / 'w'
  with pytest.raises(ConfigError, match=message):
    train_and_evaluate(small_mnist1d(**{'data.path': _npz(tmp_path / 'bad.npz', **arrays)}), str(workdir))
  assert not workdir.exists()


def test_a_bad_npz_from_the_command_line_exits_2_with_one_error_line(tmp_path):
  bad = _npz(tmp_path / 'bad.npz', y=np.full(64, -1))
  proc = cli_testing.run(
    [
      os.path.join(ROOT, 'train.py'),
      '--config',
      MNIST1D,
      f'--config.data.path={bad}',
      '--workdir',
      str(tmp_path / 'w'),
    ],
    cwd=ROOT,
    timeout=300,
  )
  assert proc.returncode == 2
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'data.path=' in errors[0] and 'y must hold integer labels' in errors[0]
  assert not (tmp_path / 'w').exists()


def test_every_task_module_is_found_and_nothing_outside_tasks_names_a_task():
  """The seam is closed: a task is its module (with a ``TASK``) and a config; nothing registers it, and no trainer
  module outside ``tasks/`` compares against a task's name (the config's default, ``task='lm'``, aside)."""
  import ast
  import pathlib

  package = pathlib.Path(tasks.__file__).parent
  with_task = sorted(  # the oracle: the modules that assign TASK at their top level, read without importing them
    p.stem
    for p in package.glob('*.py')
    if any(
      isinstance(n, ast.Assign) and any(getattr(t, 'id', None) == 'TASK' for t in n.targets)
      for n in ast.parse(p.read_text()).body
    )
  )
  assert with_task == ['lm', 'mnist1d']
  assert tasks.names() == tuple(sorted(tasks.get(m).name for m in with_task)) == tasks.TASKS
  assert tasks.get('mnist1d') is mnist1d.TASK
  named = []
  for path in sorted(package.parent.glob('*.py')):
    tree = ast.parse(path.read_text())
    docstrings = {
      id(n.body[0].value)
      for n in ast.walk(tree)
      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)
    }
    named += [
      (path.name, node.lineno, node.value)
      for node in ast.walk(tree)
      if isinstance(node, ast.Constant) and node.value in tasks.names() and id(node) not in docstrings
    ]
  # The one exception: fields.py's task: str = field('lm', legacy='lm').
  assert named == [('fields.py', named[0][1], 'lm'), ('fields.py', named[0][1], 'lm')], named
