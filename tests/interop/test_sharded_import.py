"""load_pretrained(mesh=...) places every variable in its sharding (8 fake CPU devices)."""

import os
import pathlib
import subprocess
import sys

from tests._xla_flags import with_devices
from tests.interop.hf_testlib import KIMI_LINEAR

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_into_a_mesh():
  env = dict(os.environ, XLA_FLAGS=with_devices(8),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  p = subprocess.run([sys.executable, str(ROOT / "tests/interop/scripts/sharded_import.py"),
                      str(KIMI_LINEAR)], env=env, cwd=ROOT,
                     capture_output=True, text=True, timeout=900)
  print(p.stdout[-2000:])
  assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-4000:]
