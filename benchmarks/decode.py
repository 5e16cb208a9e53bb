"""Prefill throughput and decode step time of the inference engine, beside the bandwidth floor.

    python -m benchmarks.decode                          # small preset, batch 1/8/64 x 8K/64K
    python -m benchmarks.decode --preset tiny --batches 1,2 --contexts 256 --prefill-chunk 64
                                                         # CPU smoke run (seconds)

For each (batch B, context L) the engine (sparse_lm.inference.Engine, bf16 weights and caches
for the small preset) is built with max_length = L and B slots, and:
  decode   one jitted step for all B rows at length L - 1 (every row's latent cache full):
           median of --repeats after a compile-and-warm-up call. The cache contents do not
           change the work (the step reads the whole allocated cache), so the cache is not
           filled by a real prefill first.
  floor    bytes the step must read / HBM bandwidth (--hbm-tbs, 4.8 TB/s for an H200):
           every non-expert weight once (embedding: only B rows), the routed experts the batch
           can touch (E (1 - (1 - k/E)^B) per MoE layer: uniform routing), the KDA states
           (read and written, fp32) and conv tails, and B x L latent-cache entries per MLA
           layer. ratio = floor / measured (1 = at the bandwidth limit).
  prefill  one piece of P = min(--prefill-chunk, --prefill-tokens / B) tokens per row at the
           start of the context and one at its end (its attention reads the whole cache);
           a whole prompt of L tokens costs about (L / P) x their mean, so
           tokens/s = B L / ((L / P) x mean).
Prints a markdown table; --out also writes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.inference import Engine, cache_bytes
from sparse_lm.model import Transformer


def weight_bytes_per_step(cfg, batch: int) -> float:
  """Bytes of weights a decode step of `batch` tokens reads (see the module docstring)."""
  item = jnp.dtype(cfg.dtype).itemsize
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  total = 0.0
  for path, var in nnx.iter_graph(model):
    if not isinstance(var, nnx.Param):
      continue
    names = [str(p) for p in path]
    n = float(np.prod(var.shape))
    size = jnp.dtype(var.dtype).itemsize if var.ndim < 2 else item
    if names[-1] == "embedding":
      n = n / cfg.vocab_size * batch
    elif names[-1] in ("expert_gate", "expert_up", "expert_down"):
      E, k = cfg.num_experts, cfg.experts_per_token
      n *= 1 - (1 - k / E) ** batch
    total += n * size
  return total


def cache_bytes_per_step(cfg, batch: int, length: int) -> float:
  """Cache bytes a decode step reads: all of it, plus the KDA states written back."""
  H, K, V = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim
  return cache_bytes(cfg, length, batch) + batch * cfg.num_kda_layers * H * K * V * 4


def _median_s(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run(cfg, model, batch: int, context: int, args) -> dict:
  chunk = max(16, min(args.prefill_chunk, args.prefill_tokens // batch, context))
  engine = Engine(model, max_length=context, max_batch=batch, prefill_chunk=chunk)
  rng = np.random.default_rng(0)
  tok1 = rng.integers(0, cfg.vocab_size, (batch, 1))
  full = np.full(batch, context - 1)
  ones = np.ones(batch, np.int32)
  decode_s = _median_s(lambda: engine.step(tok1, full, ones)[0], args.repeats)
  row = {"batch": batch, "context": context, "decode_ms": decode_s * 1e3}
  row["floor_ms"] = (weight_bytes_per_step(cfg, batch) + cache_bytes_per_step(
      cfg, batch, context)) / (args.hbm_tbs * 1e12) * 1e3
  if not args.skip_prefill:
    toks = rng.integers(0, cfg.vocab_size, (batch, engine.prefill_chunk))
    P = engine.prefill_chunk
    n = np.full(batch, P)
    first = _median_s(lambda: engine.step(toks, np.zeros(batch), n)[0], args.prefill_repeats)
    last = _median_s(lambda: engine.step(toks, np.full(batch, context - P), n)[0],
                     args.prefill_repeats)
    row["prefill_piece"] = P
    row["prefill_tok_s"] = batch * context / (context / P * (first + last) / 2)
  del engine
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="small")
  p.add_argument("--batches", default="1,8,64")
  p.add_argument("--contexts", default="8192,65536")
  p.add_argument("--prefill-chunk", type=int, default=4096)
  p.add_argument("--prefill-tokens", type=int, default=32768,
                 help="cap on batch x piece tokens per prefill call")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--prefill-repeats", type=int, default=3)
  p.add_argument("--skip-prefill", action="store_true")
  p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
  p.add_argument("--budget-s", type=float, default=1e9,
                 help="start no new configuration after this many seconds")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="ModelConfig override, e.g. --set gmm_backend=ragged_dot")
  p.add_argument("--out")
  args = p.parse_args(argv)
  overrides = {}
  for kv in args.set:
    k, v = kv.split("=", 1)
    overrides[k] = type(getattr(get_preset(args.preset), k))(v)
  cfg = get_preset(args.preset, **overrides)
  t_start = time.perf_counter()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  print(f"{args.preset} preset on {jax.devices()[0].device_kind}; model built in "
        f"{time.perf_counter() - t_start:.0f} s", flush=True)
  header = ("| batch | context | decode step (ms) | bandwidth floor (ms) | floor / step | "
            "prefill piece | prefill (tokens/s) |\n|---|---|---|---|---|---|---|")
  lines = [header]
  print(header, flush=True)
  for context in [int(c) for c in args.contexts.split(",")]:
    for batch in [int(b) for b in args.batches.split(",")]:
      if time.perf_counter() - t_start > args.budget_s:
        print(f"(budget reached: B={batch}, L={context} not run)", flush=True)
        continue
      r = run(cfg, model, batch, context, args)
      pre = (f"{r['prefill_piece']} | {r['prefill_tok_s']:,.0f}" if "prefill_tok_s" in r
             else "- | -")
      line = (f"| {batch} | {context:,} | {r['decode_ms']:.2f} | {r['floor_ms']:.3f} | "
              f"{r['floor_ms'] / r['decode_ms']:.2f} | {pre} |")
      lines.append(line)
      print(line, flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
