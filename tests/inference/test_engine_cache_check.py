"""The engine's cache-size check reads the memory of a device of this process: in a
multi-process job (the end-of-stage sample of a two-process run) devices[0] of the mesh can
belong to another process, whose memory_stats() raises "MemoryStats is only supported for
addressable PjRt devices"."""

import types

import jax
import numpy as np
import pytest

from sparse_lm.config import get_preset
from sparse_lm.inference import engine


class _RemoteDevice:
  platform = "cpu"
  process_index = jax.process_index() + 1

  def memory_stats(self):
    raise RuntimeError("MemoryStats is only supported for addressable PjRt devices")


def _mesh(devices):
  return types.SimpleNamespace(devices=np.array(devices, dtype=object))


def test_the_check_skips_other_processes_devices_and_still_refuses_what_cannot_fit():
  cfg = get_preset("tiny")
  local = jax.devices()[0]
  engine._check_cache_fits(cfg, 64, 2, _mesh([_RemoteDevice(), local]))  # no error
  engine._check_cache_fits(cfg, 64, 2, _mesh([_RemoteDevice()]))  # nothing local: no check
  with pytest.raises(ValueError, match="max_length"):
    engine._check_cache_fits(cfg, 2**40, 2**10, _mesh([_RemoteDevice(), local]))
