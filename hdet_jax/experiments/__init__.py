"""Experiments built on the trainer's building blocks (``python -m hdet_jax.experiments.table1``)."""
