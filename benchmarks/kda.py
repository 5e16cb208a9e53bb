"""Time the KDA operator: forward and forward+backward of every available backend.

    python -m benchmarks.kda                     # full grid (meant for an H200 / TPU)
    python -m benchmarks.kda --quick             # tiny shapes, CPU, < 1 minute
    python -m benchmarks.kda --backends xla,fla,attn --out docs/kda_table.md

Shapes (issue 16's table): B=1, H=16, K=V=128, T ∈ {4K, 8K, 32K, 64K}, and H=96 at T=8K; bf16
inputs, lower-bounded gate g ∈ (−5, 0). Backends (each skipped with a reason when it
cannot run here):
  xla         pallas_kernels.kda chunk_kda(backend="xla", gate_lower_bound=-5): dense diag tiles
  xla_safe    the same with the element-wise (unbounded-safe) diagonal tiles
  xla_tf32    xla with precision=DEFAULT matmuls (TF32 on NVIDIA, bf16 passes on TPU) instead
              of the backend's default HIGHEST (true fp32)
  pallas_tpu  chunk_kda(backend="pallas_tpu") on TPU
  pallas_gpu  chunk_kda(backend="pallas_gpu") on GPU (TF32 matmuls: its default for bf16 inputs)
  pallas_gpu_xla  pallas_gpu with intra="xla": the intra-chunk step as batched XLA ops and
              autodiff
  pallas_gpu_wy  pallas_gpu with intra="wy": the intra-chunk kernels of pallas_gpu_wy.py
  pallas_gpu_hi  the same with precision=HIGHEST (true fp32 matmuls)
  pallas_gpu_bf16  pallas_gpu with precision=BF16_OPERANDS: the kernels' products on bf16
              operands (fp32 accumulation) instead of TF32 (the diagonal tiles and the
              inverse at 3xTF32 either way)
  pallas_gpu_f32store  pallas_gpu with store_dtype=float32: fp32 intermediates between its
              steps (its default stores them in bf16 for bf16 inputs since 2026-12-02)
  jla         jax-linear-attention's Mosaic GPU KDA (linear_attention("kda", impl="mosaic_gpu"))
  reference   the token-serial scan (only when asked: very slow at long T)
  fla         fla-core's Triton chunk_kda (torch, CUDA), safe gate when its API has it
  attn        fused causal softmax attention, jax.nn.dot_product_attention (cuDNN on GPU)
  sdpa        torch scaled_dot_product_attention (causal), CUDA
Each time is the median of --repeats runs after --warmup runs, with block_until_ready
(torch.cuda.synchronize for torch). Prints one markdown table (ms) and the fwd+bwd ratio of the
faster peer (fla, jla) to pallas_gpu per shape; --out also writes them.
Source of the operator: Kimi Linear (arXiv 2510.26692).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
import traceback

JAX_BACKENDS = ("xla", "xla_safe", "xla_tf32", "pallas_tpu", "pallas_gpu", "pallas_gpu_hi",
                "pallas_gpu_bf16", "pallas_gpu_f32store", "pallas_gpu_xla", "pallas_gpu_wy", "jla", "reference", "attn")
TORCH_BACKENDS = ("fla", "sdpa")
DEFAULT_BACKENDS = ("pallas_gpu", "pallas_gpu_hi", "xla", "pallas_tpu", "fla", "jla", "attn")
PEERS = ("fla", "jla")


def _shapes(quick: bool) -> list[tuple[int, int, int, int]]:
  """(B, H, T, D) grid."""
  if quick:
    return [(1, 2, 256, 32), (1, 4, 512, 32)]
  return [(1, 16, t, 128) for t in (4096, 8192, 32768, 65536)] + [(1, 96, 8192, 128)]


def _median_ms(fn, warmup: int, repeats: int, sync) -> float:
  for _ in range(warmup):
    sync(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    sync(fn())
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# JAX backends


def _jax_inputs(B, H, T, D, seed=0):
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  bf = jnp.bfloat16
  q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32)
  k = jax.random.normal(ks[1], (B, T, H, D), jnp.float32)
  q = (q / jnp.linalg.norm(q, axis=-1, keepdims=True)).astype(bf)
  k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(bf)
  v = jax.random.normal(ks[2], (B, T, H, D), bf)
  g = (-5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (B, T, H, D)))).astype(bf)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(bf)
  do = jax.random.normal(ks[5], (B, T, H, D), bf)
  return q, k, v, g, beta, do


def _jax_fns(backend: str):
  """(fwd(q,k,v,g,beta), fwd_bwd(q,k,v,g,beta,do)) jitted, or raise SkipBackend."""
  import jax
  import jax.numpy as jnp
  platform = jax.default_backend()
  if backend == "attn":
    impl = "cudnn" if platform == "gpu" else None

    def f(q, k, v, g, beta):
      del g, beta
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  elif backend == "jla":
    if platform != "gpu":
      raise SkipBackend("needs a GPU")
    try:
      from jla.ops import linear_attention  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise SkipBackend("jax-linear-attention not installed") from None

    def f(q, k, v, g, beta):
      return linear_attention("kda", q, k, v, g=g, beta=beta, impl="mosaic_gpu")[0]
  else:
    from pallas_kernels.kda import chunk_kda
    if backend == "pallas_tpu" and platform != "tpu":
      raise SkipBackend("needs a TPU")
    if backend.startswith("pallas_gpu"):
      if platform != "gpu":
        raise SkipBackend("needs a GPU")
      try:
        import pallas_kernels.kda.pallas_gpu  # noqa: F401  pylint: disable=g-import-not-at-top
      except ImportError:
        raise SkipBackend("pallas_kernels.kda.pallas_gpu not written") from None
    if backend == "pallas_tpu":
      try:
        import pallas_kernels.kda.pallas_tpu  # noqa: F401  pylint: disable=g-import-not-at-top
      except ImportError:
        raise SkipBackend("pallas_kernels.kda.pallas_tpu not importable") from None
    name = {"xla_safe": "xla", "pallas_gpu_hi": "pallas_gpu", "pallas_gpu_xla": "pallas_gpu",
            "pallas_gpu_bf16": "pallas_gpu",
            "pallas_gpu_wy": "pallas_gpu", "pallas_gpu_f32store": "pallas_gpu"}.get(backend,
                                                                                   backend)
    bound = None if backend in ("xla_safe", "reference") else -5.0
    kw = dict(backend=name, chunk_size=64)
    if bound is not None:
      kw["gate_lower_bound"] = bound

    def f(q, k, v, g, beta):
      if backend == "xla_tf32":
        from pallas_kernels.kda import xla  # pylint: disable=g-import-not-at-top
        return xla.chunk_kda_xla(q, k, v, g, beta, gate_lower_bound=-5.0,
                                 precision=jax.lax.Precision.DEFAULT)[0]
      if backend == "pallas_gpu_hi":
        from pallas_kernels.kda import pallas_gpu  # pylint: disable=g-import-not-at-top
        return pallas_gpu.chunk_kda_pallas_gpu(q, k, v, g, beta, gate_lower_bound=-5.0,
                                               precision=jax.lax.Precision.HIGHEST)[0]
      if backend == "pallas_gpu_bf16":
        from pallas_kernels.kda import pallas_gpu  # pylint: disable=g-import-not-at-top
        from pallas_kernels.kda.pallas_gpu_kernels import BF16_OPERANDS  # pylint: disable=g-import-not-at-top
        return pallas_gpu.chunk_kda_pallas_gpu(q, k, v, g, beta, gate_lower_bound=-5.0,
                                               precision=BF16_OPERANDS)[0]
      if backend in ("pallas_gpu_xla", "pallas_gpu_wy"):
        from pallas_kernels.kda import pallas_gpu  # pylint: disable=g-import-not-at-top
        return pallas_gpu.chunk_kda_pallas_gpu(q, k, v, g, beta, gate_lower_bound=-5.0,
                                               intra=backend[len("pallas_gpu_"):])[0]
      if backend == "pallas_gpu_f32store":
        from pallas_kernels.kda import pallas_gpu  # pylint: disable=g-import-not-at-top
        return pallas_gpu.chunk_kda_pallas_gpu(q, k, v, g, beta, gate_lower_bound=-5.0,
                                               store_dtype=jnp.float32)[0]
      return chunk_kda(q, k, v, g, beta, **kw)[0]

  fwd = jax.jit(f)

  def loss(q, k, v, g, beta, do):
    return jnp.sum(f(q, k, v, g, beta).astype(jnp.float32) * do.astype(jnp.float32))

  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  return fwd, fwd_bwd


def _time_jax(backend, shape, warmup, repeats, skip_fwd=False):
  import jax
  B, H, T, D = shape
  fwd, fwd_bwd = _jax_fns(backend)
  q, k, v, g, beta, do = _jax_inputs(B, H, T, D)
  sync = jax.block_until_ready
  t_f = ("-" if skip_fwd else
         _median_ms(lambda: fwd(q, k, v, g, beta), warmup, repeats, sync))
  t_fb = _median_ms(lambda: fwd_bwd(q, k, v, g, beta, do), warmup, repeats, sync)
  return t_f, t_fb


def profile_jax(backend, shape, trace_dir, warmup, repeats) -> str:
  """Trace `repeats` fwd+bwd calls of a JAX backend (after `warmup`) into trace_dir; returns
  benchmarks/trace_summary.py's table of device time per call and the top 30 kernels."""
  import jax
  from benchmarks import trace_summary  # pylint: disable=g-import-not-at-top
  _, fwd_bwd = _jax_fns(backend)
  args = _jax_inputs(*shape)
  for _ in range(warmup):
    jax.block_until_ready(fwd_bwd(*args))
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(repeats):
      jax.block_until_ready(fwd_bwd(*args))
  return f"## {backend} fwd+bwd at B,H,T,D={shape}\n" + trace_summary.summarize(
      trace_dir, steps=repeats, top=30)


def check_jax(backends, against, shape) -> str:
  """Relative RMSE of each JAX backend's output and five input gradients against `against`'s
  (same inputs and output cotangent as the timing), one line per backend."""
  import jax.numpy as jnp
  args = _jax_inputs(*shape)
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def outs(be):
    fwd, fwd_bwd = _jax_fns(be)
    return (fwd(*args[:5]),) + tuple(fwd_bwd(*args))

  ref = outs(against)
  lines = [f"## relative RMSE against {against} at B,H,T,D={shape}: o, dq, dk, dv, dg, dbeta"]
  for be in backends:
    if be == against or be in TORCH_BACKENDS:
      continue
    try:
      got = outs(be)
    except SkipBackend as e:
      lines.append(f"- {be}: skipped: {e}")
      continue
    errs = [float(jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))
            for a, b in zip(got, ref)]
    lines.append(f"- {be}: " + ", ".join(f"{e:.2e}" for e in errs))
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# torch backends (CUDA only)


def _time_torch(backend, shape, warmup, repeats, skip_fwd=False):
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise SkipBackend("torch not installed") from None
  if not torch.cuda.is_available():
    raise SkipBackend("needs CUDA")
  B, H, T, D = shape
  dev, bf = "cuda", torch.bfloat16
  gen = torch.Generator(device=dev).manual_seed(0)
  rnd = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.float32)
  q = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1).to(bf)
  k = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1).to(bf)
  v = rnd(B, T, H, D).to(bf)
  g = (-5.0 * torch.sigmoid(2.0 * rnd(B, T, H, D))).to(bf)
  beta = torch.sigmoid(rnd(B, T, H)).to(bf)
  do = rnd(B, T, H, D).to(bf)
  if backend == "fla":
    try:
      from fla.ops.kda import chunk_kda as fla_chunk_kda  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise SkipBackend("fla-core not installed") from None
    params = inspect.signature(fla_chunk_kda).parameters
    kw = {}
    if "safe_gate" in params:  # fla's lower-bounded ("safe") gate path
      kw["safe_gate"] = True
    if "gate_lower_bound" in params:
      kw["gate_lower_bound"] = -5.0

    def f(q, k, v, g, beta):
      return fla_chunk_kda(q, k, v, g, beta, **kw)[0]
    leaves = [q, k, v, g, beta]
  else:
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # SDPA: [B, H, T, D]
    do = do.transpose(1, 2).contiguous()
    leaves = [qh, kh, vh]

    def f(*_):
      return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

  def fwd():
    with torch.no_grad():
      return f(q, k, v, g, beta)

  def fwd_bwd():
    for x in leaves:
      x.grad = None
      x.requires_grad_(True)
    o = f(q, k, v, g, beta)
    o.backward(do)
    return o

  sync = lambda _: torch.cuda.synchronize()
  t_f = "-" if skip_fwd else _median_ms(fwd, warmup, repeats, sync)
  return t_f, _median_ms(fwd_bwd, warmup, repeats, sync)


class SkipBackend(Exception):
  """The backend cannot run in this environment (reason in the message)."""


def run(backends, shapes, warmup, repeats, out=None, skip_fwd=False):
  rows = {}
  notes = {}
  for be in backends:
    for shape in shapes:
      try:
        if be in TORCH_BACKENDS:
          res = _time_torch(be, shape, warmup, repeats, skip_fwd)
        else:
          res = _time_jax(be, shape, warmup, repeats, skip_fwd)
        cell = res
      except SkipBackend as e:
        notes[be] = f"skipped: {e}"
        break
      except Exception as e:  # OOM or a backend bug: record and go on
        msg = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
        cell = ("OOM" if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
                else "error",) * 2
        notes[be] = f"{type(e).__name__}: {msg}"
        traceback.print_exc(file=sys.stderr)
      rows[(be, shape)] = cell
      print(f"  {be:10s} B={shape[0]} H={shape[1]} T={shape[2]} D={shape[3]}: "
            + ", ".join(_fmt(c) for c in cell), file=sys.stderr, flush=True)
  table = _table(backends, shapes, rows, notes)
  print(table)
  if out:
    with open(out, "w") as fh:
      fh.write(table + "\n")
  return rows


def _fmt(x):
  return f"{x:.2f}" if isinstance(x, float) else str(x)


def _table(backends, shapes, rows, notes):
  import jax
  tl = lambda t: f"{t // 1024}K" if t % 1024 == 0 else str(t)
  # B and K=V are in the title line (the first shape's); a shape with another B or D says so
  col = lambda b, h, t, d: ((f"B={b} " if b != shapes[0][0] else "") + f"H={h} T={tl(t)}"
                            + (f" K=V={d}" if d != shapes[0][3] else ""))
  head = "| backend | pass | " + " | ".join(col(*s) for s in shapes) + " |"
  lines = [f"KDA timings in ms (median), bf16, B={shapes[0][0]}, K=V={shapes[0][3]}; "
           f"jax {jax.__version__} on {jax.devices()[0].device_kind}", "", head,
           "|" + "---|" * (len(shapes) + 2)]
  for be in backends:
    if not any((be, s) in rows for s in shapes):
      continue
    for i, name in enumerate(("fwd", "fwd+bwd")):
      cells = [_fmt(rows[(be, s)][i]) if (be, s) in rows else "-" for s in shapes]
      lines.append(f"| {be} | {name} | " + " | ".join(cells) + " |")
  ratios = []
  for s in shapes:
    ours = rows.get(("pallas_gpu", s), (None, None))[1]
    peer = [rows[(p, s)][1] for p in PEERS if isinstance(rows.get((p, s), (0, 0))[1], float)]
    if isinstance(ours, float) and peer:
      ratios.append(f"{col(*s)}: {min(peer) / ours:.2f}")
  if ratios:
    lines += ["", "fwd+bwd, faster peer (fla, jla) / pallas_gpu (> 1: pallas_gpu faster): "
              + "; ".join(ratios)]
  if notes:
    lines.append("")
    lines += [f"- {be}: {n}" for be, n in notes.items()]
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                 help=f"comma list from {JAX_BACKENDS + TORCH_BACKENDS}")
  p.add_argument("--out", default=None, help="also write the markdown table here")
  p.add_argument("--warmup", type=int, default=None)
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--skip-fwd", action="store_true",
                 help="time forward+backward only (half the compiles)")
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="instead of the table: trace --repeats fwd+bwd calls of each JAX backend "
                      "at --profile-shape into DIR/<backend> and print its top kernels")
  p.add_argument("--profile-shape", default="1,16,32768,128", metavar="B,H,T,D")
  p.add_argument("--shapes", default=None, metavar="B,H,T,D;...",
                 help="time these shapes instead of the issue's grid")
  p.add_argument("--check-against", default=None, metavar="BACKEND",
                 help="first print each JAX backend's relative RMSE (output and gradients) "
                      "against this backend's at the first shape")
  a = p.parse_args(argv)
  backends = [b.strip() for b in a.backends.split(",") if b.strip()]
  unknown = [b for b in backends if b not in JAX_BACKENDS + TORCH_BACKENDS]
  if unknown or not backends:
    p.error(f"--backends {a.backends!r}: " + (f"unknown {', '.join(unknown)}; " if unknown
                                               else "no backend given; ")
            + f"expected a comma list of {', '.join(JAX_BACKENDS + TORCH_BACKENDS)}")
  warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
  repeats = a.repeats if a.repeats is not None else (3 if a.quick else 10)
  if warmup < 0:
    p.error(f"--warmup {warmup}: expected >= 0")
  if repeats < 1:
    p.error(f"--repeats {repeats}: expected >= 1 (each time is their median)")

  def parse_shape(text, flag):
    try:
      shape = tuple(int(x) for x in text.split(","))
    except ValueError:
      shape = ()
    if len(shape) != 4 or min(shape) < 1:
      p.error(f"{flag} {text!r}: expected four positive integers B,H,T,D "
              "(e.g. 1,16,32768,128)")
    return shape

  shapes = ([parse_shape(t.strip(), "--shapes") for t in a.shapes.split(";") if t.strip()]
            if a.shapes is not None else _shapes(a.quick))
  if not shapes:
    p.error(f"--shapes {a.shapes!r}: no shape given; expected B,H,T,D;... "
            "(e.g. 1,16,32768,128;1,96,8192,128)")
  if a.check_against:
    if a.check_against not in JAX_BACKENDS:
      p.error(f"--check-against {a.check_against!r}: expected one of {JAX_BACKENDS}")
    try:  # builds the jitted functions only: a backend that cannot run here says so now
      _jax_fns(a.check_against)
    except SkipBackend as e:
      p.error(f"--check-against {a.check_against}: cannot run here ({e})")
    print(check_jax(backends, a.check_against, shapes[0]), flush=True)
  if a.profile:
    shape = parse_shape(a.profile_shape, "--profile-shape")
    for be in backends:
      if be in TORCH_BACKENDS:
        print(f"{be}: not profiled (torch)", file=sys.stderr)
        continue
      try:
        print(profile_jax(be, shape, f"{a.profile}/{be}", warmup, repeats), flush=True)
      except SkipBackend as e:
        print(f"{be}: not profiled (skipped: {e})", file=sys.stderr, flush=True)
    return
  run(backends, shapes, warmup, repeats, a.out, a.skip_fwd)


if __name__ == "__main__":
  main()
