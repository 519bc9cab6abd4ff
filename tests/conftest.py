"""8 simulated CPU devices, set before JAX starts (the device count cannot change later)."""

import os

os.environ['JAX_NUM_CPU_DEVICES'] = '8'
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)
