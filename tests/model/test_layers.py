"""Layer-level tests: short conv; the KDA and Gated MLA layers against independent fp64 NumPy
forwards of the whole layer (tests/model/numpy_layers.py); attention backends vs naive softmax
attention (every CPU-runnable backend); decode paths; AttnRes at initialisation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.attention import flash_attention
from sparse_lm.config import get_preset
from sparse_lm.model import attention, attnres
from sparse_lm.model.kda import KDA, short_conv
from sparse_lm.model.mla import MLA
from tests.model import numpy_layers


def rel_rmse(ref, out):
  ref = np.asarray(ref, np.float64)
  out = np.asarray(out, np.float64)
  return np.linalg.norm(ref - out) / np.linalg.norm(ref)


CFG = get_preset("tiny")


def _segments(rng, B, T):
  """Random packed segment ids with trailing padding (0) in the last row."""
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), size=2, replace=False))
    seg[b, :cuts[0]] = 1
    seg[b, cuts[0]:cuts[1]] = 2
    seg[b, cuts[1]:] = 3
  seg[-1, T - 3:] = 0
  return jnp.asarray(seg)


def test_short_conv_segments_and_state():
  rng = np.random.default_rng(0)
  B, T, C, W = 2, 19, 5, 4
  x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((W, C)), jnp.float32)
  seg = _segments(rng, B, T)
  y, _ = short_conv(x, w, seg)
  # Naive definition.
  xn, wn, sn = np.asarray(x), np.asarray(w), np.asarray(seg)
  ref = np.zeros((B, T, C))
  for b in range(B):
    for t in range(T):
      for i in range(W):
        if t - i >= 0 and sn[b, t - i] == sn[b, t]:
          ref[b, t] += wn[W - 1 - i] * xn[b, t - i]
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  # Carrying the conv state over a split equals one pass.
  y1, st = short_conv(x[:, :7], w)
  y2, _ = short_conv(x[:, 7:], w, conv_state=st)
  yf, _ = short_conv(x, w)
  np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), yf, rtol=1e-6, atol=1e-6)


def _params(module, names):
  """The module's parameter arrays as float64 NumPy (what the references read)."""
  return {n: np.asarray(getattr(module, n)[...], np.float64) for n in names}


def _seed():
  seed = int(np.random.randint(1 << 30))
  print(f"seed={seed}")
  return seed


@pytest.mark.parametrize("gate_lower_bound", [-5.0, None])
def test_kda_layer_matches_numpy_forward(gate_lower_bound):
  """The whole layer (§2.2-§2.3: short conv, SiLU, L2 norm, low-rank gate, beta, recurrence,
  output RMSNorm and sigmoid gate) against an fp64 NumPy forward reading only the params."""
  cfg = dataclasses.replace(CFG, kda_gate_lower_bound=gate_lower_bound)
  seed = _seed()
  layer = KDA(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for n in ("w_og", "A_log", "dt_bias", "o_norm"):  # non-trivial values for the init-constant
    v = getattr(layer, n)                            # ones / zeros and the gate's logits
    v[...] = v[...] + jnp.asarray(rng.standard_normal(v.shape), jnp.float32) * 0.5
  B, T = 2, 37
  x = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
  seg = _segments(rng, B, T)
  y = layer(x, segment_ids=seg)
  p = _params(layer, ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_g_down", "w_g_up",
                      "A_log", "dt_bias", "w_beta", "w_og", "o_norm", "w_o"))
  ref = numpy_layers.kda_layer(p, np.asarray(x, np.float64), np.asarray(seg),
                               gate_lower_bound=gate_lower_bound, eps=cfg.norm_eps)
  assert rel_rmse(ref, y) < 1e-5
  assert float(jnp.std(y)) > 0


def test_kda_decode_matches_prefill():
  layer = KDA(CFG, rngs=nnx.Rngs(2))
  x = jax.random.normal(jax.random.key(2), (2, 21, CFG.d_model))
  y = layer(x)
  cache = layer.init_cache(2)
  y1, cache = layer.decode(x[:, :13], cache)
  outs = [y1]
  for t in range(13, 21):
    yt, cache = layer.decode(x[:, t:t + 1], cache)
    outs.append(yt)
  assert rel_rmse(y, jnp.concatenate(outs, 1)) < 1e-5


def _naive_attention(q, k, v, seg, scale):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, H, _ = q.shape
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  seg = np.asarray(seg)
  mask = (np.arange(T)[:, None] >= np.arange(T)[None, :])[None] & (
      seg[:, :, None] == seg[:, None, :])
  s = np.where(mask[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("backend", ["xla", "xla_chunked", "tokamax_xla", "tokamax_xla_chunked"])
def test_attention_backends_match_naive(backend):
  rng = np.random.default_rng(3)
  B, T, H, Dk, Dv = 2, 45, 3, 24, 16
  q, k = (jnp.asarray(rng.standard_normal((B, T, H, Dk)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)
  seg = _segments(rng, B, T)
  scale = Dk ** -0.5
  if backend.startswith("tokamax"):
    o = attention.attention_tokamax(q, k, v, segment_ids=seg, scale=scale,
                                    implementation=backend[len("tokamax_"):])
  else:
    o = attention.dot_product_attention(q, k, v, segment_ids=seg, scale=scale, backend=backend,
                                        chunk_size=16)
  assert o.shape == (B, T, H, Dv)
  assert rel_rmse(_naive_attention(q, k, v, seg, scale), o) < 1e-5


@pytest.mark.parametrize("backward", ["autodiff", "flash"])
def test_chunked_attention_gradients_match_full(backward):
  """Both backwards of the one blocked softmax (autodiff of the checkpointed loops: the
  decoder's xla_chunked; FlashAttention-2: context parallel, vision) against autodiff of the
  full softmax; T = 33 with blocks of 8 (padded queries and keys); gradients finite."""
  rng = np.random.default_rng(4)
  B, T, H, Dk, Dv = 1, 33, 2, 12, 8
  q, k = (jnp.asarray(rng.standard_normal((B, T, H, Dk)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)
  seg = _segments(rng, B, T)
  w = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)
  f = lambda fn: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
  ref = f(lambda q, k, v: attention.attention_xla(q, k, v, segment_ids=seg, scale=0.3))
  pos, ids = jnp.arange(T), jnp.asarray(seg) + 1
  out = f(lambda q, k, v: flash_attention(q, k, v, pos, pos, ids, ids, scale=0.3, block_q=8,
                                          block_k=8, backward=backward))
  for a, b in zip(ref, out):
    assert np.all(np.isfinite(b))
    assert rel_rmse(a, b) < 1e-5


def test_mla_matches_numpy_forward_and_decode():
  """The whole Gated MLA layer (§3: latent down/up projections and norms, shared k_rope, NoPE
  scale, G1 gate) against an fp64 NumPy forward reading only the params; then decode."""
  seed = _seed()
  layer = MLA(CFG, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for norm in (layer.q_norm, layer.kv_norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  B, T = 2, 29
  x = jnp.asarray(rng.standard_normal((B, T, CFG.d_model)), jnp.float32)
  seg = _segments(rng, B, T)
  p = _params(layer, ("w_dq", "w_uq", "w_dkv", "w_ukv", "w_gate", "w_o"))
  p["q_norm"] = np.asarray(layer.q_norm.scale[...], np.float64)
  p["kv_norm"] = np.asarray(layer.kv_norm.scale[...], np.float64)
  y_ref = numpy_layers.mla_layer(p, np.asarray(x, np.float64), np.asarray(seg),
                                 kv_lora_rank=CFG.kv_lora_rank, nope=CFG.qk_nope_head_dim,
                                 eps=CFG.norm_eps)
  for backend in ("xla", "xla_chunked"):
    assert rel_rmse(y_ref, layer(x, segment_ids=seg, backend=backend)) < 1e-5
  # Absorbed-weight decode over the latent cache equals the prefill path (one document).
  y = layer(x)
  cache = layer.init_cache(B, T)
  y1, cache = layer.decode(x[:, :20], cache)
  outs = [y1]
  for t in range(20, T):
    yt, cache = layer.decode(x[:, t:t + 1], cache)
    outs.append(yt)
  assert rel_rmse(y, jnp.concatenate(outs, 1)) < 1e-5


def test_attnres_uniform_at_init_and_masking():
  rng = np.random.default_rng(6)
  N, B, T, D = 5, 2, 3, 8
  src = jnp.asarray(rng.standard_normal((N, B, T, D)) * rng.uniform(0.1, 10, (N, 1, 1, 1)),
                    jnp.float32)
  valid = jnp.array([True, True, True, False, False])
  partial = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  zero = jnp.zeros((D,))
  h = attnres.attnres_mix(src, valid, zero)
  np.testing.assert_allclose(h, jnp.mean(src[:3], 0), rtol=1e-5, atol=1e-6)
  h = attnres.attnres_mix(src, valid, zero, partial, True)
  np.testing.assert_allclose(h, (jnp.sum(src[:3], 0) + partial) / 4, rtol=1e-5, atol=1e-6)
  # A non-zero query: softmax over w · RMSNorm(s_j) (naive).
  w = jnp.asarray(rng.standard_normal(D), jnp.float32)
  s = np.asarray(src[:3], np.float64)
  keys = s / np.sqrt(np.mean(s ** 2, -1, keepdims=True) + 1e-6)
  a = np.exp(keys @ np.asarray(w, np.float64))
  a /= a.sum(0)
  np.testing.assert_allclose(attnres.attnres_mix(src, valid, w), np.sum(a[..., None] * s, 0),
                             rtol=1e-5, atol=1e-5)
  # Gradients stay finite with -inf masked slots.
  g = jax.grad(lambda w: jnp.sum(attnres.attnres_mix(src, valid, w, partial, False)))(w)
  assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) > 0


def _attnres_mix_fp64(s, valid, w, p, p_valid, eps=1e-6):
  """h = sum_j alpha_j s_j, alpha = softmax_j over the valid sources (and p when p_valid) of
  w . s_j / sqrt(mean(s_j^2) + eps): ARCHITECTURE §4, in fp64 jnp (autodiff gives the
  reference gradients)."""
  srcs = [s[j] for j in range(s.shape[0]) if valid[j]] + ([p] if p_valid else [])
  logits = jnp.stack([jnp.sum(x * w, -1) / jnp.sqrt(jnp.mean(x * x, -1) + eps) for x in srcs])
  a = jnp.exp(logits - jnp.max(logits, 0))
  a = a / jnp.sum(a, 0)
  return sum(a[j][..., None] * x for j, x in enumerate(srcs))


@pytest.mark.parametrize("dots,fenced", [(True, False), (False, False), (False, True)],
                         ids=["dots", "products", "products_fenced"])
@pytest.mark.parametrize("dtype,p_valid", [(jnp.float32, True), (jnp.float32, False),
                                           (jnp.float32, None), (jnp.bfloat16, True)])
def test_attnres_mix_gradients_match_fp64_reference(dtype, p_valid, dots, fenced, monkeypatch):
  """The hand-written backward of attnres_mix (sources, query, partial) against autodiff of the
  naive fp64 formula; masked slots (zeros, as in an unfilled stack) get zero gradient.
  p_valid None: no partial source at all (attnres_full's reads). The three ways the platforms
  run it (`attnres._dots`: dots on XLA:CPU, products and sums elsewhere; XLA:GPU's
  optimization barriers, `attnres._separate_passes`) run here on any platform."""
  monkeypatch.setattr(attnres, "_dots", lambda: dots)
  monkeypatch.setattr(attnres, "_separate_passes", lambda: fenced)
  rng = np.random.default_rng(9)
  N, B, T, D = 5, 2, 7, 32
  valid = np.array([True, True, True, False, False])
  s = rng.standard_normal((N, B, T, D)) * rng.uniform(0.1, 10, (N, 1, 1, 1)) * valid[:, None,
                                                                                       None, None]
  p = rng.standard_normal((B, T, D)) * 3
  w = rng.standard_normal(D)  # large enough that the softmax is far from uniform
  dh = rng.standard_normal((B, T, D))
  src = jnp.asarray(s, dtype)
  s64 = np.asarray(src.astype(jnp.float32), np.float64)  # the rounded sources
  with jax.enable_x64(True):
    ref = jax.grad(lambda s_, w_, p_: jnp.sum(_attnres_mix_fp64(s_, valid, w_, p_, bool(p_valid))
                                              * dh),
                   argnums=(0, 1, 2))(jnp.asarray(s64), jnp.asarray(w), jnp.asarray(p))
    ref = [np.asarray(r) for r in ref]
    h_ref = np.asarray(_attnres_mix_fp64(jnp.asarray(s64), valid, jnp.asarray(w), jnp.asarray(p),
                                         bool(p_valid)))
  h = attnres.attnres_mix(src, jnp.asarray(valid), jnp.asarray(w, jnp.float32),
                          None if p_valid is None else jnp.asarray(p, jnp.float32), bool(p_valid))
  assert np.max(np.abs(np.asarray(h, np.float64) - h_ref)) / np.max(np.abs(h_ref)) < 1e-5
  out = jax.grad(lambda s_, w_, p_: jnp.sum(attnres.attnres_mix(
      s_, jnp.asarray(valid), w_, None if p_valid is None else p_, bool(p_valid))
      * jnp.asarray(dh, jnp.float32)), argnums=(0, 1, 2))(
      src, jnp.asarray(w, jnp.float32), jnp.asarray(p, jnp.float32))
  assert out[0].dtype == dtype and out[1].dtype == out[2].dtype == jnp.float32
  tol = 1e-5 if dtype == jnp.float32 else 8e-3  # bf16: ds is rounded to bf16
  for name, r, o in zip(("d_sources", "d_query", "d_partial"), ref, out):
    err = np.max(np.abs(np.asarray(o, np.float64) - r)) / max(np.max(np.abs(r)), 1e-30)
    assert err < (tol if name == "d_sources" else 1e-5), (name, err)
  assert not np.any(np.asarray(out[0][3:], np.float32))  # masked slots
  if not p_valid:
    assert not np.any(np.asarray(out[2]))


def test_attnres_stream_blocks():
  """Block stream: sources are b_0, finished blocks and the current partial sum."""
  cfg = dataclasses.replace(CFG, attnres_block_layers=4)
  rng = np.random.default_rng(7)
  emb = jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32)
  ys = [jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32) for _ in range(5)]
  zero = jnp.zeros((4,))
  st = attnres.init_stream(cfg, emb)
  st = attnres.open_block(cfg, st, True)  # layer 0: nothing to commit
  np.testing.assert_allclose(attnres.sublayer_input(cfg, st, zero), emb, rtol=1e-6)
  st = attnres.add_output(cfg, st, ys[0])
  st = attnres.add_output(cfg, st, ys[1])
  np.testing.assert_allclose(attnres.sublayer_input(cfg, st, zero), (emb + ys[0] + ys[1]) / 2,
                             rtol=1e-5)
  st = attnres.open_block(cfg, st, jnp.asarray(True))
  assert int(st["count"]) == 2 and not bool(st["has_partial"])
  st = attnres.add_output(cfg, st, ys[2])
  np.testing.assert_allclose(attnres.sublayer_input(cfg, st, zero),
                             (emb + (ys[0] + ys[1]) + ys[2]) / 3, rtol=1e-5)
  st_traced = attnres.open_block(cfg, st, jnp.asarray(False))  # not a block start: no commit
  assert int(st_traced["count"]) == 2
  for k in st:
    np.testing.assert_array_equal(st_traced[k], st[k])
  # a static False (the layers inside a block) traces no stack write at all
  assert attnres.open_block(cfg, st, False) is st
  jaxpr = jax.make_jaxpr(lambda s: attnres.open_block(cfg, s, False))(st)
  assert not [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dynamic_update_slice"]


def test_attnres_full_and_standard_streams():
  rng = np.random.default_rng(8)
  emb = jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32)
  ys = [jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32) for _ in range(3)]
  zero = jnp.zeros((4,))
  full = dataclasses.replace(CFG, residual="attnres_full")
  st = attnres.init_stream(full, emb)
  assert st["stack"].shape[0] == 1 + 2 * full.num_layers
  for y in ys:
    st = attnres.add_output(full, attnres.open_block(full, st, True), y)
  assert int(st["count"]) == 4
  np.testing.assert_allclose(attnres.sublayer_input(full, st, zero), (emb + sum(ys)) / 4,
                             rtol=1e-5)
  std = dataclasses.replace(CFG, residual="standard")
  st = attnres.init_stream(std, emb)
  for y in ys:
    st = attnres.add_output(std, attnres.open_block(std, st, True), y)
  np.testing.assert_allclose(attnres.final_output(std, st, zero), emb + sum(ys), rtol=1e-5)


def test_splash_attention_interpret_matches_xla():
  """The TPU path (Pallas splash attention, v padded to 192) in interpret mode on CPU."""
  rng = np.random.default_rng(9)
  B, T, H, Dk, Dv = 1, 256, 2, 192, 128
  q, k = (jnp.asarray(rng.standard_normal((B, T, H, Dk)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((B, T, H, Dv)), jnp.float32)
  seg = jnp.asarray(np.r_[np.ones(100), 2 * np.ones(156)][None].astype(np.int32))
  o = attention.attention_splash(q, k, v, segment_ids=seg, scale=Dk ** -0.5, interpret=True,
                                 block=128)
  ref = _naive_attention(q, k, v, seg, Dk ** -0.5)
  assert rel_rmse(ref, o) < 1e-5
