"""Test-wide settings: CPU platform (libtpu is installed for AOT compiles, not as a backend),
two pytest-xdist workers for a run over directories, and the opt-in `slow` tier.

`python -m pytest -q tests` (the README/CI command) runs the files on two worker processes,
each file whole on one worker (`--dist=loadfile` in pytest.ini, so module fixtures are built
once). A run that names only files or test ids runs in this process. `-n 0` or `-p no:xdist`
forces one process; `PYTEST_XDIST_AUTO_NUM_WORKERS=N` sets the worker count.
Tests marked `@pytest.mark.slow` run only with `--runslow`; each has a smaller version of its
check in the default suite.
"""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

# On a GPU (JAX_PLATFORMS=cuda, ...) the tests keep their CPU meaning, written down once here:
# fp32 matmuls at full precision (the GPU default is TF32, about 3e-4 relative: the tests
# compare with fp64 / NumPy references at the fp32 tolerances of ARCHITECTURE.md), and
# deterministic reductions (the bit-for-bit tests: causality, packing, resume). Speed is
# measured in benchmarks/, never here. Tests that only mean something on a CPU host skip
# elsewhere and say so.
ON_GPU = any(p in os.environ["JAX_PLATFORMS"] for p in ("cuda", "gpu", "rocm"))
if ON_GPU:
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_deterministic_ops=true").strip()

DEFAULT_WORKERS = 2  # CI's cores; each worker peaks at ~3 GB of host memory


def pytest_addoption(parser, pluginmanager):
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run the tests marked slow (full-size compiles, long curves)")
  if not pluginmanager.has_plugin("xdist"):
    # pytest.ini passes xdist's options; without the plugin (-p no:xdist, or not installed)
    # they are accepted and ignored, and the tests run in this process.
    group = parser.getgroup("xdist (not loaded: options ignored)")
    group.addoption("--numprocesses", dest="numprocesses", default=None)
    group.addoption("--dist", dest="dist", default="no")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is not loaded
def pytest_xdist_auto_num_workers(config):
  """Workers for `--numprocesses=auto`: 0 (run in this process) when every argument is a file
  or a test id, else DEFAULT_WORKERS; the environment variable PYTEST_XDIST_AUTO_NUM_WORKERS
  overrides both."""
  env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
  if env:
    return int(env)
  paths = [a.split("::")[0] for a in config.args] or ["."]
  if not any(os.path.isdir(p) for p in paths):
    return 0
  return min(DEFAULT_WORKERS, os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow tier: run with --runslow")
  for item in items:
    if item.get_closest_marker("slow"):
      item.add_marker(skip)
