"""plain_pmap.py plus HDET: docs/pmap.md shows and explains the diff.

flax linen: a small ResNet (convolutions, BatchNorm, a residual block) in a ``TrainState`` with ``batch_stats``;
``jax.pmap(train_step, axis_name='batch')`` over the devices, one HDET replica on each: the state stacked
``[N, ...]`` and put on the devices with ``hdet_jax.replicas_to_devices``, the gradient averaged with
``hdet_jax.pmean_finite``; SGD with Nesterov momentum on a warmup + cosine schedule and an L2 penalty in the loss,
wrapped by ``hdet``; each replica's batch statistics its own, averaged at the syncs; the replicas' average
evaluated; ``flax.training.checkpoints`` saving every replica. The task: 8x8 RGB images of 4 classes, each a
fixed random pattern, shifted and noised, made here (nothing is downloaded). ``python hdet_pmap.py [--quick]``
trains it as 8 replicas on 8 simulated CPU devices.
"""
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import checkpoints, train_state
from jax import lax
import hdet_jax

SIZE, CLASSES, WIDTH = 8, 4, 16  # 8x8 RGB images of 4 classes; the convolutions' channels
BATCH, STEPS, WARMUP, PEAK_LR = 64, 40, 4, 0.1  # global batch, steps, warmup steps, the schedule's peak
MOMENTUM, WEIGHT_DECAY, CKPT_EVERY = 0.9, 1e-4, 10


class ResNetBlock(nn.Module):
  filters: int
  norm: Any

  @nn.compact
  def __call__(self, x):
    y = nn.relu(self.norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(x)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
    return nn.relu(x + y)


class ResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    x = nn.relu(norm()(nn.Conv(WIDTH, (3, 3), use_bias=False)(x)))
    x = ResNetBlock(WIDTH, norm)(x)
    return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


class TrainState(train_state.TrainState):
  batch_stats: Any


def batches(seed=0):
  """Global batches {'image': [BATCH, SIZE, SIZE, 3], 'label': [BATCH]}: a class's pattern, shifted, plus noise."""
  patterns = np.random.default_rng(0).normal(size=(CLASSES, SIZE, SIZE, 3)).astype(np.float32)
  rng = np.random.default_rng(seed + 1)
  while True:
    label, shift = rng.integers(CLASSES, size=BATCH), rng.integers(SIZE, size=BATCH)
    image = np.stack([np.roll(patterns[c], s, axis=1) for c, s in zip(label, shift)])
    yield {'image': image + rng.normal(size=image.shape).astype(np.float32), 'label': label.astype(np.int32)}


def shard(batch):
  """This process's rows of a global batch [BATCH, ...], as [its devices, BATCH / devices, ...]: what a per-host
  input pipeline gives flax's common_utils.shard (the whole batch on one host)."""
  p, hosts = jax.process_index(), jax.process_count()
  rows = lambda x: x[p * len(x) // hosts:(p + 1) * len(x) // hosts]
  return jax.tree.map(lambda x: rows(x).reshape((jax.local_device_count(), -1) + x.shape[1:]), batch)


def create_learning_rate_fn():
  return optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, WARMUP, STEPS)


def create_train_state(key):
  variables = ResNet().init(key, jnp.zeros((1, SIZE, SIZE, 3)), train=False)
  tx = optax.sgd(create_learning_rate_fn(), momentum=MOMENTUM, nesterov=True)
  tx = hdet_jax.hdet(tx, num_replicas=jax.device_count(), replica_axis='batch',
                     auto_lr=hdet_jax.AutoLR(total_steps=STEPS, initial_scale=1.0))
  state = TrainState.create(
      apply_fn=ResNet().apply, params=variables['params'], tx=tx, batch_stats=variables['batch_stats'])
  return hdet_jax.stack_replicas(state, jax.device_count())  # [N, ...] on every leaf


def compute_metrics(logits, labels):
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  return lax.pmean({'loss': loss, 'accuracy': accuracy}, axis_name='batch')


def train_step(state, batch):
  def loss_fn(params):
    variables = {'params': params, 'batch_stats': state.batch_stats}
    logits, new_model_state = state.apply_fn(variables, batch['image'], mutable=['batch_stats'])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()
    weight_penalty = 0.5 * WEIGHT_DECAY * sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params) if p.ndim > 1)
    return loss + weight_penalty, (new_model_state, logits)

  aux, grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grads = hdet_jax.pmean_finite(grads, 'batch')  # the all-reduce across replicas
  new_model_state, logits = aux[1]
  metrics = compute_metrics(logits, batch['label'])
  batch_stats = new_model_state['batch_stats']
  new_state = hdet_jax.apply_gradients(state, grads, value=aux[0])  # value: for the LR
  batch_stats = hdet_jax.average_at_sync(batch_stats, new_state, 'batch')  # at syncs
  new_state = new_state.replace(batch_stats=batch_stats)
  return new_state, metrics


def eval_step(state, batch):
  variables = {'params': state.params, 'batch_stats': state.batch_stats}
  logits = state.apply_fn(variables, batch['image'], train=False, mutable=False)
  return compute_metrics(logits, batch['label'])


def restore_checkpoint(state, workdir):
  return checkpoints.restore_checkpoint(workdir, state)


def save_checkpoint(state, workdir):
  state = hdet_jax.replicas_to_host(state)  # every replica [N, ...], not x[0]
  checkpoints.save_checkpoint(workdir, state, int(state.step[0]), keep=3)


cross_replica_mean = hdet_jax.pmap_average  # a non-finite replica sits out


def sync_batch_stats(state):
  variables = {'params': state.params, 'batch_stats': state.batch_stats}
  return state.replace(**cross_replica_mean(variables))  # to evaluate, not to train on


def train(workdir, steps=STEPS, seed=0):
  state = create_train_state(jax.random.key(seed))
  state = restore_checkpoint(state, workdir)
  step_offset = int(state.step[0])  # the steps the checkpoint holds: resume from there
  state = hdet_jax.replicas_to_devices(state)  # replica r on device r
  p_train_step = jax.pmap(train_step, axis_name='batch')
  p_eval_step = jax.pmap(eval_step, axis_name='batch')
  data, losses = batches(seed), []
  for _ in range(step_offset):  # skip the batches already trained on
    next(data)
  for step in range(step_offset, steps):
    state, metrics = p_train_step(state, shard(next(data)))
    losses.append(float(jax_utils.unreplicate(metrics)['loss']))  # the global batch's
    if (step + 1) % CKPT_EVERY == 0 or step + 1 == steps:
      save_checkpoint(state, workdir)
  eval_metrics = p_eval_step(sync_batch_stats(state), shard(next(batches(seed + 1000))))
  return state, losses, float(eval_metrics['loss'][0])


if __name__ == '__main__':
  import sys
  import tempfile
  jax.config.update('jax_num_cpu_devices', 8)
  steps = 20 if '--quick' in sys.argv else STEPS
  state, losses, eval_loss = train(tempfile.mkdtemp(), steps)
  print(f'train loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval loss {eval_loss:.3f}')
