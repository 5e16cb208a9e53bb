"""XLA_FLAGS for the tests' subprocesses: a fake device count plus the suite's own flags.

tests/conftest.py puts the suite's flags (on a CPU host: the backend optimization level, see
there) in SPARSE_LM_TEST_XLA_FLAGS; a script run outside pytest gets only the device count.
"""
import os


def with_devices(devices: int = 8) -> str:
  """The XLA_FLAGS value for a subprocess with `devices` fake CPU devices."""
  extra = os.environ.get("SPARSE_LM_TEST_XLA_FLAGS", "")
  return f"--xla_force_host_platform_device_count={devices} {extra}".strip()
