"""Time and check tokamax's Mosaic GPU grouped-matmul kernels under several tile configs, and
our weight gradient (`moe.gmm.grouped_weight_grad`), at the LatentMoE shapes of a preset: the
data behind `moe.gmm.SM90_TILES` and the weight-gradient choice.

    python -m benchmarks.gmm_configs                     # small preset, 8 x 8192 tokens, top-4
    python -m benchmarks.gmm_configs --grid narrow --repeats 20

GPU only (Hopper: tokamax's sm90 kernels). For each of the experts' two matmul shapes (gate/up:
[M, L] x [E, L, F]; down: [M, F] x [E, F, L], M = tokens x top-k rows sorted by expert, L the
latent width, F the expert width), bf16 operands, it times:
  - "fwd": the ragged dot `ragged_dot(lhs, rhs, group_sizes)` (also the backward's d_lhs, which
    is the forward of the transposed weight: the other shape's row of this table), under
    tokamax's sm90 heuristic config (what `tokamax.ragged_dot` picks on an H200: its
    autotuning cache has no H200 entry) and a grid of block_m, block_k, num_stages, persistent
    and grid order;
  - "wgrad": the weight gradient [E, L, F] (lhs_g^T d_out_g per expert): tokamax's
    `ragged_contracting_dim_dot` kernel (what tokamax's own VJP runs) under its heuristic and
    the grid, and `grouped_weight_grad` at several block sizes.
Every result is checked against an exact reference (XLA's `ragged_dot` / `ragged_dot_general`
with fp32 output; on an H200 they agree with per-group fp32 loops to about 1e-5): the max
error over the largest reference entry is printed, and a result off by more than 1e-2 (bf16
rounding is ~4e-3) is marked WRONG and never picked. Group sizes: a multinomial draw of M rows
over E experts (seeded), expert 0 empty. Time per call: the median of 3 rounds of --repeats calls
dispatched back to back (the launch overhead hides behind the queued calls), after 2 warm-up
calls. A config that does not compile is reported and skipped.
"""

from __future__ import annotations

import argparse
import itertools
import time

TOLERANCE = 1e-2  # max |result - exact| / max |exact| for a result to count


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  p.add_argument("--preset", default="small", choices=("tiny", "small", "full"))
  p.add_argument("--tokens", type=int, default=8 * 8192, help="tokens per step (batch x length)")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--grid", default="full", choices=("full", "narrow"),
                 help="full: 96 tokamax configs per shape; narrow: non-persistent, M-minor, 36")
  p.add_argument("--quick", action="store_true", help="two tokamax configs only (a smoke run)")
  args = p.parse_args(argv)
  if args.tokens < 1 or args.repeats < 1:
    p.error("--tokens and --repeats must be >= 1")

  import jax
  import jax.numpy as jnp
  import numpy as np
  from sparse_lm.config import get_preset
  from sparse_lm.moe import gmm as gmm_lib

  if jax.default_backend() != "gpu":
    p.error("tokamax's Mosaic GPU kernels need a GPU (Hopper)")
  gmm_lib.tokamax_flags()
  # pylint: disable-next=g-import-not-at-top
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as pmg

  cfg = get_preset(args.preset)
  E, k = cfg.num_experts, cfg.experts_per_token
  L = cfg.moe_latent_dim if cfg.moe_latent_dim else cfg.d_model
  F = cfg.expert_hidden
  M = args.tokens * k
  rng = np.random.default_rng(0)
  sizes_np = rng.multinomial(M, np.full(E, 1.0 / E))
  sizes_np[1] += sizes_np[0]
  sizes_np[0] = 0
  sizes = jnp.asarray(sizes_np, jnp.int32)
  print(f"{jax.devices()[0].device_kind}: {args.preset}, M = {M} rows, E = {E}, L = {L}, "
        f"F = {F}; group sizes {int(sizes_np[1:].min())}..{int(sizes_np.max())}, expert 0 "
        "empty", flush=True)
  contract_rows = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])

  def timed(fn, *xs):
    f = jax.jit(fn)
    t0 = time.perf_counter()
    f.lower(*xs).compile()
    comp = time.perf_counter() - t0
    out = None
    for _ in range(2):
      out = jax.block_until_ready(f(*xs))
    ts = []
    for _ in range(3):
      t0 = time.perf_counter()
      outs = [f(*xs) for _ in range(args.repeats)]
      jax.block_until_ready(outs)
      ts.append((time.perf_counter() - t0) / args.repeats)
      del outs
    return float(np.median(ts)) * 1e3, comp, out

  dims = pmg.common.MatmulDimension  # tokamax's grid-order enum (M or N minor)
  grid = list(itertools.product((64, 128), (64, 128, 256), (2, 4), (False, True),
                                (dims.M, dims.N), (1, 4)))
  if args.grid == "narrow":  # the corner the full grid's first run favoured
    grid = list(itertools.product((64, 128), (64, 128), (2, 3, 4), (False,), (dims.M,),
                                  (1, 4, 8)))
  if args.quick:
    grid = [(64, 128, 2, False, dims.M, 1), (128, 64, 3, False, dims.M, 4)]
  keys = jax.random.split(jax.random.key(0), 3)
  best = {}
  for K, N in ((L, F), (F, L)):
    lhs = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (E, K, N), jnp.float32) / K**0.5).astype(jnp.bfloat16)
    dout = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
    flop = 2.0 * M * K * N
    exact = {
        "fwd": jax.jit(lambda a, b, g: jax.lax.ragged_dot(
            a, b, g, preferred_element_type=jnp.float32))(lhs, rhs, sizes),
        "wgrad": jax.jit(lambda a, b, g: jax.lax.ragged_dot_general(
            a, b, g, contract_rows, preferred_element_type=jnp.float32))(lhs, dout, sizes)}

    for kind in ("fwd", "wgrad"):
      label = f"{kind} [{M}, {K}] x [{E}, {K}, {N}]"
      ref = exact[kind]
      scale = float(jnp.max(jnp.abs(ref)))
      rows = []

      def report(name, fn, *xs, ref=ref, scale=scale, rows=rows):
        try:
          ms, comp, out = timed(fn, *xs)
        except Exception as e:  # pylint: disable=broad-except
          print(f"  {name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
          return
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / scale
        ok = err <= TOLERANCE
        if ok:
          rows.append((ms, name))
        print(f"  {ms:8.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}"
              f"{'' if ok else ' WRONG'}  {name} (compile {comp:.1f} s)", flush=True)

      def tokamax_call(config, kind=kind):
        op = pmg.PallasMosaicGpuRaggedDot(config=config)
        if kind == "fwd":
          return lambda a, b, g: op(a, b, group_sizes=g, preferred_element_type=a.dtype)
        return lambda a, b, g: op(a, b, group_sizes=g, ragged_dot_dimension_numbers=contract_rows,
                                  preferred_element_type=a.dtype)

      second = rhs if kind == "fwd" else dout
      print(label, flush=True)
      report("tokamax heuristic", tokamax_call(None), lhs, second, sizes)
      for bm, bk, st, pers, minor, width in grid:
        if kind == "wgrad" and (pers or minor != dims.M or width != 1):
          continue  # the contracting kernel reads only block_m, block_n, block_k, num_stages
        config = pmg.Config(block_m=bm, block_n=64, block_k=bk, num_stages=st, split_k=1,
                            persistent=pers, grid_minor_dim=minor, grid_tile_width=width)
        report(f"tokamax block_m={bm} block_k={bk} num_stages={st} persistent={pers} "
               f"grid_minor_dim={minor.name} grid_tile_width={width}",
               tokamax_call(config), lhs, second, sizes)
      if kind == "wgrad":
        for block in (512, 1024, 2048):
          report(f"grouped_weight_grad block={block}",
                 lambda a, b, g, block=block: gmm_lib.grouped_weight_grad(a, b, g, block=block),
                 lhs, dout, sizes)
      report("tokamax heuristic (again)", tokamax_call(None), lhs, second, sizes)
      if rows:
        ms, name = min(rows)
        best[label] = (ms, name, flop / ms / 1e9)
  print(f"fastest result within {TOLERANCE:g} of exact, per kernel and shape:")
  for label, (ms, name, tf) in best.items():
    print(f"  {label}: {ms:.3f} ms, {tf:.0f} TFLOP/s, {name}")


if __name__ == "__main__":
  main()
