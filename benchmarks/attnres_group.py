"""Time the AttnRes reads of whole layer groups, forward + backward under full remat, as the
`small` preset's train step runs them: a head group and 3 groups in a `lax.scan`, each group 4
layers x 2 reads (before the mixer and before the FFN) with `open_block` at every layer, then
the final read. The layers themselves are a cheap stand-in (tanh of the read, bf16).

    python -m benchmarks.attnres_group                          # B=8, T=8192, D=1024 (H200)
    python -m benchmarks.attnres_group --batch 1 --length 256   # a CPU smoke run

Variants (each one jitted program; median of --repeats calls after one warm-up call):
  repo            the model's code (`attnres.open_block`, `attnres_mix`)
  traced_push     repo, but the layers inside a block pass a traced False to open_block (as
                  main 1c7d001 and before did: a stack write that cannot happen, traced at
                  every layer)
  no_fence        repo, with `attnres._separate_passes` forced off (no optimization barrier
                  in the read's backward: what XLA:CPU runs)
Prints time, compiled temporaries and the loss and gradient norms (equal across variants up to
rounding). Source of the read: arXiv 2603.15031; ARCHITECTURE §4.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparse_lm.config import get_preset
from sparse_lm.model import attnres

VARIANTS = ("repo", "traced_push", "no_fence")


def build(cfg, variant: str):
  """The jitted loss-and-gradient program of one variant."""
  traced = variant == "traced_push"
  fence = None if variant != "no_fence" else False

  def loss(emb, qs, ws):
    saved = attnres._separate_passes  # pylint: disable=protected-access
    if fence is not None:  # read at trace time, inside the custom VJP's backward
      attnres._separate_passes = lambda: fence  # pylint: disable=protected-access
    try:
      stream = attnres.init_stream(cfg, emb)

      def body(stream, x):
        q, w = x
        for i in range(8):
          if i % 2 == 0:  # a layer starts: open_block, as DecoderLayer calls it
            if traced:
              stream = attnres.open_block(cfg, stream, jnp.asarray(i == 0))
            else:
              stream = attnres.open_block(cfg, stream, i == 0)
          h = attnres.sublayer_input(cfg, stream, q[i])
          y = jnp.tanh(h.astype(jnp.bfloat16) * w[i])
          stream = attnres.add_output(cfg, stream, y)
        return stream, None

      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
      stream, _ = body(stream, (qs[0], ws[0]))
      stream, _ = jax.lax.scan(body, stream, (qs[1:], ws[1:]))
      h = attnres.final_output(cfg, stream, qs[0, 0])
      return jnp.mean(h * h)
    finally:
      attnres._separate_passes = saved  # pylint: disable=protected-access

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main(argv=None):
  p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--variants", default=",".join(VARIANTS))
  a = p.parse_args(argv)
  variants = [v.strip() for v in a.variants.split(",") if v.strip()]
  bad = [v for v in variants if v not in VARIANTS]
  if bad or not variants:  # before the first variant compiles (it was checked in the loop)
    p.error(f"--variants {a.variants!r}: expected a comma list of {', '.join(VARIANTS)}")
  for flag, value in (("--batch", a.batch), ("--length", a.length), ("--repeats", a.repeats)):
    if value < 1:
      p.error(f"{flag} {value}: expected a positive integer")
  cfg = get_preset("small")
  k = jax.random.split(jax.random.key(0), 3)
  emb = jax.random.normal(k[0], (a.batch, a.length, cfg.d_model), jnp.float32)
  qs = 0.1 * jax.random.normal(k[1], (4, 8, cfg.d_model), jnp.float32)
  ws = jax.random.uniform(k[2], (4, 8, cfg.d_model), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)
  print(f"{jax.devices()[0].device_kind}: B={a.batch} T={a.length} D={cfg.d_model}, "
        f"N={attnres.num_sources(cfg)} stack slots, 4 groups x 8 reads + the final read")
  for v in variants:
    c = build(cfg, v).lower(emb, qs, ws).compile()
    mem = c.memory_analysis()
    out = jax.block_until_ready(c(emb, qs, ws))
    ts = []
    for _ in range(a.repeats):
      t0 = time.perf_counter()
      out = jax.block_until_ready(c(emb, qs, ws))
      ts.append(time.perf_counter() - t0)
    temps = f"{mem.temp_size_in_bytes / 2**30:.2f} GiB" if mem is not None else "n/a"
    print(f"{v:12s} {1e3 * np.median(ts):9.2f} ms  temporaries {temps}  loss "
          f"{float(out[0]):.6f}  |d emb| {float(jnp.linalg.norm(out[1][0])):.6e}  "
          f"|d queries| {float(jnp.linalg.norm(out[1][1])):.6e}", flush=True)


if __name__ == "__main__":
  main()
