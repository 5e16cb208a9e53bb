"""Test-wide settings: CPU platform (libtpu is installed for AOT compiles, not as a backend),
two pytest-xdist workers for a run over directories, and the opt-in `slow` tier.

`python -m pytest -q tests` (the README/CI command) runs the files on two worker processes,
each file whole on one worker (`--dist=loadfile` in pytest.ini, so module fixtures are built
once). A run that names only files or test ids runs in this process. `-n 0` or `-p no:xdist`
forces one process; `PYTEST_XDIST_AUTO_NUM_WORKERS=N` sets the worker count.
Tests marked `@pytest.mark.slow` run only with `--runslow`; each has a smaller version of its
check in the default suite.

On a CPU host the tests compile at XLA's backend optimization level 0 (see below;
`SPARSE_LM_TEST_XLA_OPT=1` keeps XLA's default level).

Compile once per session: a persistent XLA compilation cache in a temporary directory (made by
the first pytest process, inherited through the environment by the xdist workers, the
multi-device subprocesses, the notebook kernels and the CLI workers; removed at the end) lets a
program compiled by one test load in every later test, process or `jax.jit` wrapper that builds
the same program. Set `SPARSE_LM_TEST_COMPILE_CACHE=0` to compile everything afresh, or
`JAX_COMPILATION_CACHE_DIR` to keep a cache of your own across runs (never removed here).

Scheduling: the files that took longest in a recorded run start first (`tests/suite_durations.txt`,
written by `tests/suite_durations.py`), so that the two workers do not end with one of them alone
on a two-minute file.
"""

import importlib.util
import os
import shutil
import tempfile

import pytest

import suite_durations  # tests/ (this file's folder) is on sys.path

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

# On the CPU platform the suite compiles at XLA's backend optimization level 0 (LLVM's machine-code
# passes off; the HLO and its fusions are the same, results may differ in the last bits): most
# of the suite's time is compiling small programs, not running them (2026-12-02, 2 cores, the
# whole suite 22 min 22 s -> 17 min 37 s; docs/benchmarks.md "Test suite"). The flags reach the
# tests' subprocesses through SPARSE_LM_TEST_XLA_FLAGS (tests/_xla_flags.py);
# SPARSE_LM_TEST_XLA_OPT=1 keeps XLA's default level.
if (os.environ["JAX_PLATFORMS"] == "cpu"
    and os.environ.get("SPARSE_LM_TEST_XLA_OPT", "0") != "1"):
  os.environ.setdefault("SPARSE_LM_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                             os.environ["SPARSE_LM_TEST_XLA_FLAGS"]).strip()

DEFAULT_WORKERS = 2  # CI's cores; each worker peaks at ~3 GB of host memory

# The session's compilation cache (module level: this runs in the first pytest process before
# it starts any worker, so every process of the session gets the same directory).
_OWN_CACHE_DIR = None
if (os.environ.get("SPARSE_LM_TEST_COMPILE_CACHE", "1") != "0"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
  _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="sparse_lm_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE_DIR
  # Programs that take >= 0.5 s to compile (the model steps; not the op-by-op kernels of eager
  # code, which the in-memory cache already serves).
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  # A size limit turns on the cache's file lock, so that two processes never read an entry
  # another one is still writing (the lock needs `filelock`, which huggingface_hub brings).
  if importlib.util.find_spec("filelock") is not None:
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))

# The files that took longest in a recorded run of the suite start first (suite_durations.txt;
# `python tests/suite_durations.py --help` says how to refresh it), the others follow in
# collection order. With `--dist=loadfile` a file runs whole on one worker, so the long ones must
# start early (pytest.ini: --no-loadscope-reorder keeps this order).
FILE_RANK = suite_durations.rank_of()


def pytest_addoption(parser, pluginmanager):
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run the tests marked slow (full-size compiles, long curves)")
  if not pluginmanager.has_plugin("xdist"):
    # pytest.ini passes xdist's options; without the plugin (-p no:xdist, or not installed)
    # they are accepted and ignored, and the tests run in this process.
    group = parser.getgroup("xdist (not loaded: options ignored)")
    group.addoption("--numprocesses", dest="numprocesses", default=None)
    group.addoption("--dist", dest="dist", default="no")
    group.addoption("--no-loadscope-reorder", dest="loadscopereorder", action="store_false")


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


def pytest_unconfigure(config):
  if _OWN_CACHE_DIR and not hasattr(config, "workerinput"):  # the process that made it
    shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: FILE_RANK(item.nodeid.split("::")[0]))  # stable
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow tier: run with --runslow")
  for item in items:
    if item.get_closest_marker("slow"):
      item.add_marker(skip)
