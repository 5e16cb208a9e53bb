"""1-device checkpoint -> 8-device mesh -> 1 device, equal loss (subprocess with 8 CPU
devices, see multidevice_restore.py); a layout that does not divide the heads is refused."""

import os
import pathlib
import subprocess
import sys

from tests._xla_flags import with_devices


def test_checkpoint_restores_across_device_layouts(workdir):
  script = pathlib.Path(__file__).with_name("multidevice_restore.py")
  env = dict(os.environ, XLA_FLAGS=with_devices(8))
  proc = subprocess.run([sys.executable, str(script), str(workdir)], capture_output=True,
                        text=True, env=env, timeout=900)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-4000:]
  assert "OK" in proc.stdout
  assert "kda_num_heads=3 is not divisible by tensor=4" in out, out[-3000:]
