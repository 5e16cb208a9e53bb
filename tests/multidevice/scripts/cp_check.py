"""Context parallel KDA / short conv / attention vs single device on 8 fake CPU devices.

Run by tests/multidevice/test_context_parallel.py in a subprocess. Prints "OK <case> ..." per
case; exits 1 on failure.
"""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import chunk_kda
from sparse_lm import sharding as shd
from sparse_lm.model import context_parallel as cp
from sparse_lm.model import kda

FAILED = []


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def report(name, errs, tol):
  ok = all(np.isfinite(errs)) and max(errs) < tol
  print(("OK " if ok else "FAIL ") + f"{name} errs={[f'{e:.1e}' for e in errs]}", flush=True)
  if not ok:
    FAILED.append(name)


def kda_inputs(key, B, T, H, K, V):
  ks = jax.random.split(key, 6)
  q = jax.random.normal(ks[0], (B, T, H, K))
  k = jax.random.normal(ks[1], (B, T, H, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  v = jax.random.normal(ks[2], (B, T, H, V))
  g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)) - 2.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  return q, k, v, g, beta


def seg_ids(B, T, boundaries):
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = sorted(boundaries[b])
    sid, start = 1, 0
    for c in cuts + [T]:
      seg[b, start:c] = sid
      sid, start = sid + 1, c
  return jnp.asarray(seg)


def under_layout(check):
  """Run `check(name, layout, ...)` under its layout's rules (`expert_shards=context` puts the
  sequence on expert x context; the CP functions read the sequence axes from the rules)."""
  def run(name, layout, *args, **kw):
    lay = shd.MeshLayout.parse(layout)
    with shd.use_mesh(None, lay.rules):
      return check(name, layout, *args, **kw)
  return run


@under_layout
def check_kda(name, layout, T, *, segs=None, B=2, H=2, K=16, V=8, chunk=16, want_final=False,
              fold=None, backend="xla", gate_lower_bound=None):
  mesh = shd.make_mesh(shd.MeshLayout.parse(layout))
  q, k, v, g, beta = kda_inputs(jax.random.key(T + len(name)), B, T, H, K, V)
  w = jax.random.normal(jax.random.key(1), (B, T, H, V))
  ws = jax.random.normal(jax.random.key(2), (B, H, K, V))

  def loss(fn):
    def f(q, k, v, g, beta):
      o, S = fn(q, k, v, g, beta)
      out = jnp.sum(o * w)
      if want_final:
        out = out + jnp.sum(S * ws)
      return out, (o, S)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))

  ref = loss(lambda *a: chunk_kda(*a, segment_ids=segs, chunk_size=chunk, backend="xla",
                                  output_final_state=want_final))
  # backend="pallas_tpu": the Mosaic kernels in Pallas interpret mode (XLA:CPU arithmetic),
  # inside the shard_map, including the width-(V + K) [v | 0], [0 | I] pass
  par = loss(lambda *a: cp.cp_chunk_kda(*a, mesh=mesh, segment_ids=segs, chunk_size=chunk,
                                        backend=backend, output_final_state=want_final,
                                        fold=fold, interpret=backend == "pallas_tpu",
                                        gate_lower_bound=gate_lower_bound))
  (l0, (o0, S0)), g0 = ref(q, k, v, g, beta)
  (l1, (o1, S1)), g1 = par(q, k, v, g, beta)
  errs = [rel(o1, o0), rel(l1, l0)] + [rel(a, b) for a, b in zip(g1, g0)]
  if want_final:
    errs.append(rel(S1, S0))
  report(name, errs, 2e-5)


@under_layout
def check_conv(name, layout, T, segs, B=2, C=6, W=4):
  mesh = shd.make_mesh(shd.MeshLayout.parse(layout))
  x = jax.random.normal(jax.random.key(3), (B, T, C))
  w = jax.random.normal(jax.random.key(4), (W, C))

  def ref(x, w):
    xp = jnp.pad(x, ((0, 0), (W - 1, 0), (0, 0)))
    sp = jnp.pad(segs, ((0, 0), (W - 1, 0)), constant_values=-1)
    return sum(jnp.where((sp[:, i:i + T] == segs)[..., None], xp[:, i:i + T], 0) * w[i]
               for i in range(W))

  y0 = ref(x, w)
  y1 = jax.jit(lambda x, w: kda.cp_short_conv(x, w, segs, mesh=mesh))(x, w)
  gr = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, w)
  g0 = gr(ref)
  g1 = jax.jit(lambda x, w: gr(lambda x, w: kda.cp_short_conv(x, w, segs, mesh=mesh)))(x, w)
  report(name, [rel(y1, y0)] + [rel(a, b) for a, b in zip(g1, g0)], 1e-5)


@under_layout
def check_attn(name, layout, T, segs, B=2, H=4, Hk=1, Dk=8, Dv=6, block=8):
  mesh = shd.make_mesh(shd.MeshLayout.parse(layout))
  ks = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(ks[0], (B, T, H, Dk))
  k = jax.random.normal(ks[1], (B, T, Hk, Dk))
  v = jax.random.normal(ks[2], (B, T, Hk, Dv))
  scale = Dk ** -0.5

  def ref(q, k, v):
    kk = jnp.broadcast_to(k, (B, T, H, Dk))
    vv = jnp.broadcast_to(v, (B, T, H, Dv))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    vis = jnp.tril(jnp.ones((T, T), bool))[None, None] & (
        segs[:, None, :, None] == segs[:, None, None, :])
    p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv)

  par = lambda q, k, v: cp.cp_attention(q, k, v, mesh=mesh, segment_ids=segs, scale=scale,
                                        block=block)
  gr = lambda f: jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))
  l0, g0 = jax.jit(gr(ref))(q, k, v)
  l1, g1 = jax.jit(gr(par))(q, k, v)
  report(name, [rel(l1, l0)] + [rel(a, b) for a, b in zip(g1, g0)], 1e-5)


EP_CP = "expert=2,context=2,fsdp=2,expert_shards=context"


def main():
  which = sys.argv[1] if len(sys.argv) > 1 else "all"
  T = 72  # over CP 4: 18 tokens per shard, not a multiple of the chunk (16)
  segs = seg_ids(2, T, [[5, 30, 54], [20, 36]])  # docs crossing shard boundaries 18/36/54,
  # one starting exactly on a boundary (36 and 54)
  cases = [
      ("kda_cp2_fsdp2_tensor2", lambda: check_kda("kda_cp2_fsdp2_tensor2",
                                                  "context=2,fsdp=2,tensor=2", 40)),
      ("kda_nocp_fsdp4_tensor2", lambda: check_kda("kda_nocp_fsdp4_tensor2",
                                                   "fsdp=4,tensor=2", T, segs=segs,
                                                   want_final=True)),
      ("kda_cp4_segments", lambda: check_kda("kda_cp4_segments", "context=4,fsdp=2", T,
                                             segs=segs, want_final=True)),
      # the log-depth prefix exchange (the default above 8 shards), forced at CP 4 and 8
      ("kda_cp4_prefix_segments", lambda: check_kda("kda_cp4_prefix_segments",
                                                    "context=4,fsdp=2", T, segs=segs,
                                                    want_final=True, fold="prefix")),
      ("kda_cp8_prefix", lambda: check_kda("kda_cp8_prefix", "context=8", 8 * 9,
                                           segs=segs, want_final=True, fold="prefix")),
      ("kda_cp4_padding", lambda: check_kda(
          "kda_cp4_padding", "context=4,data=2", T,
          segs=segs.at[0, 10:40].set(0).at[1, 50:].set(0), chunk=32)),
      ("conv_cp4", lambda: check_conv("conv_cp4", "context=4,fsdp=2", T, segs)),
      ("attn_cp4_mqa", lambda: check_attn("attn_cp4_mqa", "context=4,fsdp=2", T, segs)),
      ("attn_cp2_heads", lambda: check_attn("attn_cp2_heads", "context=2,tensor=2,fsdp=2", T,
                                            segs, Hk=4)),
      # the sequence over expert x context (MeshLayout.expert_shards="context"): 4 shards of
      # 18 tokens, shard index expert-major
      ("kda_ep2xcp2_segments", lambda: check_kda("kda_ep2xcp2_segments",
                                                 EP_CP, T, segs=segs, want_final=True)),
      ("kda_ep2xcp2_prefix", lambda: check_kda("kda_ep2xcp2_prefix", EP_CP, T, segs=segs,
                                               want_final=True, fold="prefix")),
      ("conv_ep2xcp2", lambda: check_conv("conv_ep2xcp2", EP_CP, T, segs)),
      ("attn_ep2xcp2_mqa", lambda: check_attn("attn_ep2xcp2_mqa", EP_CP, T, segs)),
      # the pallas_tpu kernels (interpret mode) under CP 4, safe and dense diagonal tiles
      ("kda_cp4_pallas_interpret_safe", lambda: check_kda(
          "kda_cp4_pallas_interpret_safe", "context=4,fsdp=2", T, segs=segs,
          want_final=True, backend="pallas_tpu")),
      ("kda_cp4_pallas_interpret_dense", lambda: check_kda(
          "kda_cp4_pallas_interpret_dense", "context=4,fsdp=2", T, segs=segs,
          want_final=True, backend="pallas_tpu", gate_lower_bound=-5.0)),
  ]
  # Two real devices (run with `2dev`): CP 2, 36 tokens per shard (not a multiple of 16).
  two_device = [
      ("kda_cp2_segments_2dev", lambda: check_kda("kda_cp2_segments_2dev", "context=2", T,
                                                  segs=segs, want_final=True)),
      ("kda_cp2_prefix_2dev", lambda: check_kda("kda_cp2_prefix_2dev", "context=2", T,
                                                segs=segs, want_final=True, fold="prefix")),
      ("conv_cp2_2dev", lambda: check_conv("conv_cp2_2dev", "context=2", T, segs)),
      ("attn_cp2_mqa_2dev", lambda: check_attn("attn_cp2_mqa_2dev", "context=2", T, segs)),
      ("kda_ep2_seq_2dev", lambda: check_kda("kda_ep2_seq_2dev", "expert=2,expert_shards=context",
                                             T, segs=segs, want_final=True)),
  ]
  if which == "2dev":
    cases, which = two_device, "all"
  for name, fn in cases:
    if which == "all" or which in name:
      fn()
  if FAILED:
    print("FAILED:", FAILED)
    sys.exit(1)


if __name__ == "__main__":
  main()
