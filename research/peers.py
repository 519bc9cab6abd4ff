"""The LR-free peers the studies compare HDET against (``research.autolr``'s ``PEER_SETTINGS``), as the trainer
takes them. Apart from ``autolr`` so that ``records`` (which gives them to the trainer) does not import a study:
``autolr`` imports ``records``, never the reverse."""


def baselines() -> dict:
  """The peers as the trainer takes them: each an ``optimizer.Base`` given in Python (the product's ``optim.name``
  names only its own optimizers), at the LR its documentation sets; the peers' configs and records name them by
  ``optim.name`` as before (``records.trainer_arguments``)."""
  import optax
  from hdet_jax.trainer.optimizer import Base

  contrib = optax.contrib
  return {
    'prodigy': Base('prodigy', contrib.prodigy),
    'dog': Base('dog', contrib.dog),
    'dadapt_adamw': Base('dadapt_adamw', contrib.dadapt_adamw),
    'mechanize_adam': Base('mechanize_adam', lambda learning_rate: contrib.mechanize(optax.adam(learning_rate))),
    'schedule_free_adamw': Base('schedule_free_adamw', contrib.schedule_free_adamw, schedule_free=True),
    'adam_plateau': Base(
      'adam_plateau',
      lambda learning_rate: optax.chain(optax.adam(learning_rate), contrib.reduce_on_plateau()),
      plateau=True,
    ),
  }
