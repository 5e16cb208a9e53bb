"""Audit (hand mutation testing of the context-parallel Gated MLA path): `mla_latent_attention`
(sparse_lm/model/mla.py), `cp_attention` / `_attn_cp_body` (sparse_lm/model/context_parallel.py)
and the blocked softmax they call, on 8 fake CPU devices, against float64 NumPy written from
ARCHITECTURE §3 (reading only the input and parameter arrays, never the code under test).

Before this file only the sharded train step (tests/multidevice/test_sharded_train.py, ~90 s a
layout) ran the latent path, and only against the single-device model (a wrong scale or a
dropped segment mask that both paths share would pass; the latent form is CP-only).

- `mla_latent_attention` under context=4 (and the sequence over expert x context): q [B,T,H,
  nope+rope], the latent [c_kv; k_rope] and w_ukv against the expanded per-head attention
  k_h = [c_kv W_uk_h; k_rope], v_h = c_kv W_uv_h, softmax(q k^T scale + causal/segment mask) v,
  with every width distinct (kv_lora 12, nope 8, rope 4, v 6, H 3: a swapped split or a
  misaligned concat changes the numbers or the shapes), 10 tokens per shard (not a multiple of
  the block, 8), documents crossing shard boundaries and one starting on one, and padding
  (segment 0), whose rows must be exactly 0 (`flash_attention`'s contract: a query that sees
  no key gets a zero row); again without segment ids, and with every logit shifted by about
  -120 (softmax is shift-invariant: the blocked softmax must not underflow).
- The whole `MLA` layer called under a context=4 mesh (the "latent" branch of `MLA.__call__`:
  latent RMSNorm, scale 1/sqrt(nope + rope), segment ids, G1 gate, W_o) against the NumPy layer
  of tests/model/numpy_layers.py on the real (non-padding) tokens.
Tolerance: relative RMSE 1e-5 in fp32 (the layer tests' bound, tests/model/test_layers.py).
"""

# the 8-device subprocess runner of the expert-parallel audit (its prelude imports jax, jnp, np)
from tests.multidevice.test_audit_parallel import _run


BODY = """
import dataclasses
from flax import nnx
from sparse_lm import sharding as shd
from sparse_lm.config import get_preset
from sparse_lm.model.context_parallel import mla_under_mesh
from sparse_lm.model.mla import MLA, mla_latent_attention
from tests.model import numpy_layers as npl


def rel(ref, out):
  ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
  return float(np.linalg.norm(ref - out) / np.linalg.norm(ref))


def segments(T):
  # T = 40 over 4 shards of 10: row 0 documents cross 10 and 30, one starts on 20, padding
  # from 36; row 1 one document crossing every boundary up to 33, then a second.
  seg = np.zeros((2, T), np.int32)
  seg[0, :7], seg[0, 7:20], seg[0, 20:36] = 1, 2, 3
  seg[1, :33], seg[1, 33:] = 1, 2
  return seg


def ref_attention(q, c_kv, k_rope, w_ukv, seg, nope, scale):
  # expanded form, one head at a time, float64
  B, T, H, _ = q.shape
  out = np.zeros((B, T, H, w_ukv.shape[-1] - nope))
  for h in range(H):
    k = np.concatenate([c_kv @ w_ukv[:, h, :nope], k_rope], -1)  # [B, T, nope + rope]
    v = c_kv @ w_ukv[:, h, nope:]
    for b in range(B):
      for i in range(T):
        vis = [j for j in range(i + 1) if seg[b, j] == seg[b, i] and seg[b, i] != 0]
        if not vis:
          continue  # padding query: zero row
        s = np.array([q[b, i, h] @ k[b, j] for j in vis]) * scale
        p = np.exp(s - s.max())
        out[b, i, h] = (p / p.sum()) @ v[b, vis]
  return out


def check_latent(layout):
  lay = shd.MeshLayout.parse(layout)
  mesh = shd.make_mesh(lay)
  rng = np.random.default_rng(11)
  B, T, H, C, nope, R, V = 2, 40, 3, 12, 8, 4, 6
  q = rng.standard_normal((B, T, H, nope + R))
  c_kv = rng.standard_normal((B, T, C))
  k_rope = rng.standard_normal((B, T, R))
  w_ukv = rng.standard_normal((C, H, nope + V)) / np.sqrt(C)
  seg = segments(T)
  scale = 0.37  # not 1/sqrt of any width here: the scale must be the one passed
  want = ref_attention(q, c_kv, k_rope, w_ukv, seg, nope, scale)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  with shd.use_mesh(mesh, lay.rules):
    got = jax.jit(lambda *a: mla_latent_attention(
        *a, nope_dim=nope, scale=scale, mesh=mesh, segment_ids=jnp.asarray(seg), block=8))(
            f32(q), f32(c_kv), f32(k_rope), f32(w_ukv))
  got = np.asarray(got, np.float64)
  assert got.shape == (B, T, H, V), got.shape
  real = seg > 0
  e = rel(want[real], got[real])
  assert e < 1e-5, (layout, e)
  assert np.all(got[~real] == 0), (layout, np.abs(got[~real]).max())
  # a second call without segment ids: one causal document per row
  with shd.use_mesh(mesh, lay.rules):
    got1 = jax.jit(lambda *a: mla_latent_attention(*a, nope_dim=nope, scale=scale, mesh=mesh,
                                                   block=8))(
        f32(q), f32(c_kv), f32(k_rope), f32(w_ukv))
  want1 = ref_attention(q, c_kv, k_rope, w_ukv, np.ones((B, T), np.int32), nope, scale)
  e1 = rel(want1, got1)
  assert e1 < 1e-5, (layout, e1)
  # every logit of a query shifted by the same large negative amount (-120 / scale x scale):
  # the softmax is unchanged, so the output must be too (a running max started at 0 instead
  # of -inf would underflow every probability to 0)
  qs, ks = q.copy(), k_rope.copy()
  qs[..., nope] -= 12.0 / scale
  ks[..., 0] = 10.0
  want2 = ref_attention(qs, c_kv, ks, w_ukv, seg, nope, scale)
  with shd.use_mesh(mesh, lay.rules):
    got2 = jax.jit(lambda *a: mla_latent_attention(
        *a, nope_dim=nope, scale=scale, mesh=mesh, segment_ids=jnp.asarray(seg), block=8))(
            f32(qs), f32(c_kv), f32(ks), f32(w_ukv))
  e2 = rel(want2[real], np.asarray(got2)[real])
  assert e2 < 1e-5, (layout, e2)
  print(f"OK latent {layout} {e:.1e} {e1:.1e} {e2:.1e}")


def check_layer():
  cfg = get_preset("tiny", d_model=32, mla_num_heads=3, q_lora_rank=16, kv_lora_rank=12,
                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                   attention_chunk_size=8)
  layer = MLA(cfg, rngs=nnx.Rngs(5))
  rng = np.random.default_rng(5)
  for norm in (layer.q_norm, layer.kv_norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  p = {n: np.asarray(getattr(layer, n)[...], np.float64)
       for n in ("w_dq", "w_uq", "w_dkv", "w_ukv", "w_gate", "w_o")}
  p["q_norm"] = np.asarray(layer.q_norm.scale[...], np.float64)
  p["kv_norm"] = np.asarray(layer.kv_norm.scale[...], np.float64)
  B, T = 2, 40
  x = rng.standard_normal((B, T, cfg.d_model))
  seg = segments(T)
  # the NumPy layer treats id 0 as one more segment; compare the real tokens only
  want = npl.mla_layer(p, x, seg, kv_lora_rank=cfg.kv_lora_rank, nope=cfg.qk_nope_head_dim,
                       eps=cfg.norm_eps)
  lay = shd.MeshLayout.parse("context=4,fsdp=2")
  mesh = shd.make_mesh(lay)
  with shd.use_mesh(mesh, lay.rules):
    assert mla_under_mesh(mesh, cfg.attention_backend) == "latent"
  graph, state = nnx.split(layer)

  @jax.jit
  def fwd(state, x, seg):
    with shd.use_mesh(mesh, lay.rules):
      return nnx.merge(graph, state)(x, segment_ids=seg)

  got = np.asarray(fwd(state, jnp.asarray(x, jnp.float32), jnp.asarray(seg)), np.float64)
  real = seg > 0
  e = rel(want[real], got[real])
  assert e < 1e-5, e
  print(f"OK layer context=4 {e:.1e}")


check_latent("context=4,fsdp=2")
check_latent("expert=2,context=2,fsdp=2,expert_shards=context")
check_layer()
"""


def test_cp_mla_latent_attention_and_layer_match_numpy():
  out = _run(BODY)
  assert out.count("OK ") == 3, out
