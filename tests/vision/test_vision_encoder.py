"""VisionEncoder (ARCHITECTURE.md §7): native-size shapes, padding invariance, 2D positions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm import vision
from sparse_lm.config import get_preset
from sparse_lm.vision import encoder as encoder_lib
from sparse_lm.vision import patches

P = 14


@pytest.fixture(scope="module")
def cfg():
  return vision.tiny_vision_config()


@pytest.fixture(scope="module")
def enc(cfg):
  return vision.VisionEncoder(cfg, rngs=nnx.Rngs(0))


@nnx.jit
def _encode(enc, pixels, sizes):
  return enc(pixels, sizes)


def _img(rng, h, w):
  return rng.uniform(-1.0, 1.0, (h, w, 3)).astype(np.float32)


def test_shapes_two_native_sizes(enc, cfg):
  rng = np.random.default_rng(1)
  batch = vision.pad_images([_img(rng, 56, 84), _img(rng, 28, 28)], P)
  assert batch.pixels.shape == (2, 56, 84, 3)
  e, mask = _encode(enc, batch.pixels, batch.sizes)
  assert e.shape == (2, 6, cfg.d_model) and e.dtype == jnp.float32
  np.testing.assert_array_equal(mask, [[True] * 6, [True] + [False] * 5])
  e = np.asarray(e)
  assert np.all(np.isfinite(e))
  assert np.all(e[1, 1:] == 0)  # padding slots are zeros
  # out_norm starts at scale 1: valid tokens have RMS ~1 like the text embeddings
  rms = np.sqrt(np.mean(e[mask] ** 2, axis=-1))
  np.testing.assert_allclose(rms, 1.0, rtol=1e-2)  # eps
  assert np.std(e[0, :6], axis=0).mean() > 0.1  # tokens differ from each other


@pytest.mark.parametrize("small_hw", [(28, 28), (30, 50)])
def test_padding_does_not_change_valid_outputs(enc, small_hw):
  rng = np.random.default_rng(2)
  small = _img(rng, *small_hw)
  alone = vision.pad_images([small], P)
  e1, m1 = _encode(enc, alone.pixels, alone.sizes)
  batch = vision.pad_images([_img(rng, 70, 90), small], P)  # canvas 84 x 112
  # garbage outside the small image must be ignored (the encoder zeroes it)
  pixels = np.asarray(batch.pixels).copy()
  h, w = small_hw
  noise = rng.uniform(-5, 5, pixels.shape[1:]).astype(np.float32)
  keep = np.zeros(pixels.shape[1:3], bool)
  keep[:h, :w] = True
  pixels[1] = np.where(keep[..., None], pixels[1], noise)
  e2, m2 = _encode(enc, jnp.asarray(pixels), batch.sizes)
  n = vision.num_image_tokens(h, w, P)
  assert int(m1[0].sum()) == int(m2[1].sum()) == n
  np.testing.assert_allclose(np.asarray(e2[1, :n]), np.asarray(e1[0, :n]), rtol=1e-5,
                             atol=1e-5)


def test_num_image_tokens_matches_encoder(enc):
  rng = np.random.default_rng(3)
  sizes = [(28, 28), (30, 50), (56, 84), (1, 1), (83, 29), (0, 0)]
  batch = vision.pad_images([_img(rng, h, w) for h, w in sizes], P)
  e, mask = _encode(enc, batch.pixels, batch.sizes)
  got = np.asarray(mask).sum(1)
  want = [vision.num_image_tokens(h, w, P) for h, w in sizes]
  assert list(got) == want == [1, 4, 6, 1, 6, 0]
  for n, k in enumerate(want):  # valid tokens are a prefix
    assert mask[n, :k].all() and not mask[n, k:].any()
  assert np.all(np.isfinite(np.asarray(e)))  # the empty slot (0, 0) stays finite
  assert len(vision.image_token_span(56, 84, P, vision.IMAGE_TOKEN_ID)) == 6


def _swap_cells(img):
  """Swap the top-left and bottom-right 28x28 cells of a 56x56 image."""
  out = img.copy()
  out[:28, :28], out[28:, 28:] = img[28:, 28:], img[:28, :28]
  return out


def test_2d_position_information(cfg, monkeypatch):
  """Without positions, attention is permutation-equivariant: swapping two merge cells would
  just swap their output tokens. With 2D RoPE the swapped cells' tokens change. The control
  disables RoPE and sees exact equivariance (1000x below the threshold). At init (std 0.02)
  attention is nearly uniform and adds ~5% to the residual stream, so w_q / w_k are scaled up
  to make attention position-selective."""
  enc = vision.VisionEncoder(cfg, rngs=nnx.Rngs(11))
  for w in (enc.blocks.w_q, enc.blocks.w_k):
    w[...] = w[...] * 10.0
  rng = np.random.default_rng(4)
  img = _img(rng, 56, 56)
  batch = vision.pad_images([img, _swap_cells(img)], P)

  def run():  # a fresh jitted function per call traces with the current apply_rope_2d
    e, _ = nnx.jit(lambda enc, x, s: enc(x, s))(enc, batch.pixels, batch.sizes)
    return np.asarray(e)

  def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

  # token 0 = cell (0,0) of img; token 3 of the swapped image shows the same pixels at (1,1)
  e = run()
  for a, b in ((e[1, 3], e[0, 0]), (e[1, 0], e[0, 3]), (e[1, 1:3], e[0, 1:3])):
    assert rel(a, b) > 2e-3, rel(a, b)

  monkeypatch.setattr(encoder_lib, "apply_rope_2d", lambda x, cos, sin: x)
  e = run()
  for a, b in ((e[1, 3], e[0, 0]), (e[1, 0], e[0, 3]), (e[1, 1:3], e[0, 1:3])):
    assert rel(a, b) < 2e-6, rel(a, b)


def test_rope_2d_relative_and_axis_specific():
  rng = np.random.default_rng(5)
  dh = 16
  q = jnp.asarray(rng.standard_normal((1, 1, 1, dh)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 1, dh)), jnp.float32)

  def score(qpos, kpos):
    cq, sq = encoder_lib.rope_2d_tables(np.array([qpos[0]]), np.array([qpos[1]]), dh)
    ck, sk = encoder_lib.rope_2d_tables(np.array([kpos[0]]), np.array([kpos[1]]), dh)
    return float(jnp.sum(vision.apply_rope_2d(q, cq, sq) * vision.apply_rope_2d(k, ck, sk)))

  base = score((2, 5), (4, 1))
  np.testing.assert_allclose(score((9, 12), (11, 8)), base, rtol=1e-5)  # shift by (7, 7)
  np.testing.assert_allclose(score((2, 0), (4, -4)), base, rtol=1e-5)   # shift by (0, -5)
  assert abs(score((5, 2), (1, 4)) - base) > 1e-3  # transposed offsets differ
  # rotation preserves norms
  c, s = encoder_lib.rope_2d_tables(np.array([3]), np.array([7]), dh)
  np.testing.assert_allclose(jnp.linalg.norm(vision.apply_rope_2d(q, c, s)),
                             jnp.linalg.norm(q), rtol=1e-6)


def test_scan_loop_remat_and_jit_agree(cfg):
  rng = np.random.default_rng(6)
  batch = vision.pad_images([_img(rng, 40, 60), _img(rng, 28, 56)], P)
  outs = []
  for kw in (dict(), dict(scan_layers=False), dict(remat_policy="full"),
             dict(attention_chunk_size=4)):  # 4 x 6 = 24 patches, 6 query blocks
    c = dataclasses.replace(cfg, **kw)
    enc = vision.VisionEncoder(c, rngs=nnx.Rngs(7))  # same seed -> same params
    outs.append(_encode(enc, batch.pixels, batch.sizes)[0])
  for o in outs[1:]:
    np.testing.assert_allclose(np.asarray(o), np.asarray(outs[0]), rtol=1e-5, atol=1e-5)


def test_query_chunked_attention_matches_full():
  rng = np.random.default_rng(12)
  N, Pn, H, Dh = 2, 23, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal((N, Pn, H, Dh)), jnp.float32) for _ in range(3))
  mask = jnp.asarray(np.arange(Pn)[None] < np.array([[23], [9]]))

  @jax.jit
  def run(q):
    attn = lambda q, c: encoder_lib.masked_attention(q, k, v, mask, query_chunk=c)
    # reference: plain softmax over the valid keys only
    p = jax.nn.softmax(jnp.where(mask[:, None, None], jnp.einsum("nqhd,nkhd->nhqk", q, k)
                                 / np.sqrt(Dh), -jnp.inf), -1)
    grads = [jax.grad(lambda q: jnp.sum(attn(q, c) ** 2))(q) for c in (None, 5)]
    return attn(q, None), attn(q, 5), jnp.einsum("nhqk,nkhd->nqhd", p, v), grads

  full, chunked, ref, (g_full, g_chunked) = run(q)
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(full), np.asarray(ref), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g_chunked), np.asarray(g_full), rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(g_full)).max() > 0


def _packed_reference(q, k, v, seg):
  """fp64 softmax over the keys of the same non-zero id; zero rows for padding queries."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  seg = np.asarray(seg)
  s = np.einsum("nqhd,nkhd->nhqk", q, k) / np.sqrt(q.shape[-1])
  see = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)  # [N, q, k]
  s = np.where(see[:, None], s, -np.inf)
  m = np.max(s, -1, keepdims=True)
  p = np.where(see[:, None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
  return np.einsum("nhqk,nkhd->nqhd", p, v)


@pytest.mark.parametrize("backend", ["xla_chunked", "tokamax"])
def test_packed_attention_matches_reference(backend):
  """Packed rows (images of 8, 12 and 4 patches, padding between and after, a row of padding
  only) through both paths against the fp64 reference, value and gradients of q, k, v. On
  CPU "tokamax" runs tokamax's XLA implementation with the same key ranges the GPU kernels
  get (`image_key_ranges`)."""
  rng = np.random.default_rng(13)
  N, Pn, H, Dh = 3, 32, 2, 8
  seg = np.zeros((N, Pn), np.int32)
  seg[0, :8], seg[0, 8:20], seg[0, 24:28] = 1, 2, 5
  seg[1, 4:16] = 3
  q, k, v, w = (jnp.asarray(rng.standard_normal((N, Pn, H, Dh)), jnp.float32) for _ in range(4))
  attn = lambda q, k, v: encoder_lib.masked_attention(
      q, k, v, segment_ids=jnp.asarray(seg), query_chunk=8, backend=backend)
  out = attn(q, k, v)
  ref = _packed_reference(q, k, v, seg)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[seg == 0] == 0)
  grads = jax.grad(lambda *a: jnp.sum(attn(*a) * w), argnums=(0, 1, 2))(q, k, v)
  # the reference's gradients: autodiff of the full fp32 softmax with the same mask
  see = jnp.asarray((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0))

  def full(q, k, v):
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k, precision="highest") / np.sqrt(Dh)
    p = jax.nn.softmax(jnp.where(see[:, None], s, -1e30), -1) * see[:, None]
    o = jnp.einsum("nhqk,nkhd->nqhd", p, v, precision="highest")
    return jnp.sum(jnp.where(jnp.asarray(seg > 0)[..., None, None], o, 0) * w)

  for g, r in zip(grads, jax.grad(full, argnums=(0, 1, 2))(q, k, v)):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def _on_hopper():
  from pallas_kernels.attention import resolve_backend  # "auto": tokamax on sm90+ only
  return jax.devices()[0].platform == "gpu" and resolve_backend("auto") == "tokamax"


@pytest.mark.skipif(not _on_hopper(), reason="GPU-only: tokamax's Mosaic GPU kernels (sm90+)")
def test_packed_attention_mosaic_gpu_bf16_matches_reference():
  """The kernels training runs on a Hopper GPU (bf16 q, k, v; tokamax's Mosaic GPU forward
  with its block skipping and its sm90 backward), forced with implementation="mosaic_gpu", on
  images that cross 128-query blocks, against fp32 references on the same bf16-rounded inputs:
  relative RMSE of o <= 5e-3 and of dq, dk, dv <= 8e-3 (the project's bf16 contract,
  ARCHITECTURE §2.5)."""
  from pallas_kernels.attention import tokamax_masked
  rng = np.random.default_rng(14)
  N, Pn, H, Dh = 2, 384, 2, 64
  seg = np.zeros((N, Pn), np.int32)
  seg[0, :150], seg[0, 150:300] = 1, 2
  seg[1, 10:260] = 3
  q, k, v, w = (jnp.asarray(rng.standard_normal((N, Pn, H, Dh)), jnp.bfloat16)
                for _ in range(4))
  start, end = encoder_lib.image_key_ranges(jnp.asarray(seg))
  valid = jnp.asarray(seg > 0)[..., None, None]

  def attn(q, k, v):
    o = tokamax_masked(q, k, v, scale=Dh ** -0.5, k_start=start, k_end=end,
                       implementation="mosaic_gpu")
    return jnp.where(valid, o, 0)

  see = jnp.asarray((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0))

  def full(q, k, v):
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k, precision="highest") / np.sqrt(Dh)
    p = jax.nn.softmax(jnp.where(see[:, None], s, -1e30), -1) * see[:, None]
    return jnp.where(valid, jnp.einsum("nhqk,nkhd->nqhd", p, v, precision="highest"), 0)

  rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel())
                           / jnp.linalg.norm(b.ravel()))
  f32 = [a.astype(jnp.float32) for a in (q, k, v)]
  with jax.default_matmul_precision("default"):
    out = jax.jit(attn)(q, k, v)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(attn(*a).astype(jnp.float32) * w), (0, 1, 2)))(
        q, k, v)
  assert rel(out, full(*f32)) <= 5e-3
  ref = jax.grad(lambda *a: jnp.sum(full(*a) * w.astype(jnp.float32)), (0, 1, 2))(*f32)
  for g, r in zip(grads, ref):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert rel(g, r) <= 8e-3


def test_image_key_ranges():
  seg = jnp.asarray([[1, 1, 1, 0, 2, 2, 0, 0], [0, 0, 7, 7, 7, 7, 7, 7]], jnp.int32)
  start, end = encoder_lib.image_key_ranges(seg)
  np.testing.assert_array_equal(start, [[0, 0, 0, 3, 4, 4, 6, 7], [0, 1, 2, 2, 2, 2, 2, 2]])
  np.testing.assert_array_equal(end, [[3, 3, 3, 4, 6, 6, 7, 8], [1, 2, 8, 8, 8, 8, 8, 8]])


def test_bf16_compute_close_to_fp32(cfg):
  rng = np.random.default_rng(8)
  batch = vision.pad_images([_img(rng, 56, 84), _img(rng, 28, 28)], P)
  e32, m = _encode(vision.VisionEncoder(cfg, rngs=nnx.Rngs(9)), batch.pixels, batch.sizes)
  c16 = dataclasses.replace(cfg, dtype="bfloat16")
  e16, _ = _encode(vision.VisionEncoder(c16, rngs=nnx.Rngs(9)), batch.pixels, batch.sizes)
  a, b = np.asarray(e16)[np.asarray(m)], np.asarray(e32)[np.asarray(m)]
  rel_rmse = np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2))
  assert np.all(np.isfinite(a)) and rel_rmse < 3e-2, rel_rmse


def test_full_scale_param_count_and_bad_config():
  full = get_preset("full", vision=True)
  enc = nnx.eval_shape(lambda: vision.VisionEncoder(full, rngs=nnx.Rngs(0)))
  n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(enc, nnx.Param)))
  C, F, L, D = 1152, 4304, 27, 7168
  vit = 14 * 14 * 3 * C + L * (4 * C * C + 2 * C * F + 2 * C) + C
  projector = 4 * C * 4 * C + 4 * C * D + D
  assert n == vit + projector
  assert 400e6 < vit < 430e6  # "~400M" (ARCHITECTURE §1, 27 layers)
  with pytest.raises(ValueError, match="head dim"):
    vision.VisionEncoder(get_preset("tiny", vision=True, vision_width=30, vision_heads=3),
                         rngs=nnx.Rngs(0))


def test_pad_images_and_patch_helpers():
  rng = np.random.default_rng(10)
  b = vision.pad_images([_img(rng, 30, 10)], P)
  assert b.pixels.shape == (1, 56, 28, 3) and b.sizes.tolist() == [[30, 10]]
  with pytest.raises(ValueError):
    vision.pad_images([_img(rng, 30, 10)], P, height=28)
  with pytest.raises(ValueError):
    vision.pad_images([rng.uniform(size=(28, 28))], P)
  # merge_2x2 groups each 2x2 block of patches, in raster order
  x = jnp.arange(4 * 6, dtype=jnp.float32).reshape(1, 24, 1)  # patch id on a 4x6 grid
  m = patches.merge_2x2(x, 4, 6)
  np.testing.assert_array_equal(m[0, 0, :, ], [0, 1, 6, 7])
  np.testing.assert_array_equal(m[0, 4, :, ], [14, 15, 20, 21])
