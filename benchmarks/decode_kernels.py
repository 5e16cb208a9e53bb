"""Device time and kernel count of each fused decode kernel (pallas_kernels.decode) against the
pure-JAX ops it replaces, at the small preset's shapes, batch 1 (GPU).

    python -m benchmarks.decode_kernels [--repeats 50] [--variants]

For each case, one jitted call is traced `--repeats` times with jax.profiler; printed: device
time per call (the sum of its kernels' durations, not wall time), kernels per call, and the
largest kernels. --variants also times the kernels' tuning knobs (warps, hidden block, dot).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.decode import attnres_mix, moe_experts
from sparse_lm.config import get_preset
from sparse_lm.inference import cache as cache_lib, engine as engine_lib, forward as forward_lib
from sparse_lm.inference import fused
from sparse_lm.model import attnres
from sparse_lm.model.kda import KDA
from sparse_lm.nn import rms_norm


def device_ops(trace_dir: str) -> tuple[float, int, collections.Counter, collections.Counter]:
  """(total us, events, us per name, events per name) on the GPU tracks of the newest trace."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                          recursive=True), key=os.path.getmtime)[-1]
  with gzip.open(path) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and "/device:" in e["args"].get("name", "") and "CPU" not in e["args"]["name"]}
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e["pid"] in pids:
      total[e["name"]] += e.get("dur", 0)
      count[e["name"]] += 1
  return sum(total.values()), sum(count.values()), total, count


def measure(name: str, fn, args, repeats: int) -> None:
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(repeats):
        jax.block_until_ready(f(*args))
    us, n, total, count = device_ops(d)
  top = ", ".join(f"{k[:40]} {total[k] / count[k]:.1f}us" for k, _ in total.most_common(4))
  print(f"{name:42s} {us / repeats:8.2f} us/call  {n / repeats:6.1f} kernels/call  [{top}]",
        flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repeats", type=int, default=50)
  p.add_argument("--variants", action="store_true")
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats}: expected a positive integer")
  if jax.default_backend() != "gpu":  # before anything compiles (it failed in a Pallas lowering)
    p.error(f"needs a GPU: the fused decode kernels are Pallas Triton kernels and the times are "
            f"GPU kernel durations (this host's backend: {jax.default_backend()})")
  R = args.repeats
  cfg = get_preset("small", decode_backend="pallas")
  dt = jnp.dtype(cfg.dtype)
  key = iter(jax.random.split(jax.random.key(0), 64))
  rnd = lambda shape, s=1.0, d=jnp.float32: (s * jax.random.normal(next(key), shape)).astype(d)
  print(f"decode kernels, small preset shapes, batch 1, on {jax.devices()[0].device_kind}")

  # KDA: one layer's step from its cache (projections included in both)
  mixer = KDA(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(mixer)
  state = engine_lib._weights(graphdef, state, cfg)  # kernels in bf16, as the engine holds them
  cache = jax.tree.map(lambda a: rnd(a.shape, 0.5, a.dtype), cache_lib.init_cache(cfg, 1, 16)[0])
  x = rnd((1, 1, cfg.d_model), 1.0, dt)
  nv = jnp.ones((1,), jnp.int32)
  measure("KDA layer, pure JAX (kda_cached)",
          lambda s, x, c: forward_lib.kda_cached(nnx.merge(graphdef, s), x, c, nv),
          (state, x, cache), R)
  # the input projections' matrix prebuilt once, as the engine holds it
  w_in = fused.kda_input_matrix(nnx.merge(graphdef, state).arrays(), dt)
  for w in ((4, 8) if args.variants else (4,)):
    measure(f"KDA layer, kda_step kernel (warps {w})",
            lambda s, x, c, wi, w=w: fused.kda_step_fused(
                nnx.merge(graphdef, s), x, c, nv, pad=forward_lib.pad_rows, rows=2,
                interpret=False, num_warps=w, w_in=wi),
            (state, x, cache, w_in), R)

  # AttnRes read + pre-norm (5 sources, a partial sum), with the add of y
  N, D = cfg.num_attnres_blocks, cfg.d_model
  stream = {"stack": rnd((N, 1, 1, D), 1.0, dt), "count": jnp.int32(N - 1),
            "partial": rnd((1, 1, D)), "has_partial": jnp.bool_(True)}
  q, sc, y = rnd((D,)), 1.0 + rnd((D,), 0.1), rnd((1, 1, D), 1.0, dt)

  def ref_read(stream, y):
    stream = attnres.add_output(cfg, stream, y)
    return rms_norm(attnres.sublayer_input(cfg, stream, q), sc, cfg.norm_eps).astype(dt), stream
  measure("AttnRes add + read + norm, pure JAX", ref_read, (stream, y), R)
  for w in ((2, 4) if args.variants else (4,)):
    measure(f"AttnRes add + read + norm, kernel (warps {w})",
            lambda st, y, w=w: attnres_mix(
                st["stack"][:, :, 0], jnp.arange(N) < st["count"], st["partial"][:, 0], True,
                q, sc, y=y[:, 0], mix_eps=cfg.norm_eps, norm_eps=cfg.norm_eps, dtype=dt,
                num_warps=w), (stream, y), R)

  # Routed experts: 4 of 64, latent 512, hidden 1024
  E, L, F, k = cfg.num_experts, cfg.moe_latent_dim, cfg.expert_hidden, cfg.experts_per_token
  params = {"w_gate": rnd((E, L, F), 0.05, dt), "w_up": rnd((E, L, F), 0.05, dt),
            "w_down": rnd((E, F, L), 0.05, dt)}
  z = rnd((1, L), 1.0, dt)
  ids = jnp.array([[3, 17, 40, 63]], jnp.int32)
  gates = jnp.full((1, k), 0.25, jnp.float32)
  b1, b2 = cfg.glu_betas
  measure("routed experts, pure JAX (gathered_experts)",
          lambda z, p: forward_lib.gathered_experts(z, ids, gates, p, beta1=b1, beta2=b2,
                                                    min_rows=2), (z, params), R)
  grid = ([(bf, w, True) for bf in (16, 32, 64) for w in (4, 8)]
          if args.variants else [(32, 4, True)])
  for bf, w, d in grid:
    measure(f"routed experts, kernel (BF {bf}, warps {w}, dot {d})",
            lambda z, p, bf=bf, w=w, d=d: moe_experts(z, ids, gates, p, beta1=b1, beta2=b2,
                                                      block_f=bf, num_warps=w, use_dot=d),
            (z, params), R)


if __name__ == "__main__":
  main()
