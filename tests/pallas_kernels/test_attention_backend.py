"""What "auto" means for softmax attention on each platform (stand-in devices: the decision
reads only the platform and a GPU's compute capability), and the key ranges of packed rows."""

import importlib.util
import types

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.attention import resolve_backend, run_ranges


def _gpu(cc):
  return types.SimpleNamespace(platform="gpu", device_kind="NVIDIA", compute_capability=cc)


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is None, reason="tokamax not installed")
def test_auto_is_tokamax_on_hopper_and_newer_only():
  assert resolve_backend("auto", _gpu("9.0")) == "tokamax"
  assert resolve_backend("auto", _gpu("10.0")) == "tokamax"
  # tokamax 0.0.17 runs an A100's forward but raises in its backward: not "auto" there
  assert resolve_backend("auto", _gpu("8.0")) == "xla_chunked"
  assert resolve_backend("auto", _gpu("unknown")) == "xla_chunked"


def test_auto_elsewhere_and_explicit_names():
  assert resolve_backend("auto", types.SimpleNamespace(platform="tpu")) == "splash"
  assert resolve_backend("auto", types.SimpleNamespace(platform="cpu")) == "xla_chunked"
  assert resolve_backend("tokamax", types.SimpleNamespace(platform="cpu")) == "tokamax"
  assert resolve_backend("xla", _gpu("9.0")) == "xla"


def test_run_ranges_match_a_loop_over_random_rows():
  """Each position's run of equal ids [start, end), against a plain Python scan; ids repeat
  after other ids (a new run), and 0 is an ordinary id here."""
  seed = 17
  print(f"seed={seed}")
  rng = np.random.default_rng(seed)
  seg = np.cumsum(rng.uniform(size=(4, 37)) < 0.25, axis=1) % 3  # ids 0-2, runs of any length
  start, end = (np.asarray(x) for x in run_ranges(jnp.asarray(seg)))
  for b in range(seg.shape[0]):
    for t in range(seg.shape[1]):
      a = t
      while a > 0 and seg[b, a - 1] == seg[b, t]:
        a -= 1
      e = t + 1
      while e < seg.shape[1] and seg[b, e] == seg[b, t]:
        e += 1
      assert (start[b, t], end[b, t]) == (a, e), (b, t)
  with pytest.raises(ValueError, match=r"segment_ids: expected \[B, T\]"):
    run_ranges(jnp.asarray(seg[0]))
