"""Does the low-communication mode cost quality? Shared gradient against DiLoCo-like groups (issue 14).

    python -m research.lowcomm                  # 3 seeds x 3 modes on 4x2, 1500 steps each (17 min on 2 cores)
    python -m research.lowcomm --seeds 0        # one seed
    python -m research.lowcomm --report-only    # redraw results/lowcomm.{md,json} byte for byte from the records
    python -m research.lowcomm --import-workdirs DIR   # record the finished runs DIR/<mode>_seed<s>/, then redraw
    python -m research.lowcomm --quick          # a smoke run: the tiny config, 16 steps, one seed

Every run is the trainer's own ``train_and_evaluate`` on ``configs/default.py`` with 4 replica groups of 2
devices (``mesh.replicas=4``, ``mesh.fsdp=2``) and ``data.batch_size=16``, so every mode sees the default
8x1 job's 64 windows a step: the same compute and tokens. The modes:

* ``shared``: the gradient is all-reduced across groups every step (the paper);
* ``lowcomm``: ``hdet.low_communication``: each group steps on its own gradient between syncs;
* ``lowcomm_avg_opt``: the same, and each sync averages the optimizer state too.

A finished run is one JSON record, ``results/lowcomm/runs/<mode>_seed<s>.json`` (its summary's numbers, its config
and training fields, the machine; no checkpoint), committed with the project: a rerun skips the runs recorded with
the config it would train, and trains the others (a run cut short resumes from its workdir's checkpoint; the workdir
is deleted once the record is written). ``--import-workdirs DIR`` records runs trained elsewhere (or by this module
before it kept records) from their workdirs' ``summary.json`` and ``config.json``, after checking that each one is
the run this module trains for its mode and seed. The report (``results/lowcomm.md`` and ``.json``) is drawn from
every record there, whatever ``--seeds`` trained: validation bits/byte of the averaged model per mode and seed, the
seeds each mode holds, and each mode against the shared gradient on the seeds both hold. ``--quick`` keeps its
records and report under ``workdirs/lowcomm_quick`` (nothing under ``results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from research import records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEM = 'lowcomm'
MODES = {
  'shared': {},
  'lowcomm': {'hdet.low_communication': True},
  'lowcomm_avg_opt': {'hdet.low_communication': True, 'hdet.average_opt_state': True},
}
SEEDS = (0, 1, 2)
LAYOUT = {'mesh.replicas': 4, 'mesh.fsdp': 2, 'data.batch_size': 16}  # 4 x 16 = the default's 8 x 8 windows
# The main job's settings when this was measured (T=25, its controller then: fit_lr), pinned so the
# records stay the runs they describe.
MAIN_JOB_THEN = {
  'hdet.sync_every': 25,
  'hdet.trust': 0.25,
  'hdet.initial_scale': 1.0,
  'hdet.after_stop': 'hold',
  'hdet.step_growth': 1.0,
  'optim.max_lr': 3e-3,
}
# The summary's fields a record keeps (the rest are the workdir's paths and plots).
SUMMARY_FIELDS = (
  'step',
  'num_train_steps',
  'diverged_at',
  'final_train_loss',
  'final_val_loss',
  'final_val_bits_per_byte',
  'tokens_per_s',
  'setup_s',
  'wall_s',
  'num_replicas',
  'num_devices',
  'num_params',
)


def run_name(mode: str, seed: int) -> str:
  return f'{mode}_seed{seed}'


def run_config(mode: str, seed: int, quick: bool):
  """The config of ``mode``'s run at ``seed``: ``configs/default.py`` (``tiny.py`` for ``--quick``) on 4x2."""
  from hdet_jax.trainer import config_lib

  config = records.load_config(os.path.join(REPO, 'configs', 'tiny.py' if quick else 'default.py'))
  overrides = {
    **LAYOUT,
    **({} if quick else MAIN_JOB_THEN),
    **MODES[mode],
    'seed': seed,
    'plots': False,
    'progress_bar': False,
  }
  if quick:  # the tiny model's 4-window batch: 2 per device, and a run of two sync windows
    overrides.update({'data.batch_size': 4, 'num_train_steps': 16, 'hdet.warmup_steps': 4})
  return config_lib.with_overrides(config, overrides)


def run_key(config) -> dict:
  """The fields a record must match to stand for ``config``'s run: its training fields, resolved."""
  from hdet_jax.trainer import config_lib, run_settings, schema

  flat = run_settings.resolved(config_lib.flatten(json.loads(config.to_json())))
  return {k: v for k, v in flat.items() if schema.defines_a_run(k)}


def _recorded_key(rec: dict) -> dict:
  """:func:`run_key` of a record's config (a field added since reads at the value every run then had)."""
  from hdet_jax.trainer import compat, config_lib, run_settings

  return run_settings.resolved({**compat.QUIET_DEFAULTS, **config_lib.flatten(rec['config'])})


def record_from_workdir(mode: str, seed: int, workdir: str) -> dict:
  """The record of the finished run in ``workdir`` (its ``summary.json`` and ``config.json``); ValueError, one line,
  where it is unfinished or unreadable."""
  paths = {name: os.path.join(workdir, name + '.json') for name in ('summary', 'config')}
  read = {}
  for name, path in paths.items():
    try:
      with open(path, encoding='utf-8') as f:
        read[name] = json.load(f)
    except FileNotFoundError:
      raise ValueError(f'{path}: missing (the run has not finished)') from None
    except (OSError, ValueError) as e:
      raise ValueError(f'{path}: unreadable ({e})') from None
  summary, config = read['summary'], read['config']
  if summary.get('stopped_early') or summary.get('preempted'):
    raise ValueError(f'{paths["summary"]}: the run stopped at step {summary.get("step")} (rerun it to finish)')
  if not isinstance(config, dict) or 'config' not in config or 'training_fields' not in config:
    raise ValueError(f'{paths["config"]}: no config and training_fields (not a trainer workdir)')
  rec = {
    'name': run_name(mode, seed),
    'mode': mode,
    'seed': seed,
    'config': config['config'],
    'training_fields': config['training_fields'],
    **{k: summary.get(k) for k in SUMMARY_FIELDS},
    'machine': summary.get('machine'),
  }
  for k in ('final_train_loss', 'final_val_loss', 'final_val_bits_per_byte', 'tokens_per_s'):
    rec[k] = records.finite_or_none(rec[k])  # (summary.json writes a non-finite number as a string)
  return rec


def check_record(rec: dict, quick: bool) -> None:
  """ValueError (one line) unless ``rec`` is the run this module trains for its mode and seed."""
  from hdet_jax.trainer import schema

  want = run_key(run_config(rec['mode'], rec['seed'], quick))
  got = _recorded_key(rec)
  got = {k: got.get(k, '<absent>') for k in want}
  if got != want:
    raise ValueError(
      f'{rec["name"]}: not the run research.lowcomm trains for mode {rec["mode"]} seed {rec["seed"]} '
      f'({schema.differences(got, want)})'
    )


class Study:
  """The records of one invocation (``records_dir``) and the workdirs its runs train in (``work_root``)."""

  def __init__(self, records_dir: str, work_root: str, quick: bool):
    self.records_dir, self.work_root, self.quick = records_dir, work_root, quick

  def cache(self) -> records.RunCache:
    return records.RunCache(self.records_dir, self.work_root, self._make_record, _describe)

  def _make_record(self, name, config, summary, workdir, wall_s):
    del config, summary, wall_s  # (what the workdir holds: the same record as an imported run's)
    mode, seed = parse_name(name)
    return record_from_workdir(mode, seed, workdir)

  def run(self, mode: str, seed: int) -> dict:
    """The record of ``mode``'s run at ``seed``: the committed one, one made from a finished workdir, or trained."""
    name, config = run_name(mode, seed), run_config(mode, seed, self.quick)
    cache, key = self.cache(), run_key(config)
    rec = cache.get(name, key)
    if rec is None:
      try:  # a run that finished in its workdir before its record was written (or by this module before records)
        rec = record_from_workdir(mode, seed, cache.workdir(name))
        check_record(rec, self.quick)
        cache.write(name, rec)
        print(f'  {name}: recorded from its workdir: {_describe(rec)}', flush=True)
      except ValueError:
        rec = cache.run(name, config, key)
    return rec

  def import_workdirs(self, src: str) -> list[str]:
    """Records every finished run ``src/<mode>_seed<s>/`` (checked against its mode's config); the names written.
    A run recorded already is left as it is; an unfinished one is named and skipped."""
    if not os.path.isdir(src):
      raise ValueError(f'--import-workdirs: {src} is not a folder')
    cache, written = self.cache(), []
    for entry in sorted(os.listdir(src)):
      try:
        mode, seed = parse_name(entry)
      except ValueError:
        continue  # (lock files, other studies' workdirs)
      if cache.get(entry) is not None:
        print(f'  {entry}: recorded already; left as it is', flush=True)
        continue
      try:
        rec = record_from_workdir(mode, seed, os.path.join(src, entry))
      except ValueError as e:
        print(f'  {entry}: skipped: {e}', flush=True)
        continue
      check_record(rec, self.quick)
      cache.write(entry, rec)
      written.append(entry)
      print(f'  {entry}: {_describe(rec)}', flush=True)
    return written

  def all_records(self) -> dict[str, dict[int, dict]]:
    """Every record under ``records_dir``, by mode and seed (the modes in :data:`MODES`' order)."""
    found = {}
    if os.path.isdir(self.records_dir):
      for f in sorted(os.listdir(self.records_dir)):
        if f.endswith('.json'):
          with open(os.path.join(self.records_dir, f), encoding='utf-8') as fh:
            rec = json.load(fh)
          found.setdefault(rec['mode'], {})[rec['seed']] = rec
    return {m: dict(sorted(found[m].items())) for m in MODES if m in found}


def parse_name(name: str) -> tuple[str, int]:
  """(mode, seed) of a run name ``<mode>_seed<s>``; ValueError otherwise."""
  m = re.fullmatch(r'(\w+?)_seed(\d+)', name)
  if not m or m.group(1) not in MODES:
    raise ValueError(f'{name!r} is not a run name <mode>_seed<s> with a mode of {list(MODES)}')
  return m.group(1), int(m.group(2))


def _describe(rec: dict) -> str:
  bpb = rec['final_val_bits_per_byte']
  return f'val {"nan" if bpb is None else f"{bpb:.4f}"} bits/byte, {rec["wall_s"] / 60:.1f} min'


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def summarize(found: dict[str, dict[int, dict]]) -> dict:
  """The report's numbers from the records: per mode its seeds' bits/byte, their mean and run times, and each
  mode against ``shared`` on the seeds both hold (the gap of their means and its standard error)."""
  out = {'modes': {}, 'vs_shared': {}}
  for mode, by_seed in found.items():
    vals = [r['final_val_bits_per_byte'] for r in by_seed.values()]
    out['modes'][mode] = {
      'val_bits_per_byte': {str(s): r['final_val_bits_per_byte'] for s, r in by_seed.items()},
      'mean': records.mean_or_none(vals),
      'wall_s': {str(s): r['wall_s'] for s, r in by_seed.items()},
    }
  shared = found.get('shared', {})
  for mode, by_seed in found.items():
    common = [s for s in by_seed if s in shared]
    if mode == 'shared' or not common:
      continue
    gap, se = records.paired_gap(
      [by_seed[s]['final_val_bits_per_byte'] for s in common],
      [shared[s]['final_val_bits_per_byte'] for s in common],
    )
    out['vs_shared'][mode] = {'seeds': common, 'gap': gap, 'se': se}
  return out


def _bpb(x: float | None) -> str:
  return 'nan' if x is None else f'{x:.4f}'


def _seeds(seeds) -> str:
  return ', '.join(map(str, seeds))


def markdown(found: dict[str, dict[int, dict]], summary: dict, quick: bool) -> list[str]:
  """The page's lines."""
  first = next(iter(next(iter(found.values())).values()))
  c = first['config']
  seeds = sorted({s for by_seed in found.values() for s in by_seed})
  lines = ['# Low-communication mode against the shared gradient (4x2, same tokens)', '']
  if quick:
    lines += ['**`--quick` smoke run: the tiny config and 16 steps; these numbers mean nothing.**', '']
  lines += [
    f'`python -m research.lowcomm`: {c["mesh"]["replicas"]} replica groups of {c["mesh"]["fsdp"]} devices, '
    f'`configs/{"tiny" if quick else "default"}.py` otherwise (T = {c["hdet"]["sync_every"]}, '
    f'{c["num_train_steps"]} steps, the {c["hdet"]["controller"]} controller), `data.batch_size='
    f'{c["data"]["batch_size"]}` per group so every mode sees the same '
    f'{c["mesh"]["replicas"] * c["data"]["batch_size"]} windows a step. Validation bits/byte of the averaged model, '
    f'from the run records under `{"records/" if quick else "results/lowcomm/runs/"}`: `python -m research.lowcomm '
    f'{"--quick " if quick else ""}--report-only` redraws this page from them, and the command trains the runs they '
    'lack.',
    '',
    'Seeds recorded: '
    + '; '.join(f'{m} {_seeds(found[m])}' if m in found else f'{m} none' for m in MODES)
    + f' (of {_seeds(SEEDS)}).',
  ]
  names = {'lowcomm': 'Low-communication', 'lowcomm_avg_opt': 'with the optimizer state averaged at each sync'}
  gaps = [
    f'{names.get(m, m)}: {records.pct(g["gap"])} ({len(g["seeds"])} seed{"s" * (len(g["seeds"]) > 1)}: '
    f'{_seeds(g["seeds"])})'
    for m, g in summary['vs_shared'].items()
  ]
  if gaps:
    lines += ['', 'Against the shared gradient, on the seeds both hold: ' + '; '.join(gaps) + '.']
  lines += [
    '',
    '| mode | val bits/byte, mean | ' + ' | '.join(f'seed {s}' for s in seeds) + ' | run time, min (mean) |',
    '|---|---|' + '---|' * len(seeds) + '---|',
  ]
  for mode, by_seed in found.items():
    wall = [r['wall_s'] for r in by_seed.values()]
    lines.append(
      f'| {mode} | {_bpb(summary["modes"][mode]["mean"])} | '
      + ' | '.join(_bpb(by_seed[s]['final_val_bits_per_byte']) if s in by_seed else '' for s in seeds)
      + f' | {sum(wall) / len(wall) / 60:.1f} |'
    )
  return lines


def write_report(study: Study, out_dir: str) -> list[str]:
  """``out_dir/lowcomm.{md,json}`` from every record of ``study``; their paths."""
  found = study.all_records()
  if not found:
    raise ValueError(f'no records in {study.records_dir}')
  summary = summarize(found)
  return records.write_report(out_dir, STEM, summary, markdown(found, summary, study.quick))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', default=_seeds(SEEDS).replace(' ', ''), help='comma-separated seeds')
  parser.add_argument('--modes', default=','.join(MODES), help=f'comma-separated, of {", ".join(MODES)}')
  parser.add_argument('--quick', action='store_true', help='the tiny config, 16 steps, seed 0')
  parser.add_argument(
    '--work-root', default='', help='where the workdirs go (default: workdirs/lowcomm[_quick]; --quick: records too)'
  )
  parser.add_argument('--report-only', action='store_true', help='redraw the report from the records, train nothing')
  parser.add_argument(
    '--import-workdirs', default='', metavar='DIR', help='record the finished runs DIR/<mode>_seed<s>/, then redraw'
  )
  parser.add_argument('--out', default=None, help="the report's folder (default: results/; --quick: the work root)")
  args = parser.parse_args(argv)
  modes = [m for m in args.modes.split(',') if m]
  if set(modes) - set(MODES):
    parser.error(f'--modes: {sorted(set(modes) - set(MODES))} not among {list(MODES)}')
  try:
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(',') if s]
  except ValueError:
    parser.error(f'--seeds: {args.seeds!r} is not a comma-separated list of integers')
  root = args.work_root or os.path.join(REPO, 'workdirs', 'lowcomm_quick' if args.quick else 'lowcomm')
  records_dir = os.path.join(root, 'records') if args.quick else os.path.join(REPO, 'results', 'lowcomm', 'runs')
  out_dir = args.out or (root if args.quick else os.path.join(REPO, 'results'))
  study = Study(records_dir, root, args.quick)
  shown = 'results/lowcomm/runs/' if not args.quick else records_dir
  if args.report_only or args.import_workdirs:
    if args.import_workdirs:
      try:
        study.import_workdirs(args.import_workdirs)
      except ValueError as e:
        sys.exit(f'error: {e}')
    if not study.all_records():
      sys.exit(
        f'error: --report-only: no records in {shown}: results/lowcomm.md is not regenerable until its runs are '
        'recorded (research/README.md); python -m research.lowcomm trains them.'
        if not args.quick
        else f'error: --report-only: no records in {shown}.'
      )
    print('\n'.join(f'  {p}' for p in write_report(study, out_dir)))
    return {m: {s: r['final_val_bits_per_byte'] for s, r in by.items()} for m, by in study.all_records().items()}

  from hdet_jax import trainer
  from hdet_jax.trainer import config_lib

  # Before any JAX call: 8 simulated CPU devices (the config's num_cpu_devices), and the compilation
  # cache of the full runs (tiny.py, for --quick, turns it off: a smoke run leaves nothing behind).
  name = 'tiny.py' if args.quick else 'default.py'
  trainer.setup_jax(config_lib.load_config_file(os.path.join(REPO, 'configs', name)))
  results = {m: {s: study.run(m, s)['final_val_bits_per_byte'] for s in seeds} for m in modes}
  print('\n'.join(f'  {p}' for p in write_report(study, out_dir)))
  return results


if __name__ == '__main__':
  main()
