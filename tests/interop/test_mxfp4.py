"""MXFP4 codec against an independently written E2M1 table (OCP MX v1.0)."""

import numpy as np
import pytest

from sparse_lm.interop import mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_dequantize_known_codes():
  codes = np.arange(32, dtype=np.uint8) % 16  # one group: every code twice
  packed = (codes[0::2] | (codes[1::2] << 4))[None]
  scale = np.array([[127 + 3]], np.uint8)  # x 8
  want = np.array([(-1 if c & 8 else 1) * E2M1[c & 7] * 8 for c in codes], np.float32)
  np.testing.assert_array_equal(mxfp4.dequantize(packed, scale)[0], want)


def test_quantize_round_trips_and_reencodes_exactly():
  seed = 0
  print("seed", seed)
  w = np.random.default_rng(seed).standard_normal((6, 96)).astype(np.float32) * 0.03
  packed, scale = mxfp4.quantize(w)
  assert packed.shape == (6, 48) and scale.shape == (6, 3)
  dq = mxfp4.dequantize(packed, scale)
  group_max = np.abs(w.reshape(6, 3, 32)).max(-1, keepdims=True)
  # the shared exponent puts the group maximum in [4, 8) * 2**e, so the step is <= max / 4
  assert np.all(np.abs(dq - w).reshape(6, 3, 32) <= group_max / 4 + 1e-12)
  p2, s2 = mxfp4.quantize(dq)
  np.testing.assert_array_equal(mxfp4.dequantize(p2, s2), dq)


def test_bad_shapes():
  with pytest.raises(ValueError, match="multiple of 32"):
    mxfp4.quantize(np.zeros((2, 33), np.float32))
  with pytest.raises(ValueError, match="disagree"):
    mxfp4.dequantize(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
