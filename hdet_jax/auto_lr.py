"""The auto-LR controller's settings, :class:`AutoLR`, and their checks (``hdet``'s, and the trainer's for its config).

``AutoLR(total_steps=S)`` is the guarded climb (the 'fit' controller, the measured default);
:meth:`AutoLR.paper` the paper's eqs. 4-9.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from hdet_jax import arguments
from hdet_jax import controller as ctrl


@dataclasses.dataclass(frozen=True)
class AutoLR:
  """Settings of the auto-LR controller. ``AutoLR(total_steps=S)`` is the measured default, the *guarded climb*.

  The guarded climb (``controller='fit'`` at these defaults; ``python train.py``'s controller) is a line
  search along the replicas' line (:func:`hdet_jax.controller.fit_update`) that scales the user's schedule
  by a learned factor, keeping its shape:

  * it starts at a tenth of the learning rate you pass (``initial_scale=0.1``): a factory's schedule and a
    built optimizer's own learning rate alike. Pass the highest learning rate you would consider: a guess up
    to 10x too high is where the climb ends up starting near the best, while a climb started too high is never
    corrected (:doc:`/results/start_rule`);
  * it only rises (``after_stop='rise'`` from ``stop_steps=0``), each step at most ``trust`` in log units
    (x2.7), amplified while the fitted steps keep one direction (``step_growth``, up to ``max_gain``);
  * with ``anneal_fraction=0.5`` (off by default: measured, it cost where it bound) it keeps the schedule's
    anneal: once the learning-rate schedule has fallen below that fraction of its peak, the factor no longer
    rises (it may still fall), so ``lr_t / schedule(t)`` is non-increasing over the rest of the decay
    (:func:`hdet_jax.sync.anneal`). A factory's schedule is read at build; around an optimizer you built pass its
    schedule as ``schedule=``, else a cosine decay from ``warmup_steps`` to ``total_steps`` is assumed (no rise in
    the run's second half);
  * it is guarded: a window whose mean training loss rose by more than ``backoff_stderrs`` standard errors
    and ``backoff_fraction`` of the loss steps the LR back down (``backoff``; the trainer also rolls the
    replicas back to the sync before);
  * it settles: once the climb has ended (two confident asks down in a row) the replicas stop spreading
    and the rest of the run trains at the base LR (``settle``).

  Against an 8-run LR sweep, one run lands close to the sweep's best on text at the default length, further
  off on short runs, from a 10x too-low start and on small classifiers: :doc:`/verdict` has the numbers, from
  the committed records.

  The paper's controller (eqs. 4-9) is one call away: :meth:`AutoLR.paper`.

  Attributes:
    total_steps: S, the length of the run: a sync on or after step S still averages, but the controller holds
      (no step trains at what it would set; :func:`hdet_jax.sync.hold_after_last_step`).
    controller: ``'fit'`` (the line search; the fields up to ``settle``) or ``'paper'`` (eqs. 4-9; the
      fields from ``temperature`` on). Build the paper's with :meth:`AutoLR.paper`.
    warmup_steps: S_warm; the controller updates at the first sync at or after this step.
    initial_scale: 'fit': the learning rates' correction starts at this factor; None (the default): 0.1, a
      tenth of the learning rate you pass, whether the optimizer is a factory or built. (< 1: a cautious start
      the line search has to raise; 1: start at the schedule). Other hyperparameters start uncorrected.
    trust: 'fit': the largest change of the log-correction per sync (additive values move at most their
      spread per sync).
    memory: 'fit': forgetting factor in [0, 1) of the regression's statistics across syncs.
    step_growth: 'fit': eta >= 1; while consecutive fitted steps agree in sign, each taken step is the
      fitted one times a gain that grows by this factor per sync (Rprop; see
      :func:`hdet_jax.controller.accelerate`); a reversal resets it to 1. 1: the plain fit.
    max_gain: 'fit': the largest gain, >= 1 (each step stays within ``trust``).
    stop_steps: the controller makes no update at syncs after this step, except what ``after_stop``
      allows; None: it runs to the end.
    after_stop: 'fit': at syncs after ``stop_steps``, ``'hold'`` (no update) or ``'rise'`` (only steps that
      raise a value are taken).
    backoff: 'fit': at a sync where the replicas' mean training loss over the window rose past the margins
      below (or is not finite), the learning rates' correction steps down by ``trust``, whatever the fit
      asked and whatever ``after_stop`` allows, and the gain resets.
    backoff_stderrs: 'fit' with ``backoff``: only a rise of more than ``k sqrt(2) se`` counts, se the
      standard error of the window before's mean loss from its step-to-step changes. 0: any rise.
    backoff_fraction: 'fit' with ``backoff``: only a rise of more than this fraction of the window before's
      loss counts too (with ``backoff_stderrs``, the larger margin). 0: off.
    settle: 'fit' with ``after_stop='rise'``: a hyperparameter whose climb has ended (the second confident
      ask down in a row once it has risen above its start) stops spreading and its correction holds.
    temperature: 'paper': sigma of the softmax over window losses (eq. 4), in loss units.
    lr_of_lr: 'paper': lambda, the step size of the base update (eq. 7).
    momentum: 'paper': beta, the velocity's momentum (eq. 7), in [0, 1).
    decay: 'paper': gamma override. None decays the base geometrically to the schedule's value at step
      S - 1; ``hdet_jax.controller.reference_decay(div, final_div, K)`` reproduces the reference.
    min_value: 'paper': floor on every base value (None: a tenth of the schedule's final value).
    smooth_decay: 'paper': within a window the base decays continuously (False holds it between syncs, as
      the reference does).
    anneal_fraction: 'fit': from the first sync at or after the step the learning-rate schedule falls below this
      fraction of its peak (:func:`hdet_jax.schedules.anneal_start`), the learning rates' factor takes no step up.
      Late in a decaying schedule a larger factor always looks better over one window, and a climb left to run
      there cancels the decay. In [0, 1); 0: off (the climb may rise to the end).
    schedule: 'fit' around a built optimizer: its learning-rate schedule (the function of the step it was built
      with), for ``anneal_fraction`` to find its decay. None: a cosine decay from ``warmup_steps`` to
      ``total_steps`` is assumed (the rule then applies from halfway at the default). A factory's schedule is
      ``hdet``'s ``learning_rate``: giving one here too is refused.

  Example:
    >>> import hdet_jax
    >>> auto_lr = hdet_jax.AutoLR(total_steps=1500)  # the guarded climb
    >>> auto_lr.controller, auto_lr.trust
    ('fit', 1.0)
    >>> paper = hdet_jax.AutoLR.paper(total_steps=1500, warmup_steps=750)  # eqs. 4-9
    >>> paper.controller, paper.temperature
    ('paper', 0.1)
  """

  total_steps: int
  controller: str = 'fit'
  warmup_steps: int = 0
  initial_scale: float | None = None
  trust: float = 1.0
  memory: float = 0.5
  step_growth: float = 2.0
  max_gain: float = 4.0
  stop_steps: int | None = 0
  after_stop: str = 'rise'
  backoff: bool = True
  backoff_stderrs: float = 2.0
  backoff_fraction: float = 0.05
  settle: bool = True
  temperature: float = 0.1
  lr_of_lr: float = 0.5
  momentum: float = 0.9
  decay: float | None = None
  min_value: float | None = None
  smooth_decay: bool = True
  anneal_fraction: float = 0.0  # off: measured, keeping the anneal cost where it bound (docs/how_it_works.md)
  schedule: Callable[[Any], Any] | None = None

  @classmethod
  def paper(
    cls,
    total_steps: int,
    *,
    warmup_steps: int = 0,
    temperature: float = 0.1,
    lr_of_lr: float = 0.5,
    momentum: float = 0.9,
    decay: float | None = None,
    min_value: float | None = None,
    smooth_decay: bool = True,
    stop_steps: int | None = None,
  ) -> 'AutoLR':
    """The paper's controller (eqs. 4-9): a softmax over the replicas' window losses weights their
    values, the base moves additively toward the better ones and decays geometrically, replacing the
    schedule once the controller starts.

    Example:
      >>> import hdet_jax
      >>> hdet_jax.AutoLR.paper(total_steps=1500, warmup_steps=750, temperature=0.1).controller
      'paper'
    """
    return cls(
      total_steps=total_steps,
      controller='paper',
      warmup_steps=warmup_steps,
      stop_steps=stop_steps,
      temperature=temperature,
      lr_of_lr=lr_of_lr,
      momentum=momentum,
      decay=decay,
      min_value=min_value,
      smooth_decay=smooth_decay,
      **_FIT_OFF,
    )


# AutoLR.initial_scale=None: the climb starts at a tenth of the LR it is given, a factory's schedule or a built
# optimizer's own LR alike. The climb only rises (a stable too-high LR is never lowered), so the start is low.
DEFAULT_INITIAL_SCALE = 0.1

# The 'fit' fields at the values that leave a controller without them: what AutoLR.paper sets.
_FIT_OFF = dict(
  initial_scale=1.0,
  step_growth=1.0,
  after_stop='hold',
  backoff=False,
  backoff_stderrs=0.0,
  backoff_fraction=0.0,
  settle=False,
  anneal_fraction=0.0,
  schedule=None,
)


def check_auto_lr(auto_lr: 'AutoLR', spread: float) -> None:
  """The controller's settings checked as ``hdet()`` checks them: raises ValueError, one line naming the field as
  ``auto_lr.<field>`` (its range, and the rules across fields), or returns None. For callers that hold these
  settings under other names (the trainer's config) and check them before any work.

  Example:
    >>> from hdet_jax import auto_lr
    >>> auto_lr.check_auto_lr(auto_lr.AutoLR(total_steps=100, trust=0.5), spread=0.25)
    >>> auto_lr.check_auto_lr(auto_lr.AutoLR(total_steps=100, trust=-1.0), spread=0.25)
    Traceback (most recent call last):
    ...
    ValueError: auto_lr.trust must be > 0 (the largest log-step per sync), got -1.0.
  """
  a = auto_lr
  if not isinstance(a, AutoLR):
    raise ValueError(f'auto_lr must be an hdet_jax.AutoLR or None, got {type(a).__name__}.')
  if not arguments.is_int(a.total_steps) or a.total_steps < 2:
    raise ValueError(f'auto_lr.total_steps must be an integer >= 2, got {a.total_steps!r}.')
  if not arguments.is_int(a.warmup_steps) or not 0 <= a.warmup_steps < a.total_steps:
    raise ValueError(f'auto_lr.warmup_steps must be in [0, total_steps={a.total_steps}), got {a.warmup_steps!r}.')
  if not a.temperature > 0:
    raise ValueError(f'auto_lr.temperature (sigma) must be > 0, got {a.temperature!r}.')
  if not 0.0 <= a.momentum < 1.0:
    raise ValueError(f'auto_lr.momentum (beta) must be in [0, 1), got {a.momentum!r}.')
  if not a.lr_of_lr >= 0:
    raise ValueError(f'auto_lr.lr_of_lr (lambda) must be >= 0, got {a.lr_of_lr!r}.')
  if a.controller not in ctrl.VARIANTS:
    raise ValueError(f'auto_lr.controller must be one of {ctrl.VARIANTS}, got {a.controller!r}.')
  if ctrl.is_paper(a):
    unset = lambda k: k == 'initial_scale' and a.initial_scale is None  # None: each mode's default
    fit_set = [f'{k}={getattr(a, k)!r}' for k, v in _FIT_OFF.items() if getattr(a, k) != v and not unset(k)]
    if fit_set:
      raise ValueError(
        f"auto_lr: controller='paper' takes none of the 'fit' settings, got {', '.join(fit_set)}; "
        f'build it with hdet_jax.AutoLR.paper(total_steps=..., ...).'
      )
  if not (isinstance(a.trust, (int, float)) and 0.0 < a.trust < math.inf):
    raise ValueError(f'auto_lr.trust must be > 0 (the largest log-step per sync), got {a.trust!r}.')
  if not (isinstance(a.memory, (int, float)) and 0.0 <= a.memory < 1.0):
    raise ValueError(f'auto_lr.memory must be in [0, 1), got {a.memory!r}.')
  if a.stop_steps is not None and (not arguments.is_int(a.stop_steps) or a.stop_steps < 0):
    raise ValueError(f'auto_lr.stop_steps must be None or an integer >= 0, got {a.stop_steps!r}.')
  scale = a.initial_scale
  if scale is not None and not (isinstance(scale, (int, float)) and 0.0 < scale < math.inf):
    raise ValueError(f'auto_lr.initial_scale must be None or a number > 0 (1: start at the schedule), got {scale!r}.')
  if a.after_stop not in ('hold', 'rise'):
    raise ValueError(f"auto_lr.after_stop must be 'hold' or, with controller='fit', 'rise'; got {a.after_stop!r}.")
  for name in ('step_growth', 'max_gain'):
    v = getattr(a, name)
    if not (isinstance(v, (int, float)) and 1.0 <= v < math.inf):
      raise ValueError(f'auto_lr.{name} must be a number >= 1 (1: no acceleration), got {v!r}.')
  if not isinstance(a.backoff, bool):
    raise ValueError(f'auto_lr.backoff must be a bool, got {a.backoff!r}.')
  k = a.backoff_stderrs
  if not (isinstance(k, (int, float)) and not isinstance(k, bool) and 0.0 <= k < math.inf) or (k > 0 and not a.backoff):
    raise ValueError(f'auto_lr.backoff_stderrs must be a number >= 0, and > 0 only with backoff=True; got {k!r}.')
  f = a.backoff_fraction
  if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f < 1.0) or (f > 0 and not a.backoff):
    raise ValueError(f'auto_lr.backoff_fraction must be a number in [0, 1), and > 0 only with backoff=True; got {f!r}.')
  if not isinstance(a.settle, bool) or (a.settle and a.after_stop != 'rise'):
    raise ValueError(
      f"auto_lr.settle must be a bool, and True only with controller='fit' and after_stop='rise' "
      f'(it ends a rise-only climb); got settle={a.settle!r}, controller={a.controller!r}, '
      f'after_stop={a.after_stop!r}.'
    )
  f = a.anneal_fraction
  if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f < 1.0):
    raise ValueError(
      f"auto_lr.anneal_fraction must be a number in [0, 1) (the schedule's fraction of its peak below which the "
      f'factor no longer rises; 0: off), got {f!r}.'
    )
  if a.schedule is not None and not callable(a.schedule):
    raise ValueError(
      f"auto_lr.schedule must be None or the built optimizer's learning-rate schedule (a function of the step), "
      f'got {a.schedule!r}.'
    )
  if spread == 0.0:
    raise ValueError(
      'auto_lr needs spread > 0: with spread=0 every replica trains at the same LR and the '
      'controller gets no signal. Set spread (e.g. 0.25) or auto_lr=None.'
    )
