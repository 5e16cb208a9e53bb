"""Audit: the whole VisionEncoder (padded ImageBatch path) against an independent float64 NumPy
forward written from ARCHITECTURE.md §7 and the encoder's documented equations; it reads only
the parameter arrays, never sparse_lm code.

    x_0 = patchify(pixels) W_patch               patch vector in (row, col, channel) order
    L times  x += Attn(RMSNorm(x))               2D RoPE: channels [0, Dh/2) rotate with the
                                                 patch row, [Dh/2, Dh) with the column,
                                                 rotate-half pairs (j, j + Dh/4), theta 1e4;
                                                 softmax over the image's own patches,
                                                 scale Dh^-1/2
             x += W_2 gelu_tanh(W_1 RMSNorm(x))
    z = merge_2x2(RMSNorm(x))                    token (i, j) = patches (2i,2j), (2i,2j+1),
                                                 (2i+1,2j), (2i+1,2j+1) concatenated
    e = RMSNorm(W_p2 gelu_tanh(W_p1 z))          valid tokens first, row-major over the image's
                                                 own merged grid

Kills (hand mutation testing): attention scale from the wrong width, patch pixels flattened in
the wrong order, the 2x2 merge in column-major order, RoPE row / column tables swapped, the
exact-vs-tanh GELU swapped, a skipped final norm. Runs each image alone on its own grid (so
the padding handling of the encoder is checked too)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm import vision

P = 14
THETA = 10_000.0


def _rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _rope(x, rows, cols):
  """x [P, H, Dh]: first half of the channels rotated by the row angle, second half by the
  column angle; within a half of width Dh/2, channel j pairs with j + Dh/4."""
  dh = x.shape[-1]
  q4 = dh // 4
  inv = THETA ** (-np.arange(q4) / q4)
  out = np.empty_like(x)
  for half, pos in ((0, rows), (1, cols)):
    a = pos[:, None] * inv[None, :]  # [P, Dh/4]
    c, s = np.cos(a)[:, None, :], np.sin(a)[:, None, :]
    x1 = x[..., half * 2 * q4: half * 2 * q4 + q4]
    x2 = x[..., half * 2 * q4 + q4: (half + 1) * 2 * q4]
    out[..., half * 2 * q4: half * 2 * q4 + q4] = x1 * c - x2 * s
    out[..., half * 2 * q4 + q4: (half + 1) * 2 * q4] = x2 * c + x1 * s
  return out


def _np_encode_one(p, img, eps, layers):
  """One image [h, w, 3] float64 -> its tokens [gh * gw, D] (row-major over the merged grid)."""
  h, w, _ = img.shape
  gh, gw = -(-h // (2 * P)), -(-w // (2 * P))
  canvas = np.zeros((2 * gh * P, 2 * gw * P, 3))
  canvas[:h, :w] = img
  R, C = 2 * gh, 2 * gw
  patches, rows, cols = [], [], []
  for r in range(R):
    for c in range(C):
      patches.append(canvas[r * P:(r + 1) * P, c * P:(c + 1) * P, :].reshape(-1))
      rows.append(r)
      cols.append(c)
  x = np.stack(patches) @ p["patch_embed"]
  rows, cols = np.asarray(rows, np.float64), np.asarray(cols, np.float64)
  for l in range(layers):
    hN = _rms(x, p["attn_norm"][l], eps)
    q = _rope(np.einsum("pc,chd->phd", hN, p["w_q"][l]), rows, cols)
    k = _rope(np.einsum("pc,chd->phd", hN, p["w_k"][l]), rows, cols)
    v = np.einsum("pc,chd->phd", hN, p["w_v"][l])
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", a, v)
    x = x + np.einsum("phd,hdc->pc", o, p["w_o"][l])
    hN = _rms(x, p["mlp_norm"][l], eps)
    x = x + _gelu_tanh(hN @ p["w_1"][l]) @ p["w_2"][l]
  x = _rms(x, p["final_norm"], eps).reshape(R, C, -1)
  toks = []
  for i in range(gh):
    for j in range(gw):
      toks.append(np.concatenate([x[2 * i, 2 * j], x[2 * i, 2 * j + 1], x[2 * i + 1, 2 * j],
                                  x[2 * i + 1, 2 * j + 1]]))
  z = _gelu_tanh(np.stack(toks) @ p["proj_1"])
  return _rms(z @ p["proj_2"], p["out_norm"], eps)


def test_encoder_matches_numpy_forward_on_non_square_images():
  seed = 5
  print(f"seed={seed}")
  cfg = vision.tiny_vision_config()
  enc = vision.VisionEncoder(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  # norm scales away from their initial ones, so a skipped or misplaced norm shows
  for norm in (enc.final_norm, enc.out_norm, enc.blocks.attn_norm, enc.blocks.mlp_norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  # a ViT MLP branch as large as the residual (at init it is ~1% of it: the exact form of
  # its GELU was invisible)
  enc.blocks.w_1[...] = enc.blocks.w_1[...] * 3.0
  enc.blocks.w_2[...] = enc.blocks.w_2[...] * 10.0
  f64 = lambda v: np.asarray(v[...], np.float64)
  p = {n: f64(getattr(enc, n)) for n in ("patch_embed", "proj_1", "proj_2")}
  p["final_norm"], p["out_norm"] = f64(enc.final_norm.scale), f64(enc.out_norm.scale)
  b = enc.blocks
  for n in ("w_q", "w_k", "w_v", "w_o", "w_1", "w_2"):
    p[n] = f64(getattr(b, n))
  p["attn_norm"], p["mlp_norm"] = f64(b.attn_norm.scale), f64(b.mlp_norm.scale)
  # non-square, not multiples of the patch, different merged grids (2 x 3 and 2 x 2: the
  # second image's rows are narrower than the canvas's merged grid)
  imgs = [rng.uniform(-1, 1, (40, 70, 3)).astype(np.float32),
          rng.uniform(-1, 1, (50, 30, 3)).astype(np.float32)]
  batch = vision.pad_images(imgs, P)
  e, mask = nnx.jit(lambda m, x, s: m(x, s))(enc, batch.pixels, batch.sizes)
  e, mask = np.asarray(e, np.float64), np.asarray(mask)
  for n, img in enumerate(imgs):
    ref = _np_encode_one(p, img.astype(np.float64), cfg.norm_eps, cfg.vision_layers)
    m = ref.shape[0]
    assert mask[n].sum() == m and mask[n, :m].all()
    err = np.linalg.norm(e[n, :m] - ref) / np.linalg.norm(ref)
    assert err < 1e-5, (n, err)
    assert np.std(ref, axis=0).mean() > 0.1  # the tokens differ from each other
