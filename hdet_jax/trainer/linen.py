"""flax linen models under a mesh: :func:`dense_general_ok`, now :func:`hdet_jax.dense_general_ok`.

It lives in the core (:mod:`hdet_jax.flax_utils`), which needs flax but not the trainer extra (orbax,
ml_collections, absl); this name stays as an alias of it.
"""

from hdet_jax.flax_utils import dense_general_ok

__all__ = ['dense_general_ok']
