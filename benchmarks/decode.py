r"""Prefill throughput and decode step time of the inference engine, beside the bandwidth floor.

    python -m benchmarks.decode                          # small preset, batch 1/8/64 x 8K/64K
    python -m benchmarks.decode --preset tiny --batches 1,2 --contexts 256 --prefill-chunk 64 \
        --decode-steps 8                                 # CPU smoke run (seconds)
    python -m benchmarks.decode --profile /tmp/prof ...  # also: where a step's time goes

For each (batch B, context L) the engine (sparse_lm.inference.Engine, bf16 weights and caches
for the small preset) is built with max_length = L and B slots, and:
  decode   the engine's decode call: --decode-steps steps for all B rows in one device call
           (Engine.decode: a lax.while_loop on the device, caches donated), starting at length
           L - steps - 1 so every row's latent cache is (nearly) full; time per step = median
           of --repeats calls after a compile-and-warm-up call, / steps. The cache contents do
           not change the work (a decode step reads the whole allocated cache), so the cache
           is not filled by a real prefill first. --single-step also times one `Engine.step`
           call per token (a host round trip per token, as the engine ran before the loop).
  floor    bytes the step must read / HBM bandwidth (--hbm-tbs, 4.8 TB/s for an H200):
           every non-expert decoder weight once (embedding: only B rows; not the image
           encoder), the routed experts the batch
           can touch (E (1 - (1 - k/E)^B) per MoE layer: uniform routing), the KDA states
           (read and written, fp32) and conv tails, and B x L latent-cache entries per MLA
           layer. ratio = floor / measured (1 = at the bandwidth limit).
  prefill  one piece of P = min(--prefill-chunk, --prefill-tokens / B) tokens per row at the
           start of the context and one at its end (its attention reads the whole cache);
           a whole prompt of L tokens costs about (L / P) x their mean, so
           tokens/s = B L / ((L / P) x mean).
--fused-ablate: the decode step with each part of the fused Pallas path (sparse_lm/inference/
fused.FUSE: AttnRes reads, KDA step, routed experts, routing in the experts kernel) switched
from its default in turn, then all off.
--moe-variants: the decode step of the first configuration with other settings of the routed-
experts kernel (hidden columns per program, warps, pipeline stages, tensor-core dots), timed
inside the step, where its weights come from HBM (benchmarks/decode_kernels.py times kernels
alone, weights hot in L2).
--profile DIR (first configuration only): a jax.profiler trace of one decode call, one
single step, and one single step with the model's own MoE (the engine's decode path before
`moe_decode`), each summarised as its top device ops by total time.
Prints a markdown table; --out also writes it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.cli_args import parse_model_sets
from sparse_lm.config import get_preset
from sparse_lm.inference import Engine, cache_bytes, engine as engine_lib, forward as forward_lib
from sparse_lm.inference import fused
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
    if names[0] == "vision":  # the image encoder runs on images, never in a decode step
      continue
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


def _sig(x: float, places: int) -> str:
  """x with `places` decimals, or 3 significant digits where that would print 0 (a tiny
  preset's floor on a CPU is microseconds: it printed 0.000 ms and a ratio of 0.00)."""
  return f"{x:.{places}f}" if x == 0 or abs(x) >= 10 ** -places else f"{x:.3g}"


def _median_s(fn, repeats: int, label: str = "") -> float:
  """Median wall time of `repeats` calls after one compile-and-warm-up call; with a label,
  prints every call's time (the warm-up's too)."""
  times = []
  for _ in range(repeats + 1):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  if label:  # with the engine's compiled programs so far (a recompile shows as a jump)
    compiled = engine_lib._step._cache_size() + engine_lib._decode._cache_size()
    print(f"  {label}: " + ", ".join(f"{t:.4f}" for t in times) + " s (first: warm-up); "
          f"{compiled} engine programs compiled", flush=True)
  return statistics.median(times[1:])


# --moe-variants keys -> the sparse_lm.inference.fused constants they set
MOE_KNOBS = {"block_f": "MOE_BLOCK_F", "num_warps": "MOE_WARPS", "num_stages": "MOE_STAGES",
             "use_dot": "MOE_DOT"}


def parse_moe_variants(text: str) -> list[dict]:
  """'block_f=16;num_stages=2,num_warps=8' -> [{"block_f": 16}, {"num_stages": 2,
  "num_warps": 8}]. Raises ValueError naming the bad key or value."""
  out = []
  for part in text.split(";"):
    change = {}
    for kv in filter(None, part.split(",")):
      k, _, v = kv.partition("=")
      if k not in MOE_KNOBS or not v:
        raise ValueError(f"--moe-variants: {kv!r}: keys are {sorted(MOE_KNOBS)}, as key=value")
      if k == "use_dot":
        if v not in ("0", "1", "true", "false"):
          raise ValueError(f"--moe-variants: use_dot={v!r} must be 0/1 or true/false")
        change[k] = v in ("1", "true")
      else:
        try:
          change[k] = int(v)
        except ValueError:
          raise ValueError(f"--moe-variants: {k}={v!r} must be an integer") from None
    if change:
      out.append(change)
  return out


def top_ops(trace_dir: str, n: int = 12) -> str:
  """The n ops with the most total time on the device tracks, and on the host tracks, of the
  newest perfetto trace under trace_dir (jax.profiler.trace(..., create_perfetto_trace=True))."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                          recursive=True), key=os.path.getmtime)[-1]
  with gzip.open(path) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  lines = []
  for where in ("device", "host"):
    pids = {pid for pid, name in names.items()
            if ("/device:" in name and "CPU" not in name) == (where == "device")}
    total, count = collections.Counter(), collections.Counter()
    for e in events:
      if (e.get("ph") == "X" and e["pid"] in pids
          and not any(w in e["name"] for w in ("profiler.py", "contextlib.py"))):
        total[e["name"]] += e.get("dur", 0)
        count[e["name"]] += 1
    lines.append(f"  {where}: {sum(total.values()) / 1e3:.3f} ms in {sum(count.values())} "
                 f"events on {sorted(names[p] for p in pids)}")
    if where == "device":
      kinds, kind_count = collections.Counter(), collections.Counter()
      for name, us in total.items():
        kind = re.sub(r"([._]\d+)+$", "", name)
        kinds[kind] += us
        kind_count[kind] += count[name]
      lines.append("  by kind (names without their numbers): " + "; ".join(
          f"{kind} {kind_count[kind]} x {us / 1e3:.3f} ms" for kind, us in kinds.most_common(n)))
    first = {}
    for e in events:
      if e.get("ph") == "X" and e["pid"] in pids:
        first.setdefault(e["name"], e.get("args", {}))
    for name, us in total.most_common(n if where == "device" else n // 2):
      lines.append(f"  {us / 1e3:9.3f} ms  {count[name]:6d} x  {name[:100]}")
      if where == "device" and os.environ.get("DECODE_PROFILE_ARGS"):
        lines.append(f"      {str(first[name])[:400]}")
  return "\n".join(lines)


PROFILE_CASES = ("decode call", "single step", "single step model MoE")


def profile(engine, batch: int, length: int, trace_dir: str, repeats: int, top: int = 12,
            cases_wanted: str = ",".join(PROFILE_CASES)) -> None:
  """Trace one decode call, one single step, and one single step with the model's MoE
  (`cases_wanted`: which of them, comma-separated); print the `top` device ops of each."""
  rng = np.random.default_rng(1)
  tok = rng.integers(0, engine.cfg.vocab_size, (batch,))
  at = np.full(batch, length)
  cases = [("decode call", lambda: engine.decode(tok, at)[0]),
           ("single step", lambda: engine.step(tok[:, None], at, np.ones(batch))[0]),
           ("single step, model MoE", lambda: engine.step(tok[:, None], at, np.ones(batch))[0])]
  for name, fn in cases:
    if name.replace(",", "") not in [c.strip() for c in cases_wanted.split(",")]:
      continue
    if name.endswith("model MoE"):
      forward_lib.DECODE_MOE = "model"
      jax.clear_caches()
    median = _median_s(fn, repeats)
    sub = os.path.join(trace_dir, name.replace(" ", "_").replace(",", ""))
    with jax.profiler.trace(sub, create_perfetto_trace=True):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      wall = time.perf_counter() - t0
    print(f"profile B={batch} L={length}: {name}: {median * 1e3:.2f} ms (median of "
          f"{repeats}), {wall * 1e3:.2f} ms traced\n"
          f"{top_ops(sub, top)}", flush=True)
  forward_lib.DECODE_MOE = "moe_decode"
  jax.clear_caches()


def decode_row(cfg, model, batch: int, context: int, args) -> dict:
  """Decode step time (and the profile, if asked) of one configuration."""
  engine = Engine(model, max_length=context, max_batch=batch, decode_steps=args.decode_steps)
  tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch,))
  at = np.full(batch, context - args.decode_steps - 1)
  row = {"decode_ms": _median_s(lambda: engine.decode(tok, at)[0],
                                args.repeats) / args.decode_steps * 1e3}
  if args.single_step:
    row["step_ms"] = _median_s(lambda: engine.step(tok[:, None], at, np.ones(batch))[0],
                               args.repeats) * 1e3
  row["floor_ms"] = (weight_bytes_per_step(cfg, batch) + cache_bytes_per_step(
      cfg, batch, context)) / (args.hbm_tbs * 1e12) * 1e3
  if args.profile:
    profile(engine, batch, context - args.decode_steps - 1, args.profile, args.repeats,
            args.top, args.profile_cases)
    args.profile = None
  return row


def prefill_row(cfg, model, batch: int, context: int, args) -> dict:
  """Prefill tokens/s of one configuration (see the module docstring)."""
  chunk = max(16, min(args.prefill_chunk, args.prefill_tokens // batch, context))
  engine = Engine(model, max_length=context, max_batch=batch, prefill_chunk=chunk)
  P = engine.prefill_chunk
  toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, P))
  n = np.full(batch, P)
  first = _median_s(lambda: engine.step(toks, np.zeros(batch), n)[0], args.prefill_repeats,
                    f"prefill B={batch} L={context} first piece")
  last = _median_s(lambda: engine.step(toks, np.full(batch, context - P), n)[0],
                   args.prefill_repeats, f"prefill B={batch} L={context} last piece")
  return {"prefill_piece": P, "prefill_first_s": first, "prefill_last_s": last,
          "prefill_tok_s": batch * context / (context / P * (first + last) / 2)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="small")
  p.add_argument("--batches", default="1,8,64")
  p.add_argument("--contexts", default="8192,65536")
  p.add_argument("--prefill-chunk", type=int, default=4096)
  p.add_argument("--prefill-tokens", type=int, default=32768,
                 help="cap on batch x piece tokens per prefill call")
  p.add_argument("--configs", help="BATCHxCONTEXT,... instead of --batches x --contexts")
  p.add_argument("--parts", default="decode,prefill", help="what to time: decode, prefill")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--decode-steps", type=int, default=64, help="decode steps per device call")
  p.add_argument("--single-step", action="store_true",
                 help="also time one Engine.step call per token")
  p.add_argument("--profile", metavar="DIR", help="trace the first configuration into DIR")
  p.add_argument("--top", type=int, default=12, help="device ops listed per profiled case")
  p.add_argument("--profile-cases", default="decode call,single step,single step model MoE",
                 help="which of the profiled cases to run (comma-separated)")
  p.add_argument("--prefill-repeats", type=int, default=3)
  p.add_argument("--skip-prefill", action="store_true")
  p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
  p.add_argument("--budget-s", type=float, default=1e9,
                 help="start no new configuration after this many seconds")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="ModelConfig override, e.g. --set gmm_backend=ragged_dot")
  p.add_argument("--fused-ablate", action="store_true",
                 help="decode step of the first configuration with each part of the fused "
                 "Pallas decode path (decode_backend=pallas) switched in turn")
  p.add_argument("--moe-variants", metavar="K=V,...;K=V,...",
                 help="decode step of the first configuration with each variant of the routed-"
                 "experts kernel's settings (keys: block_f, num_warps, num_stages, use_dot; "
                 "e.g. 'block_f=16;num_stages=2;num_warps=8,block_f=64'), after the default")
  p.add_argument("--out")
  args = p.parse_args(argv)
  for flag, value in (("--repeats", args.repeats), ("--decode-steps", args.decode_steps),
                      ("--prefill-repeats", args.prefill_repeats),
                      ("--prefill-chunk", args.prefill_chunk),
                      ("--prefill-tokens", args.prefill_tokens), ("--top", args.top)):
    if value < 1:
      p.error(f"{flag} {value}: expected a positive integer")
  if args.hbm_tbs <= 0:
    p.error(f"--hbm-tbs {args.hbm_tbs}: expected a positive bandwidth (TB/s)")
  cases = [c.strip() for c in args.profile_cases.split(",") if c.strip()]
  if not cases or set(cases) - set(PROFILE_CASES):
    p.error(f"--profile-cases {args.profile_cases!r}: expected a comma list of "
            f"{', '.join(PROFILE_CASES)}")
  try:
    variants = parse_moe_variants(args.moe_variants) if args.moe_variants else []
  except ValueError as e:
    p.error(str(e))
  parts = set(args.parts.split(","))
  if not parts or parts - {"decode", "prefill"}:
    p.error(f"--parts {args.parts!r}: expected decode, prefill or decode,prefill")
  try:
    configs = ([tuple(int(x) for x in bc.split("x")) for bc in args.configs.split(",")]
               if args.configs else
               [(int(b), int(c)) for c in args.contexts.split(",")
                for b in args.batches.split(",")])
  except ValueError:
    p.error(f"--configs {args.configs!r} / --batches {args.batches!r} / --contexts "
            f"{args.contexts!r}: expected BATCHxCONTEXT,... (e.g. 1x8192,8x8192) / comma lists "
            "of positive ints")
  for bc in configs:
    if len(bc) != 2 or min(bc) < 1:
      p.error(f"configuration {'x'.join(map(str, bc))}: expected BATCHxCONTEXT, both positive")
    batch, context = bc
    if "decode" in parts and args.decode_steps >= context:
      p.error(f"--decode-steps {args.decode_steps} must be below the context ({context}): the "
              "timed steps start at context - decode-steps - 1")
  try:
    cfg = get_preset(args.preset, **parse_model_sets(args.set))
    cfg.validate()
  except ValueError as e:
    p.error(f"--preset {args.preset!r} / --set: {e}")
  t_start = time.perf_counter()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  print(f"{args.preset} preset on {jax.devices()[0].device_kind}; model built in "
        f"{time.perf_counter() - t_start:.0f} s", flush=True)
  header = ("| batch | context | decode step (ms) | bandwidth floor (ms) | floor / step | "
            "one step per call (ms) | prefill piece | prefill (tokens/s) |\n"
            "|---|---|---|---|---|---|---|---|")
  rows = {bc: {} for bc in configs}
  if args.fused_ablate:
    batch, context = configs[0]
    default = dict(fused.FUSE)
    sets = ([("default", {})] + [(f"-{k}", {k: False}) for k, on in default.items() if on] +
            [(f"+{k}", {k: True}) for k, on in default.items() if not on] +
            [("none (= xla)", {k: False for k in default})])
    for label, change in sets:
      fused.FUSE.update(default)
      fused.FUSE.update(change)
      jax.clear_caches()
      r = decode_row(cfg, model, batch, context, args)
      print(f"fused-ablate B={batch} L={context} {label}: {r['decode_ms']:.3f} ms/step",
            flush=True)
    fused.FUSE.update(default)
    jax.clear_caches()
  if variants:
    batch, context = configs[0]
    default = {k: getattr(fused, name) for k, name in MOE_KNOBS.items()}
    for change in [{}] + variants:
      for k, v in {**default, **change}.items():
        setattr(fused, MOE_KNOBS[k], v)
      jax.clear_caches()
      label = ", ".join(f"{k}={v}" for k, v in change.items()) or "default " + ", ".join(
          f"{k}={v}" for k, v in default.items())
      try:
        r = decode_row(cfg, model, batch, context, args)
        print(f"moe-variant B={batch} L={context} {label}: {r['decode_ms']:.3f} ms/step",
              flush=True)
      except Exception as e:  # pylint: disable=broad-except  (a variant Triton refuses)
        print(f"moe-variant B={batch} L={context} {label}: failed: {str(e)[:300]}", flush=True)
    for k, v in default.items():
      setattr(fused, MOE_KNOBS[k], v)
    jax.clear_caches()
  # Decode for every configuration first (the acceptance numbers), then prefill.
  for part, fn in (("decode", decode_row), ("prefill", prefill_row)):
    if part not in args.parts.split(",") or (part == "prefill" and args.skip_prefill):
      continue
    for batch, context in configs:
      if time.perf_counter() - t_start > args.budget_s:
        print(f"(budget reached: {part} B={batch}, L={context} not run)", flush=True)
        continue
      rows[batch, context].update(fn(cfg, model, batch, context, args))
      print(f"{part} B={batch} L={context}: {rows[batch, context]}", flush=True)
  lines = [header]
  for (batch, context), r in rows.items():
    if "decode_ms" in r:
      dec = (f"{r['decode_ms']:.3f} | {_sig(r['floor_ms'], 3)} | "
             f"{_sig(r['floor_ms'] / r['decode_ms'], 2)}")
    else:
      dec = "not run | | "
    step = f"{r['step_ms']:.2f}" if "step_ms" in r else "-"
    pre = (f"{r['prefill_piece']} | {r['prefill_tok_s']:,.0f}" if "prefill_tok_s" in r
           else "- | -")
    lines.append(f"| {batch} | {context:,} | {dec} | {step} | {pre} |")
  print("\n".join(lines), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
