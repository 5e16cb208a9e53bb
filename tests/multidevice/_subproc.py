"""Run a multi-device check script in a fresh interpreter with 8 fake CPU devices.

pytest's process has already imported jax (conftest), so XLA_FLAGS cannot take effect there.
"""
import os
import pathlib
import subprocess
import sys

from tests._xla_flags import with_devices

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"


def run_script(name: str, *args: str, devices: int = 8, timeout: int = 600) -> str:
  env = dict(os.environ)
  env["XLA_FLAGS"] = with_devices(devices)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"{name} {args} failed (rc={proc.returncode}):\n{out[-6000:]}"
  return proc.stdout
