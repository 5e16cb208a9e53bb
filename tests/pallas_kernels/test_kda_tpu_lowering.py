"""AOT-compile the pallas_tpu KDA kernels for real TPU generations, without a TPU.

Where libtpu is installed (it is in requirements, so CI runs this), `jax.experimental.topologies`
gives device descriptions for v5p, v6e and TPU7x; jitting against a one-device mesh of them and
calling `.compile()` runs the Mosaic and XLA:TPU compilers for that chip. This checks that every
kernel lowers (block shapes, layouts, ops Mosaic supports) and reports the compiled memory.
Shape of the issue: B=1, T=8192, H=8, K=V=128, bf16 (grid: 8 heads × 128 chunks of 64).
Skipped, with the reason, only where libtpu is missing.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

# Several processes may compile for TPU at once (CI, other tests): skip libtpu's lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

from pallas_kernels.kda import pallas_tpu  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu (jax[tpu]) is not installed: no TPU compiler")

B, T, H, K, V = 1, 8192, 8, 128, 128
TOPOLOGIES = ("v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1")
# The pallas_call names of pallas_kernels/kda/pallas_tpu.py: forward and backward, dense
# diagonal tiles (bounded gate) and safe (unbounded gate).
KERNELS = ("kda_fwd_dense", "kda_fwd_safe", "kda_bwd_dense", "kda_bwd_safe")


def _compile(topology: str, fn, args):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  mesh = Mesh(topo.devices[:1], ("d",))
  sh = NamedSharding(mesh, PartitionSpec())
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args]
  return jax.jit(fn, in_shardings=sh, out_shardings=sh).lower(*specs).compile()


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_forward_and_backward_compile(topology):
  """One jit holding the inference forward (dense diagonal tiles, the bounded-gate path), and
  forward + backward of both the dense and the safe (unbounded-gate) paths."""
  bf = jnp.bfloat16
  args = [jax.ShapeDtypeStruct(s, bf) for s in
          ((B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H))]

  def fwd(diag, q, k, v, g, beta):
    return pallas_tpu.chunk_kda_pallas_tpu(q, k, v, g, beta, diag=diag, output_final_state=True)

  def grads(diag, *xs):
    def loss(*xs):
      o, S = fwd(diag, *xs)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
    return jax.grad(loss, argnums=tuple(range(5)))(*xs)

  def step(*xs):
    return fwd("dense", *xs), grads("dense", *xs), grads("safe", *xs)

  t0 = time.time()
  compiled = _compile(topology, step, args)
  mem = compiled.memory_analysis()
  hlo = compiled.as_text()
  # Every kernel of the step is in the compiled TPU program as a Mosaic custom call (not,
  # say, an XLA fallback): a line with custom_call_target="tpu_custom_call" names it.
  mosaic = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  kernels = sorted({n for n in KERNELS if any(n in line for line in mosaic)})
  print(f"{topology}: compiled in {time.time() - t0:.1f} s, grid (B·H, T/64) = ({B * H}, "
        f"{T // 64}); kernels {kernels}; memory: arguments "
        f"{mem.argument_size_in_bytes / 2**20:.1f} MiB, outputs "
        f"{mem.output_size_in_bytes / 2**20:.1f} MiB, temporaries "
        f"{mem.temp_size_in_bytes / 2**20:.1f} MiB, code "
        f"{mem.generated_code_size_in_bytes / 2**20:.2f} MiB")
  assert kernels == sorted(KERNELS), (kernels, len(mosaic))
  assert mem.temp_size_in_bytes < 2**30
