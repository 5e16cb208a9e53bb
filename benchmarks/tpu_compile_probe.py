"""How much host memory the TPU compiler needs per byte of generated code, and whether a
compiler option changes it: compile one small synthetic program for compile-only TPU devices
and print its generated code size, temporaries, compile time and this process's peak RSS.

The program is `--layers` unrolled residual FFN blocks (matmul, SiLU-tanh gate, matmul, RMS
norm), each rematerialised, differentiated with respect to the two weight matrices; every layer
scales its input by a different constant so that no two layers share code. Tokens are sharded
over the devices of `--topology`. Compiler options go in `LIBTPU_INIT_ARGS` as usual:

    JAX_PLATFORMS=cpu python -m benchmarks.tpu_compile_probe --layers 8
    LIBTPU_INIT_ARGS=--xla_jf_debug_level=0 JAX_PLATFORMS=cpu \
        python -m benchmarks.tpu_compile_probe --layers 8

Needs `jax[tpu]` (libtpu) installed; no TPU. Results: docs/scaling.md ("Where the memory goes
at full scale").
"""

from __future__ import annotations

import argparse
import os
import resource
import time


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  p.add_argument("--topology", default="v5p:2x2x1")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--d-model", type=int, default=7168)
  p.add_argument("--hidden", type=int, default=2048)
  args = p.parse_args(argv)
  from sparse_lm.sharding import check_topology
  try:
    check_topology(args.topology)
  except ValueError as e:
    p.error(f"--topology: {e}")
  for name in ("layers", "tokens", "d_model", "hidden"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
  mesh = Mesh(np.array(devices), ("d",))

  def loss(x, w1, w2, g):
    def block(h):
      y = jnp.einsum("td,df->tf", h, w1)
      y = jax.nn.silu(y) * (1 + jnp.tanh(0.3 * y))
      h = h + jnp.einsum("tf,fd->td", y, w2) * jax.nn.sigmoid(g)
      ms = jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True)
      return h * jax.lax.rsqrt(ms + 1e-6).astype(h.dtype)
    h = x
    for i in range(args.layers):
      h = jax.checkpoint(block)(h * (1 + 0.01 * i))
    return jnp.sum(h.astype(jnp.float32) * x.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(1, 2)))
  spec = lambda shape, s: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                               sharding=NamedSharding(mesh, s))
  t, d, f = args.tokens, args.d_model, args.hidden
  t0 = time.time()
  compiled = grad.lower(spec((t, d), P("d", None)), spec((d, f), P()), spec((f, d), P()),
                        spec((d,), P())).compile()
  ma = compiled.memory_analysis()
  print(f"[tpu_compile_probe] LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS', '')!r} "
        f"layers={args.layers} tokens={t} d_model={d} hidden={f} topology={args.topology}: "
        f"compile {time.time() - t0:.1f} s, code {ma.generated_code_size_in_bytes / 1e6:.2f} MB, "
        f"temporaries {ma.temp_size_in_bytes / 1e9:.2f} GB, peak host RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
  main()
