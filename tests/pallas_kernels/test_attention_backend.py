"""What "auto" means for softmax attention on each platform (stand-in devices: the decision
reads only the platform and a GPU's compute capability)."""

import importlib.util
import types

import pytest

from pallas_kernels.attention import resolve_backend


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
