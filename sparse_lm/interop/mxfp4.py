"""MXFP4 (OCP microscaling FP4) as stored by compressed-tensors `mxfp4-pack-quantized`.

A quantized `nn.Linear` weight `X.weight [out, in]` is stored as two uint8 tensors:
  X.weight_packed [out, in // 2]   two E2M1 codes per byte, the LOW nibble is the even column;
  X.weight_scale  [out, in // 32]  one E8M0 exponent per group of 32 consecutive input columns,
                                   the multiplier is 2 ** (scale - 127).
E2M1 codes 0..7 are +{0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign. (OCP Microscaling
Formats v1.0 §5.3; the Kimi-K3 release quantizes its routed experts this way.) NumPy only.
"""

from __future__ import annotations

import numpy as np

GROUP = 32
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_E2M1_MAX_EXP = 2  # 6 = 1.5 * 2**2


def dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """(weight_packed [..., n/2] uint8, weight_scale [..., n/32] uint8) -> fp32 [..., n].

  Raises:
    ValueError: dtypes are not uint8 or the shapes do not agree (n/2 vs n/32 per row).
  """
  if packed.dtype != np.uint8 or scale.dtype != np.uint8:
    raise ValueError(f"MXFP4 tensors must be uint8, got packed {packed.dtype}, "
                     f"scale {scale.dtype}")
  n = packed.shape[-1] * 2
  if packed.shape[:-1] != scale.shape[:-1] or scale.shape[-1] * GROUP != n:
    raise ValueError(f"MXFP4 shapes disagree: weight_packed {packed.shape} holds {n} columns, "
                     f"weight_scale {scale.shape} covers {scale.shape[-1] * GROUP}")
  codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], n)
  values = E2M1_VALUES[codes]
  mult = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32)
  return (values.reshape(*values.shape[:-1], -1, GROUP) * mult[..., None]).reshape(values.shape)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """fp32 [..., n] (n a multiple of 32) -> (weight_packed uint8 [..., n/2], weight_scale uint8
  [..., n/32]).

  Per group: scale exponent e = floor(log2(max |w|)) - 2 (OCP's shared exponent), values
  w / 2**e rounded to the nearest E2M1 code (ties to the lower magnitude), clipped at ±6.
  Values that came from `dequantize` are re-encoded exactly (their dequantization is equal).

  Raises:
    ValueError: n not a multiple of 32.
  """
  w = np.asarray(w, np.float32)
  n = w.shape[-1]
  if n % GROUP:
    raise ValueError(f"MXFP4 needs the input dim {n} to be a multiple of {GROUP}")
  g = w.reshape(*w.shape[:-1], n // GROUP, GROUP)
  amax = np.max(np.abs(g), axis=-1)
  exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - _E2M1_MAX_EXP,
                 -127)
  exp = np.clip(exp, -127, 127).astype(np.int32)
  x = g / np.ldexp(np.float32(1.0), exp)[..., None]
  mags = E2M1_VALUES[:8]
  idx = np.argmin(np.abs(np.abs(x)[..., None] - mags), axis=-1)  # first (lower) on ties
  codes = (idx | np.where((x < 0) & (idx > 0), 8, 0)).astype(np.uint8).reshape(w.shape)
  packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
  return packed, (exp + 127).astype(np.uint8)
