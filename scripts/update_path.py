"""Prints the hdet_jax modules whose functions run while ``tx.update`` traces (issue 83's "modules update passes
through"), for a factory with the default controller, the paper controller and a built optimizer with rollback:
5 each, transform, multipliers, controller, sync and axes (tests/test_transform.py pins them).

    python scripts/update_path.py
"""

import sys

import jax
import jax.numpy as jnp
import optax

import hdet_jax


def modules_in_update(tx, n: int = 4) -> list[str]:
  """The hdet_jax modules with a function called while tracing ``tx.update`` under ``jax.vmap``."""
  params = hdet_jax.stack_replicas({'w': jnp.ones(3)}, n)
  state = jax.vmap(tx.init)(params)
  seen = set()

  def profile(frame, event, arg):
    del arg
    if event == 'call':
      name = frame.f_globals.get('__name__', '')
      if name.startswith('hdet_jax'):
        seen.add(name)

  def step(p, s):
    return tx.update(jax.tree.map(jnp.ones_like, p), s, p, value=jnp.sum(p['w']))

  traced = jax.vmap(step, axis_name='data')
  sys.setprofile(profile)
  try:
    jax.make_jaxpr(traced)(params, state)
  finally:
    sys.setprofile(None)
  return sorted(seen)


def main() -> None:
  cases = {
    'factory, AutoLR(total_steps=S)': hdet_jax.hdet(
      optax.adamw, 1e-2, num_replicas=4, auto_lr=hdet_jax.AutoLR(total_steps=100)
    ),
    'factory, AutoLR.paper': hdet_jax.hdet(
      optax.adamw, 1e-2, num_replicas=4, auto_lr=hdet_jax.AutoLR.paper(total_steps=100)
    ),
    'built, rollback': hdet_jax.hdet(
      optax.adamw(1e-2), num_replicas=4, auto_lr=hdet_jax.AutoLR(total_steps=100), rollback=True
    ),
  }
  union = set()
  for name, tx in cases.items():
    mods = modules_in_update(tx)
    union.update(mods)
    print(f'{name}: {len(mods)} modules: {", ".join(m.removeprefix("hdet_jax.") for m in mods)}')
  print(f'all cases: {len(union)} modules')


if __name__ == '__main__':
  main()
