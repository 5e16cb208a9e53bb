"""Time KDA's intra-chunk step alone on a GPU: the Pallas kernels of `pallas_gpu_wy` at several
tilings beside the XLA step (`xla._intra_chunk`, as `pallas_gpu` runs it with `intra="xla"`).

    python3 -m benchmarks.kda_intra --shape 1,16,8192,128 --configs 4:32,4:16,4:64,4:64/32
    python -m benchmarks.kda_intra --interpret --shape 1,2,128,32 --configs 4:16 --repeats 1

Inputs: `benchmarks.kda._jax_inputs` (bf16 q, k, v; g in (-5, 0) and β as fp32, as
`pallas_gpu` passes them), chunk 64, TF32 products (`precision=DEFAULT`), bf16 storage of the
outputs. Each time is the median of --repeats calls after one warm-up call (which compiles),
`block_until_ready`; "fwd" is the six outputs (W, U, Q ⊙ Γ, A_qk, Kd, d), "fwd+bwd" the
gradient of a fixed weighted sum of them in q, k, v, g, β. The step's inputs and outputs are
in each path's own layout ([B, T, H, ·] for the kernels, [B·H·N, C, ·] chunks for XLA; the
XLA time includes its layout change).

Source of the operator: Kimi Linear (arXiv 2510.26692) §3; the kernels: pallas_gpu_wy.py.
"""

from __future__ import annotations

import argparse
import time


def _fns(path, B, H, T, D, num_warps=4, block_k=32, interpret=False):
  """(fwd, fwd+bwd) jitted for path "xla" or "wy" (interpret: the kernels in interpret mode)."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.kda import pallas_gpu, pallas_gpu_wy
  from pallas_kernels.kda import xla as kda_xla
  C, scale, prec = 64, D ** -0.5, jax.lax.Precision.DEFAULT

  if path == "wy":
    def fwd(q, k, v, g, beta):
      return pallas_gpu_wy.intra_chunk_wy(q, k, v, g, beta, None, C, scale, prec, jnp.bfloat16,
                                          interpret, num_warps, block_k)
  else:
    M = B * H * (T // C)

    def fwd(q, k, v, g, beta):
      ch = lambda x: jnp.moveaxis(x, 2, 1).reshape((M, C) + x.shape[3:]).astype(jnp.float32)
      outs = kda_xla._intra_chunk(ch(q), ch(k), ch(v), ch(g), ch(beta), None, None, None,
                                  scale=scale, diag="dense", precision=prec,
                                  inverse=pallas_gpu.blocked_unit_lower_inverse,
                                  matmul_cumsum=True)
      return tuple(o.astype(jnp.bfloat16) for o in outs[:5]) + (outs[5],)

  def loss(q, k, v, g, beta):
    outs = fwd(q, k, v, g, beta)
    return sum(jnp.sum(o.astype(jnp.float32)) * 1e-3 * (i + 1) for i, o in enumerate(outs))

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  p.add_argument("--shape", default="1,16,8192,128", metavar="B,H,T,D")
  p.add_argument("--configs", default="4:32,4:16,4:64,4:64/32", metavar="WARPS:BLOCK,...",
                 help="intra_chunk_wy's num_warps and block_k to time (BLOCK or FWD/BWD)")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--interpret", action="store_true",
                 help="without a GPU: the kernels in Pallas interpret mode (a smoke run of this "
                      "script at a small --shape; the times mean nothing)")
  a = p.parse_args(argv)
  def config(text):  # "W:B" or "W:BF/BB" -> (W, B) or (W, (BF, BB))
    w, b = text.split(":")
    blocks = tuple(int(x) for x in b.split("/"))
    if int(w) not in (1, 2, 4, 8) or len(blocks) > 2 or any(x < 16 or x & (x - 1)
                                                              for x in blocks):
      raise ValueError(text)
    return int(w), blocks[0] if len(blocks) == 1 else blocks

  try:
    B, H, T, D = (int(x) for x in a.shape.split(","))
    configs = [config(c) for c in a.configs.split(",") if c]
  except ValueError:
    p.error(f"--shape {a.shape!r} / --configs {a.configs!r}: expected B,H,T,D and configs "
            "WARPS:BLOCK or WARPS:FWD_BLOCK/BWD_BLOCK, WARPS in 1, 2, 4, 8, blocks powers of "
            "two >= 16 (e.g. 4:32,4:64/32)")
  if min(B, H, T, D) < 1:
    p.error(f"--shape {a.shape!r}: expected four positive integers B,H,T,D")
  if T % 64:
    p.error(f"--shape: T={T} must be a multiple of 64 (the chunk)")
  if a.repeats < 1:
    p.error(f"--repeats {a.repeats}: expected a positive integer")
  import jax
  import jax.numpy as jnp
  if jax.default_backend() != "gpu" and not a.interpret:
    p.error("needs a CUDA GPU (the Triton kernels), or --interpret")
  from benchmarks.kda import _jax_inputs, _median_ms
  q, k, v, g, beta, _ = _jax_inputs(B, H, T, D)
  args = (q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32))
  print(f"intra-chunk step, B={B} H={H} T={T} K=V={D}, bf16, on {jax.devices()[0].device_kind}")
  rows = [("xla", None)] + [("wy", c) for c in configs]
  for path, cfg in rows:
    t0 = time.time()
    fwd, fwd_bwd = _fns(path, B, H, T, D, *(cfg or (4, 32)), interpret=a.interpret)
    f, fb = (_median_ms(lambda fn=fn: fn(*args), 1, a.repeats, jax.block_until_ready)
             for fn in (fwd, fwd_bwd))
    label = "xla" if cfg is None else f"wy num_warps={cfg[0]} block_k={cfg[1]}"
    print(f"{label:28s} fwd {f:7.3f} ms   fwd+bwd {fb:7.3f} ms   ({time.time() - t0:.0f} s with "
          "compile)", flush=True)


if __name__ == "__main__":
  main()
