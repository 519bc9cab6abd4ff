"""8 simulated CPU devices, set before JAX starts (the device count cannot change later)."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# JAX_NUM_CPU_DEVICES, if the caller's environment has it, would win over the XLA flag set below.
os.environ.pop('JAX_NUM_CPU_DEVICES', None)

import chex  # noqa: E402

# --xla_force_host_platform_device_count=8 in XLA_FLAGS (replacing any count already there); train.py run
# as a subprocess inherits it. chex raises if JAX's CPU backend already started with another count.
chex.set_n_cpu_devices(8)
