"""Task ``mnist1d``: a small 1-D CNN classifier on MNIST-1D (Greydanus 2020), or on a user's ``.npz``.

The data is generated offline by the PyPI package ``mnist1d``: ``make_dataset(get_dataset_args())``
with its documented arguments (``data.num_samples``, ``data.train_split``, ``data.dataset_seed``),
never its download path. Generation is deterministic (the package seeds numpy's global generator
from ``dataset_seed``; the state is restored after) and cached per process. ``data.path=FILE.npz``
replaces it with any arrays ``x``, ``y``, ``x_test``, ``y_test`` (signals ``[n, L]`` or ``[n, L, C]``,
integer labels in ``[0, model.num_classes)``).

The model (``model.kind``) is shaped like the dataset's reference CNN (``ConvBase``): three convolutions of 25
channels (kernels 5, 3, 3, stride 2, padding 1, ReLU), flattened into one linear layer; or an MLP (``'mlp'``): the
flattened signal through two ReLU layers of ``model.hidden`` units into the linear layer. The metric is the test
cross-entropy of the averaged model (nats, lower is better); test accuracy is reported beside it.
"""

import dataclasses
import functools
import os
import zipfile
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hdet_jax.trainer.fields import INT_AT_LEAST_1, OPEN_UNIT, field, valid
from hdet_jax.trainer.tasks import base

_TRAIN_TAG = 0x6D31  # separates the example order's stream from any other use of the seed
_PROBE_TAG = 0x7031  # the common batches compared at syncs
NPZ_KEYS = ('x', 'y', 'x_test', 'y_test')


# ---- Fields ----

# The task's own data.* and model.* (configs/mnist1d.py sets them from these sections), declared as the trainer's
# are (hdet_jax/trainer/fields.py). A line without field(...) is the trainer's field (fields.Data or fields.Model),
# at the task's value.


@dataclasses.dataclass(frozen=True)
class Mnist1dData:
  """``data.*`` of task 'mnist1d'."""

  # An .npz with x, y, x_test, y_test; None: generate MNIST-1D.
  path: str | None = None
  # MNIST-1D's make_dataset arguments (the rest at get_dataset_args' defaults: 40-sample signals, 10 classes).
  # 20x the published 5,000, so that the test cross-entropy varies less from seed to seed
  # (research/workloads_discussion.md, 'The noise floor'). Generated once per process.
  num_samples: int = field(100000, valid(lambda v: v >= 20, 'an integer >= 20'))
  # The first 80% of the generated examples train, the rest test.
  train_split: float = field(0.8, OPEN_UNIT)
  # The generator's seed (the package's default): the same data for every config.seed.
  dataset_seed: int = field(42, valid(lambda v: 0 <= v < 2**32, 'an integer in [0, 2**32)'))
  # Examples per replica per step (the global batch is num_replicas times this).
  batch_size: int = 32


@dataclasses.dataclass(frozen=True)
class Mnist1dModel:
  """``model.*`` of task 'mnist1d'."""

  # 'cnn': the reference CNN below; 'mlp': two ReLU layers of model.hidden units.
  kind: str = field('cnn', legacy='cnn')
  # Units of each of the MLP's two hidden layers (model.kind='mlp' only).
  hidden: int = field(128, INT_AT_LEAST_1, legacy=128)
  # Channels of each of the three convolutions (the reference CNN's 25).
  channels: int = field(25, INT_AT_LEAST_1)
  # Output classes (labels must lie in [0, num_classes)).
  num_classes: int = field(10, valid(lambda v: v >= 2, 'an integer >= 2'))
  # Dropout on the flattened features before the linear head (base value if explored).
  dropout: float = 0.0


# ---- Data ----


@functools.lru_cache(maxsize=2)
def generate(num_samples: int, train_split: float, dataset_seed: int) -> dict[str, np.ndarray]:
  """MNIST-1D from the package's generator: ``{'x', 'y', 'x_test', 'y_test'}``, signals ``[n, 40]`` float32."""
  try:
    from mnist1d.data import get_dataset_args, make_dataset  # imports requests and matplotlib: never in the core
  except ImportError:
    raise base.TaskError(
      'the mnist1d task needs the package mnist1d (pip install mnist1d==0.0.2.post1, part of '
      'the [trainer] extra), or point --config.data.path at an .npz file.'
    ) from None
  args = get_dataset_args()
  args.num_samples, args.train_split, args.seed = int(num_samples), float(train_split), int(dataset_seed)
  state = np.random.get_state()  # make_dataset seeds numpy's global generator; leave it as it was
  try:
    d = make_dataset(args)
  finally:
    np.random.set_state(state)
  return {
    'x': d['x'].astype(np.float32),
    'y': d['y'].astype(np.int32),
    'x_test': d['x_test'].astype(np.float32),
    'y_test': d['y_test'].astype(np.int32),
  }


def read_npz(path: str, num_classes: int) -> dict[str, np.ndarray]:
  """A user's ``.npz`` checked: every key, matching lengths and shapes, integer labels in range, finite signals."""
  where, full = f'data.path={path!r}', os.path.expanduser(path)
  fix = f'point --config.data.path at an .npz (numpy.savez) with arrays {", ".join(NPZ_KEYS)}'
  if os.path.isdir(full):
    raise base.TaskError(f'{where} is a directory, not a file; {fix}.')
  if not os.path.isfile(full):
    raise base.TaskError(f'{where}: no such file; {fix}.')
  try:
    with open(full, 'rb') as f:
      head = f.read(4)
  except OSError as e:
    raise base.TaskError(f'{where} cannot be read ({e.strerror or e}); {fix}.') from None
  if not head:
    raise base.TaskError(f'{where} is empty; {fix}.')
  if not zipfile.is_zipfile(full):  # an .npz is a zip archive of .npy files
    what = (
      'a truncated or corrupt .npz (its zip directory is missing)'
      if head == b'PK\x03\x04'
      else 'a single array (.npy), not an .npz'
      if head.startswith(b'\x93NUM')
      else 'not an .npz file (not a zip archive)'
    )
    raise base.TaskError(f'{where} is {what}; {fix}.')
  try:
    with np.load(full, allow_pickle=False) as f:
      missing = [k for k in NPZ_KEYS if k not in f.files]
      if missing:
        raise base.TaskError(
          f'{where} lacks the arrays {", ".join(missing)}; it needs {", ".join(NPZ_KEYS)} '
          '(signals [n, L] or [n, L, C], integer labels [n]).'
        )
      d = {k: np.asarray(f[k]) for k in NPZ_KEYS}
  except base.TaskError:
    raise  # already names the fix (a TaskError is a ValueError; not "unreadable")
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # a truncated or corrupt member
    raise base.TaskError(
      f'{where} is not a readable .npz file ({" ".join(str(e).split())}); write it again '
      f'with numpy.savez (arrays {", ".join(NPZ_KEYS)}).'
    ) from None
  for split in ('', '_test'):
    x, y = d['x' + split], d['y' + split]
    if x.ndim not in (2, 3) or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
      raise base.TaskError(
        f'{where}: x{split} {x.shape} and y{split} {y.shape} must be [n, L] or [n, L, C] signals '
        'and [n] labels of the same n > 0.'
      )
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes:
      raise base.TaskError(
        f'{where}: y{split} must hold integer labels in [0, model.num_classes={num_classes}), '
        f'got {y.dtype} in [{y.min()}, {y.max()}]; relabel them or raise model.num_classes.'
      )
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
      raise base.TaskError(
        f'{where}: x{split} must hold numbers (integers or floats), got dtype {x.dtype}; '
        'convert the signals to float32.'
      )
    if not np.all(np.isfinite(x)):
      raise base.TaskError(f'{where}: x{split} holds non-finite values (NaN or inf); clean or drop those examples.')
  shape = lambda a: a.shape[1:] if a.ndim == 3 else a.shape[1:] + (1,)
  if shape(d['x']) != shape(d['x_test']):
    raise base.TaskError(f'{where}: x {d["x"].shape} and x_test {d["x_test"].shape} must have the same signal shape.')
  return {
    'x': d['x'].astype(np.float32),
    'y': d['y'].astype(np.int32),
    'x_test': d['x_test'].astype(np.float32),
    'y_test': d['y_test'].astype(np.int32),
  }


def _channels_last(x: np.ndarray) -> np.ndarray:
  """Signals ``[n, L]`` or ``[n, L, C]`` as ``[n, L, C]``."""
  return x[..., None] if x.ndim == 2 else x


@dataclasses.dataclass(frozen=True, eq=False)
class ExampleBatches:
  """Deterministic training batches ``{'x': [N, B, L, C], 'y': [N, B]}`` by step.

  Epoch e visits the training examples in a random order from a numpy Philox generator keyed by
  ``(seed, e)``; step s of the epoch takes the next ``N * B`` examples and replica r gets its own rows.
  The batch of a step is a pure function of ``(seed, step)``.
  """

  x: np.ndarray  # [n, L, C] float32
  y: np.ndarray  # [n] int32
  batch_size: int
  num_replicas: int
  seed: int

  def __post_init__(self):
    if self.steps_per_epoch < 1:
      raise base.TaskError(
        f'the training split has {len(self.y)} examples, too few for one batch of '
        f'{self.num_replicas} replicas x {self.batch_size}; lower data.batch_size or add data.'
      )

  @property
  def steps_per_epoch(self) -> int:
    return len(self.y) // (self.num_replicas * self.batch_size)

  @functools.lru_cache(maxsize=2)
  def _order(self, epoch: int) -> np.ndarray:
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.seed, _TRAIN_TAG, epoch])))
    return rng.permutation(len(self.y))

  def position(self, step: int) -> dict:
    return {'epoch': step // self.steps_per_epoch, 'batch_in_epoch': step % self.steps_per_epoch}

  def indices(self, step: int) -> np.ndarray:
    """[N, B] indices of step's examples."""
    pos, g = self.position(step), self.num_replicas * self.batch_size
    i = pos['batch_in_epoch'] * g
    return self._order(pos['epoch'])[i : i + g].reshape(self.num_replicas, self.batch_size)

  def batch(self, step: int) -> dict:
    idx = self.indices(step)
    return {'x': self.x[idx], 'y': self.y[idx]}

  def chunk(self, first_step: int, steps: int) -> dict:
    """``{'x': [N, K, B, L, C], 'y': [N, K, B]}``: the batches of ``steps`` consecutive steps."""
    idx = np.stack([self.indices(s) for s in range(first_step, first_step + steps)], axis=1)
    return {'x': self.x[idx], 'y': self.y[idx]}


# ---- Model ----


class CNN1D(nnx.Module):
  """Signals ``[B, L, C]`` to class logits ``[B, num_classes]``: the reference ConvBase in flax.nnx."""

  def __init__(self, *, length: int, in_channels: int, channels: int, num_classes: int, rngs: nnx.Rngs):
    conv = functools.partial(nnx.Conv, strides=(2,), padding=((1, 1),), rngs=rngs)
    self.conv1 = conv(in_channels, channels, kernel_size=(5,))
    self.conv2 = conv(channels, channels, kernel_size=(3,))
    self.conv3 = conv(channels, channels, kernel_size=(3,))
    flat = conv_length(conv_length(conv_length(length, 5), 3), 3) * channels
    self.linear = nnx.Linear(flat, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array, reg: base.Regularization = base.Regularization()) -> jax.Array:
    h = jax.nn.relu(self.conv1(x))
    h = jax.nn.relu(self.conv2(h))
    h = jax.nn.relu(self.conv3(h)).reshape(x.shape[0], -1)
    return self.linear(base.dropout(h, reg.dropout_rate, reg.dropout_key))


class MLP1D(nnx.Module):
  """Signals ``[B, L, C]`` to class logits ``[B, num_classes]``: flattened, two ReLU layers, a linear head."""

  def __init__(self, *, length: int, in_channels: int, hidden: int, num_classes: int, rngs: nnx.Rngs):
    self.dense1 = nnx.Linear(length * in_channels, hidden, rngs=rngs)
    self.dense2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.linear = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array, reg: base.Regularization = base.Regularization()) -> jax.Array:
    h = jax.nn.relu(self.dense1(x.reshape(x.shape[0], -1)))
    h = jax.nn.relu(self.dense2(h))
    return self.linear(base.dropout(h, reg.dropout_rate, reg.dropout_key))


MODELS = ('cnn', 'mlp')


def conv_length(length: int, kernel: int, stride: int = 2, padding: int = 1) -> int:
  """The output length of a strided convolution."""
  return (length + 2 * padding - kernel) // stride + 1


# ---- The task ----


class MNIST1D(base.Task):
  name = 'mnist1d'
  metric = 'val_loss'
  unit = 'examples'
  # 'conv': the hidden layers' kernels (the CNN's convolutions, the MLP's dense layers).
  param_groups = {'no_decay': r'bias$', 'conv': r'^(conv|dense)\d/kernel$', 'head': r'^linear/kernel$'}
  explorable = ('dropout',)
  sections = {'data': Mnist1dData, 'model': Mnist1dModel}

  def unread(self, fields: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    out = []
    if fields['data.path']:
      generator = ('data.corpus', 'data.num_samples', 'data.train_split', 'data.dataset_seed')
      out.append((f'data.path={fields["data.path"]!r} is read instead of generating MNIST-1D', generator))
    other = {'cnn': ('model.hidden',), 'mlp': ('model.channels',)}.get(fields['model.kind'], ())
    out.append((f'model.kind={fields["model.kind"]!r} does not read it', other))
    return out

  def check(self, settings: base.TaskSettings) -> None:
    d, m = settings.data, settings.model
    if d.path is None and (d.num_samples < 20 or not 0 < d.train_split < 1):
      raise base.TaskError(
        f'data.num_samples={d.num_samples} must be >= 20 and data.train_split={d.train_split} in (0, 1).'
      )
    if m.channels < 1 or m.num_classes < 2:
      raise base.TaskError(f'model.channels={m.channels} must be >= 1 and model.num_classes={m.num_classes} >= 2.')
    if settings.model.kind not in MODELS:
      raise base.TaskError(
        f'model.kind={settings.model.kind!r} is not a model of this task; use one of {", ".join(MODELS)}.'
      )

  def arrays(self, settings: base.TaskSettings) -> dict[str, np.ndarray]:
    d = settings.data
    if d.path:
      return read_npz(d.path, settings.model.num_classes)
    return generate(d.num_samples, d.train_split, d.dataset_seed)

  def load(self, settings: base.TaskSettings, num_replicas: int, seed: int) -> base.TaskData:
    a = self.arrays(settings)
    x, x_test = _channels_last(a['x']), _channels_last(a['x_test'])
    if settings.model.kind == 'cnn' and conv_length(conv_length(conv_length(x.shape[1], 5), 3), 3) < 1:
      raise base.TaskError(f'signals of length {x.shape[1]} are too short for the CNN (at least 4 samples).')
    per = len(a['y_test']) // num_replicas
    if settings.eval_windows > 0:
      per = min(per, settings.eval_windows // num_replicas)
    if per < 1:
      raise base.TaskError(
        f'the test split has {len(a["y_test"])} examples, fewer than one for each of '
        f'{num_replicas} replicas; use more test examples.'
      )
    batches = ExampleBatches(x, a['y'], settings.data.batch_size, num_replicas, seed)
    probes = settings.probe_windows

    def probe(index):
      rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, _PROBE_TAG, index])))
      idx = rng.integers(0, len(a['y']), size=probes)
      return {'x': x[idx], 'y': a['y'][idx]}

    return base.TaskData(
      batches=batches,
      eval_batch=base.stack_examples({'x': x_test, 'y': a['y_test']}, num_replicas, per),
      probe=probe,
      description=f'{len(a["y"]):,} train / {len(a["y_test"]):,} test examples (signals {x.shape[1]} x {x.shape[2]})',
    )

  def _make(self, settings: base.TaskSettings, key: jax.Array, shape: tuple[int, int]) -> CNN1D | MLP1D:
    if settings.model.kind == 'mlp':
      return MLP1D(
        length=shape[0],
        in_channels=shape[1],
        hidden=settings.model.hidden,
        num_classes=settings.model.num_classes,
        rngs=nnx.Rngs(params=key),
      )
    return CNN1D(
      length=shape[0],
      in_channels=shape[1],
      channels=settings.model.channels,
      num_classes=settings.model.num_classes,
      rngs=nnx.Rngs(params=key),
    )

  def _signal_shape(self, settings: base.TaskSettings) -> tuple[int, int]:
    a = self.arrays(settings)
    return _channels_last(a['x'][:1]).shape[1:]

  def abstract_model(self, settings: base.TaskSettings) -> tuple[Any, Any]:
    shape = self._signal_shape(settings)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: self._make(settings, jax.random.key(0), shape)), nnx.Param)
    return graphdef, nnx.to_pure_dict(params)

  def init_model(self, settings: base.TaskSettings, key: jax.Array) -> tuple[Any, Any]:
    graphdef, params = nnx.split(self._make(settings, key, self._signal_shape(settings)), nnx.Param)
    return graphdef, nnx.to_pure_dict(params)

  def logits(self, graphdef: Any, params: Any, x: jax.Array, reg: base.Regularization = base.Regularization()):
    return nnx.merge(graphdef, params)(x, reg)

  def losses(self, graphdef, params, batch, reg=base.Regularization(), label_smoothing=0.0):
    return base.smoothed_cross_entropy(self.logits(graphdef, params, batch['x'], reg), batch['y'], label_smoothing)

  def eval_metrics(self, graphdef, params, batch):
    logits = self.logits(graphdef, params, batch['x'])
    _, ce = base.smoothed_cross_entropy(logits, batch['y'], 0.0)
    return {'loss': ce, 'accuracy': jnp.mean((jnp.argmax(logits, -1) == batch['y']).astype(jnp.float32))}


TASK = MNIST1D()
