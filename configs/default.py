"""python train.py --config configs/default.py --workdir workdirs/default

The main job: HDET from scratch on a small byte-level transformer and the King James Bible, 8 replicas (8
simulated CPU devices on a CPU-only machine; all 8 on one GPU). A few minutes on a 2-core CPU.

Its controller is the guarded climb, ``hdet_jax.AutoLR(total_steps=S)``: it starts at a tenth of the schedule
and only raises the LR (so give optim.max_lr as the high end of your guess), undoes a window whose loss blew up,
and stops spreading the replicas once the climb has ended. How it measures against an LR sweep: docs/verdict.md.
The paper's controller (eqs. 4-9, at the paper's values) is --config.hdet.controller=paper
--config.hdet.param_groups=True --config.hdet.sync_every=25 --config.optim.max_lr=3e-3.

Every field can be overridden from the command line, e.g. ``--config.hdet.spread=0.2``. What research varies beyond
these (the controllers' tuning, e.g. the climb's trust) it gives in Python: ``train_and_evaluate(config, workdir,
tuning={'hdet.trust': 0.5})`` (docs/trainer.md).
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.task = 'lm'  # The workload (docs/tasks.md): 'lm' (this file) or 'mnist1d' (configs/mnist1d.py).
  config.seed = 0  # Seeds everything random: model init, data order, permutations, warm-init noise.
  config.num_train_steps = 1500  # S: total optimizer steps; the schedule and the controller span them.
  config.init_from = config_dict.placeholder(str)  # A workdir to warm-start from (eq. 10); None: random init.

  config.data = ml_collections.ConfigDict()
  config.data.path = config_dict.placeholder(str)  # A local UTF-8 text file; None: the built-in data.corpus.
  config.data.corpus = 'kjv'  # Without data.path: 'kjv' (King James Bible) or 'wyc' (Wycliffe Bible).
  config.data.val_fraction = 0.05  # The corpus's last fraction of bytes is held out for validation.
  config.data.seq_len = 64  # Bytes of context per training window.
  config.data.batch_size = 8  # Windows per replica per step (the global batch is num_replicas times this).

  config.model = ml_collections.ConfigDict()
  config.model.d_model = 64  # Width of the residual stream (and of the byte embedding).
  config.model.num_layers = 2  # Transformer blocks.
  config.model.num_heads = 4  # Attention heads per block (must divide d_model).
  config.model.mlp_ratio = 4  # MLP hidden width as a multiple of d_model.
  config.model.dropout = 0.0  # Dropout rate on attention and MLP outputs (the base value if explored).
  config.model.attn_temperature = 1.0  # Attention logits are divided by this (the base value if explored).

  config.optim = ml_collections.ConfigDict()
  config.optim.name = 'adamw'  # The optax optimizer HDET wraps: 'adamw', 'adam' or 'sgd' (b1 = momentum).
  config.optim.max_lr = 3e-2  # Peak of the schedule; the guarded climb starts at a tenth of it and rises.
  config.optim.schedule = 'one_cycle'  # 'one_cycle' (torch's OneCycleLR), 'warmup_cosine' or 'constant'.
  config.optim.pct_start = 0.3  # Fraction of the steps spent warming the LR up to max_lr.
  config.optim.div_factor = 25.0  # The schedule starts at max_lr / div_factor ...
  config.optim.final_div_factor = 10.0  # ... and ends at max_lr / (div_factor * final_div_factor).
  config.optim.b1 = 0.9  # Adam's beta1 (SGD's momentum).
  config.optim.b2 = 0.95  # Adam's beta2.
  config.optim.weight_decay = 0.1  # AdamW's decoupled weight decay, on matrices only (not biases or norms).
  config.optim.grad_clip_norm = 0.0  # Clip the all-reduced gradient to this global norm (0: no clipping).
  config.optim.label_smoothing = 0.0  # Label smoothing of the training loss (the base value if explored).

  config.hdet = ml_collections.ConfigDict()
  config.hdet.num_replicas = 8  # N replicas on however many devices (N a multiple of them); 0: one per device.
  config.hdet.spread = 0.25  # alpha of eq. 1: LRs span base * [1 - alpha, 1 + alpha]; 0: plain data parallel.
  config.hdet.sync_every = 0  # T: average the replicas every T steps; 0: T from num_syncs.
  config.hdet.num_syncs = 15  # With sync_every 0: T = round(num_train_steps / num_syncs), at most 100; both 0: never.
  config.hdet.auto_lr = True  # The controller moves the base LR at each sync.
  config.hdet.controller = 'fit'  # 'fit' (the guarded climb, a line search) or 'paper' (eqs. 4-9).
  config.hdet.initial_scale = 0.1  # 'fit': start at this multiple of the schedule (< 1: a cautious start).
  config.hdet.rollback = config_dict.placeholder(bool)  # Undo a window whose loss blew up (None: where 'fit' guards).
  config.hdet.param_groups = False  # Per-group LRs (embedding, no_decay, weights), each with its own controller.
  config.hdet.explore = ml_collections.ConfigDict()  # More hyperparameters spread across replicas; 0: off.
  config.hdet.explore.weight_decay = 0.0  # Multiplicative spread of AdamW's weight decay, in [0, 1).
  config.hdet.explore.dropout = 0.0  # Additive half-width of the dropout rate (clipped to [0, 0.9]).
  config.hdet.explore.label_smoothing = 0.0  # Additive half-width of label smoothing (clipped to [0, 0.5]).
  config.hdet.explore.attn_temperature = 0.0  # Multiplicative spread of the attention temperature, in [0, 1).
  config.hdet.low_communication = False  # Replicas step on their own gradients; the sync is their only all-reduce.
  config.hdet.average_opt_state = False  # Low-communication mode: a sync also averages the optimizer state.

  config.mesh = ml_collections.ConfigDict()  # Replica groups: each replica sharded over fsdp x tensor devices.
  config.mesh.replicas = 0  # N replica groups on a grouped mesh (0: devices / (fsdp x tensor)).
  config.mesh.fsdp = 1  # Devices per group sharding it FSDP-style (data.batch_size must divide by it).
  config.mesh.tensor = 1  # Devices per group splitting its kernels (tensor parallel).
  config.mesh.devices = 0  # Train on the first D devices (1-D meshes); 0: as many as N needs.

  config.bracket = ml_collections.ConfigDict()  # An LR bracket instead of one run (configs/bracket.py).
  config.bracket.points = 0  # Plain runs at peak LRs max_lr * factor ** (k - (points - 1) / 2); 0: off.
  config.bracket.factor = 2.0  # The ratio of neighbouring points' peak LRs.
  config.bracket.rungs = '0.1:5,0.3:1'  # 'fraction:kept,...': at each fraction the best `kept` runs go on.

  config.warm_init = ml_collections.ConfigDict()
  config.warm_init.nu = 0.01  # nu of eq. 10: noise std is nu * ||theta_0|| / sqrt(d) (with init_from).

  config.log_every = 25  # Steps between metric flushes (JSONL, progress bar); also the NaN check interval.
  config.chunk_steps = 25  # Steps whose batches go to the devices in one transfer (fewer: less device memory).
  config.eval_every = 250  # Steps between validations of the averaged model (and one at the end); 0: at the end.
  config.eval_windows = 512  # Validation windows per evaluation (0: the whole validation split).
  config.checkpoint_every = 500  # Steps between checkpoints (and one at the end); 0: only at the end.
  config.max_checkpoints = 2  # Checkpoints kept in WORKDIR/checkpoints (0: all).
  config.stop_on_nan = True  # Stop once every replica's loss is NaN/inf (False: record it, keep going).
  config.plots = True  # Draw the PNG plots into WORKDIR/plots at the end.
  config.tensorboard = True  # TensorBoard event files beside metrics.jsonl in the workdir.
  config.progress_bar = True  # Show the tqdm progress bar.
  config.num_cpu_devices = 8  # Simulated CPU devices on a CPU-only machine (JAX_NUM_CPU_DEVICES wins).
  config.deterministic_gpu = True  # XLA's deterministic GPU ops: the same config and seed, the same numbers.
  config.compilation_cache = '~/.cache/hdet_jax/xla'  # JAX's persistent compilation cache ('': off).
  return config
