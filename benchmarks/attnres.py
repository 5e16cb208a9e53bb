"""Time one AttnRes read (`sparse_lm.model.attnres.attnres_mix`): forward, forward + backward
and compiled temporary memory, beside the einsum form it replaced (autodiff, no custom VJP).

    python -m benchmarks.attnres                      # the small preset's shape: N=5, 8 x 8K x 1024
    python -m benchmarks.attnres --batch 1 --length 1024 --repeats 5   # a quick CPU run

Each row: median wall time of `--repeats` calls of the jitted function after one warm-up call,
in two rounds (the forms alternate); the stack is bf16 with 3 of N slots filled, the partial
block sum fp32, as in the `small` preset's training step. Prints the gradients' largest
relative difference between the two forms.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparse_lm.model import attnres
from sparse_lm.nn import rms_norm


def einsum_mix(sources, valid, query, partial, partial_valid, eps=1e-6):
  """The AttnRes read as it was written before 2026-12-02 (main 8e690fb): two einsums and
  autodiff. Same values as attnres_mix up to rounding."""
  w = query.astype(jnp.float32)
  norm = functools.partial(rms_norm, eps=eps)
  logits = jnp.where(valid[:, None, None], jnp.einsum("nbtd,d->nbt", norm(sources), w), -jnp.inf)
  lp = jnp.where(partial_valid, jnp.einsum("btd,d->bt", norm(partial), w), -jnp.inf)
  m = jax.lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=0), lp))
  e, ep = jnp.exp(logits - m), jnp.exp(lp - m)
  h = jnp.einsum("nbt,nbtd->btd", e, sources.astype(jnp.float32))
  h = h + ep[..., None] * partial.astype(jnp.float32)
  return h / (jnp.sum(e, axis=0) + ep)[..., None]


def _time(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) * 1e3


def main(argv=None):
  p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  p.add_argument("--sources", type=int, default=5, help="stack slots N (3 filled)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--width", type=int, default=1024)
  p.add_argument("--repeats", type=int, default=20)
  a = p.parse_args(argv)
  if a.sources < 3:
    p.error(f"--sources {a.sources}: must be >= 3 (3 slots are filled)")
  for flag, value in (("--batch", a.batch), ("--length", a.length), ("--width", a.width),
                      ("--repeats", a.repeats)):
    if value < 1:
      p.error(f"{flag} {value}: expected a positive integer")
  rng = np.random.default_rng(0)
  shape = (a.batch, a.length, a.width)
  src = jnp.asarray(rng.standard_normal((a.sources,) + shape), jnp.bfloat16)
  valid = jnp.arange(a.sources) < 3
  part = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  w = jnp.asarray(rng.standard_normal(a.width) * 0.1, jnp.float32)
  dh = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  forms = {"attnres_mix": attnres.attnres_mix, "einsum (before)": einsum_mix}
  print(f"device {jax.devices()[0].device_kind}, N={a.sources} B={a.batch} T={a.length} "
        f"D={a.width}, bf16 stack, median of {a.repeats}")
  grads = {}
  for _ in range(2):
    for name, mix in forms.items():
      fwd = jax.jit(lambda s, w, p, mix=mix: mix(s, valid, w, p, True))
      bwd = jax.jit(jax.grad(lambda s, w, p, mix=mix: jnp.sum(mix(s, valid, w, p, True) * dh),
                             argnums=(0, 1, 2)))
      row = []
      for fn in (fwd, bwd):
        temp = fn.lower(src, w, part).compile().memory_analysis().temp_size_in_bytes
        row += [_time(fn, (src, w, part), a.repeats), temp / 2**30]
      grads[name] = bwd(src, w, part)
      print(f"  {name:16s} forward {row[0]:8.3f} ms ({row[1]:.2f} GiB temp)   "
            f"forward+backward {row[2]:8.3f} ms ({row[3]:.2f} GiB temp)", flush=True)
  new, old = grads["attnres_mix"], grads["einsum (before)"]
  for n, x, y in zip(("sources", "query", "partial"), new, old):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    print(f"  gradient in {n}: max |difference| / max |einsum| = "
          f"{np.max(np.abs(x - y)) / np.max(np.abs(y)):.2e}")


if __name__ == "__main__":
  main()
