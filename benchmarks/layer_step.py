r"""Time one decoder layer's forward + backward as the train step runs it: a quick loop for
kernel work on a GPU, where the whole `small` step takes 4 minutes to compile.

    python -m benchmarks.layer_step --mixer kda                 # small preset, 8 x 8192 tokens
    python -m benchmarks.layer_step --mixer mla --profile /tmp/lp --top 20
    python -m benchmarks.layer_step --preset tiny --batch 2 --seq-len 256 --repeats 3   # CPU
    python -m benchmarks.layer_step --remat save_kda --residuals --set kda_backend=pallas_gpu \
        --set gmm_backend=ragged_dot     # any machine: what the policy keeps for the backward

The layer (`transformer.DecoderLayer`: AttnRes reads, pre-norms, the KDA or MLA mixer, the
LatentMoE or dense FFN) runs under `jax.checkpoint` with the preset's remat policy (as
`transformer._remat_call` wraps it), on a mid-network stream: 3 of the stack's slots filled, a
partial block sum, a layer inside a block (`opens_block=False`); rows packed with 2 documents
each (segment ids 1, 2). The loss is the output stream's partial sum against a fixed random
cotangent; the timed program is `jax.jit(jax.value_and_grad)` in the layer's parameters and the
input stream's stack and partial sum (no optimizer). Prints the median of --repeats calls after 2 warm-up calls, the
compiled temporaries, and with --profile the device time per named scope and the top kernels
(`benchmarks/trace_summary.py`; run with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` so
every kernel keeps its name).

--residuals traces the program without compiling or running it and prints the bytes that
cross the `jax.checkpoint` boundary, by kind (the layer's arguments; each
`checkpoint_name` the policy saves; anything else), from `jax.ad_checkpoint.
print_saved_residuals`: what the remat policy costs in memory per layer. It is jax's account;
the compiler may keep less of what is not named (it can recompute cheap values) but keeps
what a policy saves by name.
"""

from __future__ import annotations

import argparse
import time

GIB = 2**30


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
  p.add_argument("--preset", default="small", choices=("tiny", "small", "full"))
  p.add_argument("--mixer", default="kda", choices=("kda", "mla"))
  p.add_argument("--ffn", default="moe", choices=("moe", "dense"))
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=8192)
  p.add_argument("--remat", default=None, help="override ModelConfig.remat_policy")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="override a ModelConfig field (repeatable; the value is parsed to the "
                      "field's type: true/false, none for an optional field)")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--profile", metavar="DIR", default=None)
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--residuals", action="store_true",
                 help="print the bytes saved for the backward pass by kind; no compile or run")
  args = p.parse_args(argv)
  for flag, value in (("--batch", args.batch), ("--seq-len", args.seq_len),
                      ("--repeats", args.repeats), ("--top", args.top)):
    if value < 1:
      p.error(f"{flag} {value}: expected a positive integer")
  if args.seq_len % 2:
    p.error("--seq-len must be even (two documents per row)")

  import dataclasses
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from sparse_lm import nn
  from sparse_lm import sharding as shd
  from sparse_lm.config import get_preset
  from sparse_lm.model import attnres
  from sparse_lm.model.transformer import DecoderLayer
  from sparse_lm.sharding import MeshLayout

  from benchmarks.cli_args import parse_model_sets
  cfg = get_preset(args.preset)
  try:  # each value parsed to its field's type ("none" is None for an optional field)
    overrides = parse_model_sets(
        args.set + ([f"remat_policy={args.remat}"] if args.remat else []))
    cfg = dataclasses.replace(cfg, **overrides)
    cfg.validate()
  except (TypeError, ValueError) as e:
    p.error(str(e))
  if cfg.residual != "attnres_block":
    p.error("the stream set up here is attnres_block's (the presets' residual)")

  mesh = shd.make_mesh(MeshLayout(), jax.devices()[:1])
  B, T, D = args.batch, args.seq_len, cfg.d_model
  n = attnres.num_sources(cfg)
  with shd.use_mesh(mesh):
    layer = DecoderLayer(cfg, mixer=args.mixer, dense_ffn=args.ffn == "dense",
                         rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    policy = nn.remat_policy(cfg.remat_policy)
    k = jax.random.split(jax.random.key(1), 4)
    stream = {
        "stack": (jax.random.normal(k[0], (n, B, T, D), jnp.float32)
                  * (jnp.arange(n) < 3)[:, None, None, None]).astype(attnres.stack_dtype(cfg)),
        "count": jnp.asarray(3, jnp.int32),
        "partial": jax.random.normal(k[1], (B, T, D), jnp.float32),
        "has_partial": jnp.asarray(True)}
    dy = jax.random.normal(k[2], (B, T, D), jnp.float32)
    segment_ids = jnp.asarray(np.repeat(np.array([[1, 2]], np.int32), T // 2, axis=1)
                              .repeat(B, axis=0))

    def call(params, rest, stream, segment_ids):
      m = nnx.merge(graphdef, params, rest, copy=True)  # as train/step.py merges
      out, _ = m(stream, opens_block=False, segment_ids=segment_ids, valid=segment_ids != 0,
                 train=True)
      return out["partial"]  # the balancer statistics' updates are dropped

    if policy is not None:
      call = jax.checkpoint(call, policy=policy)

    def loss(params, rest, stack, partial):
      s = dict(stream, stack=stack, partial=partial)
      return jnp.vdot(call(params, rest, s, segment_ids), dy)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))
    inputs = (params, rest, stream["stack"], stream["partial"])
    if args.residuals:
      print(f"{args.preset} {args.mixer} + {args.ffn}, {B} x {T} tokens, remat "
            f"{cfg.remat_policy}, kda_backend {cfg.kda_backend}, gmm_backend {cfg.gmm_backend}")
      print(residual_table(loss, inputs))
      return
    t0 = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    for _ in range(2):
      out = jax.block_until_ready(compiled(*inputs))
    ts = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      out = jax.block_until_ready(compiled(*inputs))
      ts.append(time.perf_counter() - t0)
    summary = None
    if args.profile:
      from benchmarks import trace_summary
      with jax.profiler.trace(args.profile, create_perfetto_trace=True):
        for _ in range(3):
          out = compiled(*inputs)
        jax.block_until_ready(out)
      summary = trace_summary.summarize(args.profile, steps=3, top=args.top,
                                        hlo_text=compiled.as_text())
  print(f"{jax.devices()[0].device_kind}: {args.preset} {args.mixer} + {args.ffn}, "
        f"{B} x {T} tokens, remat {cfg.remat_policy}, kda_backend {cfg.kda_backend}")
  temps = f"{mem.temp_size_in_bytes / GIB:.2f} GiB" if mem is not None else "n/a"
  print(f"compile {compile_s:.1f} s, temporaries {temps}; forward + backward "
        f"{1e3 * float(np.median(ts)):.2f} ms (median of {args.repeats}); loss "
        f"{float(out[0]):.6e}", flush=True)
  if summary:
    print(summary)


def residual_table(fn, inputs) -> str:
  """A markdown table of what `fn(*inputs)`'s forward saves for its backward pass: GiB and
  count by kind ("arguments", "named NAME" for each checkpoint_name, "other (FUNCTION)" by
  the function that made it; a value named inside a shard_map shows as that shard_map's
  output)."""
  import contextlib
  import io
  import re
  import jax
  import numpy as np
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, *inputs)
  kinds: dict[str, list] = {}
  for line in buf.getvalue().splitlines():
    m = re.match(r"(\w+)\[([\d,]*)\]\s+(.*)", line.strip())
    if not m:
      continue
    dtype, shape, what = m.groups()
    bits = re.fullmatch(r"[a-z]+(\d+)", dtype)  # f32, bf16, i32, u8, ...; bool: 1 byte
    itemsize = int(bits.group(1)) // 8 if bits else 1
    size = int(np.prod([int(d) for d in shape.split(",") if d])) * itemsize
    named = re.match(r"named '([^']+)'", what)
    where = re.search(r"\((\S+)\)$", what)  # the function that made it
    kind = ("arguments" if what.startswith("from the argument") else
            f"named {named.group(1)}" if named else
            f"other ({where.group(1)})" if where else "other")
    kinds.setdefault(kind, [0, 0])
    kinds[kind][0] += size
    kinds[kind][1] += 1
  rows = ["| kind | GiB | arrays |", "|---|---|---|"]
  rows += [f"| {k} | {v[0] / GIB:.3f} | {v[1]} |" for k, v in sorted(kinds.items())]
  total = sum(v[0] for v in kinds.values())
  rows.append(f"| total | {total / GIB:.3f} | {sum(v[1] for v in kinds.values())} |")
  return "\n".join(rows)


if __name__ == "__main__":
  main()
