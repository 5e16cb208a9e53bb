"""Registers and spills of the KDA Pallas (Triton) GPU kernels, on a machine without a GPU.

    python -m benchmarks.triton_resources --triton-python /tmp/tv/bin/python
    python -m benchmarks.triton_resources --block-k 64 --num-warps 4 --segments --bf16-operands

Lowers `pallas_gpu_wy.intra_chunk_wy` (forward and backward) and the state-pass kernels for
CUDA with `lowering_platforms=("cuda",)` (jax needs no GPU for that), saves each kernel's Triton
IR (TTIR text) under --out, and, with --triton-python (a Python where `pip install triton` was
run; not in requirements.txt), compiles each for sm_90 (H100 / H200) with that Triton and prints
the registers per thread and the stack bytes (spills) from the cubin (`cuobjdump
--dump-resource-usage`, bundled with the triton wheel). The Triton that compiles here is pip's,
not the one inside jaxlib that compiles on the GPU machine, so the numbers are a guide (the
same IR, another compiler version), not a measurement of what runs there.

Shapes: B=1, T=512, H=2, K=V=128, bf16 inputs, chunk 64 (the kernels' code does not depend on
T or H).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

COMPILE = textwrap.dedent("""
    import os, subprocess, sys, time, triton
    from triton.backends.compiler import GPUTarget
    out, warps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for path in sorted(os.path.join(out, n + ".ttir") for n in set(names)):
      t0 = time.time()
      w = warps if "kda_wy" in path else 4
      k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=w, num_stages=1 if "kda_wy" in path else 2))
      with open(path + ".cubin", "wb") as fh:
        fh.write(k.asm["cubin"])
      use = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage",
                            path + ".cubin"], capture_output=True, text=True).stdout
      res = [x for x in use.split() if x.startswith(("REG:", "STACK:"))]
      print(f"{os.path.basename(path):22s} warps {w}  shared {k.metadata.shared:7d} B  "
            + "  ".join(res) + f"  (compiled in {time.time() - t0:.0f} s)", flush=True)
""")


def dump_ttir(out: str, block_k: int, num_warps: int, segments: bool,
              bf16_operands: bool = False) -> list[str]:
  """Lower the kernels for CUDA and write each one's TTIR to out/<name>.ttir; bf16_operands:
  the kernels' `precision=BF16_OPERANDS` instead of DEFAULT."""
  import jax
  import jax.numpy as jnp
  from jax._src.pallas.triton import pallas_call_registration as reg
  from pallas_kernels.kda import pallas_gpu, pallas_gpu_wy
  from pallas_kernels.kda.pallas_gpu_kernels import BF16_OPERANDS

  os.makedirs(out, exist_ok=True)
  lower = reg.lowering.lower_jaxpr_to_triton_module
  names = []

  def capture(jaxpr, *args, **kwargs):
    res = lower(jaxpr, *args, **kwargs)
    name = jaxpr.debug_info.func_name
    names.append(name)
    with open(os.path.join(out, f"{name}.ttir"), "w") as fh:
      fh.write(res.module.operation.get_asm(enable_debug_info=False))
    return res

  reg.lowering.lower_jaxpr_to_triton_module = capture
  prec = BF16_OPERANDS if bf16_operands else jax.lax.Precision.DEFAULT
  try:
    B, T, H, K = 1, 512, 2, 128
    sd = lambda *s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d)
    masks = (sd(B, T, d=jnp.int32), sd(B, T, d=jnp.float32), sd(B, T, d=jnp.float32))
    masks = masks if segments else None

    def wy(q, k, v, g, beta, masks):
      out, vjp = jax.vjp(lambda *a: pallas_gpu_wy.intra_chunk_wy(
          *a, masks, 64, K ** -0.5, prec, jnp.bfloat16, False,
          num_warps, block_k), q, k, v, g, beta)
      return vjp(out)

    def state(w, u, kd, dec, h0):
      out, vjp = jax.vjp(lambda *a: pallas_gpu.state_pass(
          *a, 64, 32, prec, False), w, u, kd, dec, h0)
      return vjp(out)

    f32 = jnp.float32
    jax.jit(wy).trace(sd(B, T, H, K), sd(B, T, H, K), sd(B, T, H, K), sd(B, T, H, K, d=f32),
                      sd(B, T, H, d=f32), masks).lower(lowering_platforms=("cuda",))
    N = T // 64
    jax.jit(state).trace(sd(B * H, T, K), sd(B * H, T, K), sd(B * H, N, K, 64),
                         sd(B * H, N, K, d=f32), sd(B * H, K, K, d=f32)).lower(
                             lowering_platforms=("cuda",))
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = lower
  return names


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="/tmp/kda_ttir", help="where the .ttir / .cubin files go")
  p.add_argument("--block-k", type=int, default=64,
                 help="intra_chunk_wy's block_k (key / value channels per block)")
  p.add_argument("--num-warps", type=int, default=4, help="intra_chunk_wy's num_warps")
  p.add_argument("--segments", action="store_true", help="with packed-document masks")
  p.add_argument("--bf16-operands", action="store_true",
                 help="the kernels' precision=BF16_OPERANDS (bf16 products) instead of DEFAULT")
  p.add_argument("--triton-python", default=None, metavar="PYTHON",
                 help="a Python with `triton` installed: compile and print REG / STACK")
  a = p.parse_args(argv)
  block_k = a.block_k
  if block_k < 16 or block_k & (block_k - 1):
    p.error(f"--block-k {block_k}: expected a power of two >= 16")
  if a.num_warps not in (1, 2, 4, 8, 16):
    p.error(f"--num-warps {a.num_warps}: expected 1, 2, 4, 8 or 16")
  if a.triton_python is not None and shutil.which(a.triton_python) is None:
    p.error(f"--triton-python {a.triton_python!r}: no such executable (expected the path of "
            "a Python with `triton` installed)")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  names = dump_ttir(a.out, block_k, a.num_warps, a.segments, a.bf16_operands)
  print(f"TTIR of {', '.join(names)} in {a.out}", flush=True)
  if a.triton_python:
    # this run's kernels only (a file left in --out by another run is not compiled)
    res = subprocess.run([a.triton_python, "-c", COMPILE, a.out, str(a.num_warps), *names],
                         stderr=subprocess.PIPE, text=True)
    if res.returncode:
      print(res.stderr[-3000:], file=sys.stderr)
      sys.exit(res.returncode)


if __name__ == "__main__":
  main()
