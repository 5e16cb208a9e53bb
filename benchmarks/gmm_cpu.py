"""Grouped-matmul backends on the host CPU: forward + backward time of `moe.gmm.gmm`.

    taskset -c 1 python -m benchmarks.gmm_cpu                # M=4096 K=32 N=64 G=64
    python -m benchmarks.gmm_cpu --m 2048 --groups 8 --repeats 10

For each backend (ragged_dot: XLA's jax.lax.ragged_dot, the CPU default; blocked:
`gmm.blocked_gmm`) the jitted gradient of sum(gmm(lhs, rhs, sizes)) with respect to lhs and
rhs is timed: median of --repeats calls after a compile call. Groups are equal-sized (M / G
rows each). Prints one line per backend and the ratio.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparse_lm.moe import gmm as gmm_lib


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--m", type=int, default=4096, help="rows (tokens x experts per token)")
  p.add_argument("--k", type=int, default=32)
  p.add_argument("--n", type=int, default=64)
  p.add_argument("--groups", type=int, default=64, help="experts")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args(argv)
  for flag, value in (("--m", args.m), ("--k", args.k), ("--n", args.n),
                      ("--groups", args.groups), ("--repeats", args.repeats)):
    if value < 1:
      p.error(f"{flag} {value}: expected a positive integer")
  if args.m % args.groups:  # equal groups of M / G rows: the rest would silently not count
    p.error(f"--m {args.m} must be a multiple of --groups {args.groups} (equal-sized groups)")
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((args.m, args.k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((args.groups, args.k, args.n)), jnp.float32)
  sizes = jnp.full((args.groups,), args.m // args.groups, jnp.int32)
  times = {}
  for backend in ("ragged_dot", "blocked"):
    f = jax.jit(jax.grad(lambda l, r, b=backend: gmm_lib.gmm(l, r, sizes, backend=b).sum(),
                         argnums=(0, 1)))
    jax.block_until_ready(f(lhs, rhs))
    ts = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(f(lhs, rhs))
      ts.append(time.perf_counter() - t0)
    times[backend] = statistics.median(ts)
    print(f"{backend:>10}: {1e3 * times[backend]:8.2f} ms  (M={args.m} K={args.k} N={args.n} "
          f"G={args.groups}, forward + backward, median of {args.repeats})")
  print(f"ragged_dot / blocked = {times['ragged_dot'] / times['blocked']:.1f}x")


if __name__ == "__main__":
  main()
