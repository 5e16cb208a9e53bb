"""Tokens/s, step time and MFU of one optimizer step at stage_8k's shape, on one device.

  python benchmarks/train_step.py                       # small preset, 8K tokens, 1 device
  python benchmarks/train_step.py --preset tiny --quick # CPU smoke run (~1 min on 2 cores)
  python benchmarks/train_step.py --data real --steps 1 --set kda_backend=xla
                                     # the stage's own first batches; prints each step's loss
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/train_step.py --profile /tmp/tr
                                     # + device time by named scope (KDA, MoE, AttnRes, ...)
  for r in full save_kda; do XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/train_step.py \
      --remat $r --compile-only --compilation-cache /tmp/jcc & done; wait   # compile at once,
  for r in full save_kda; do python benchmarks/train_step.py --remat $r \
      --compilation-cache /tmp/jcc; done        # then time each, its compile from the cache
                                     # (the same XLA_FLAGS in both: they are in the cache key;
                                     # no preallocation where several processes share a GPU)

The step is the real one (`sparse_lm.train.loop.build`: AdamW, clipping, gradient
accumulation, Quantile Balancing update, donated state) on synthetic packed batches (random
tokens, 2 documents per row), so the number does not depend on the input pipeline. MFU uses
`sparse_lm.model.params.flops_per_token` and the device's dense bf16 peak
(`sparse_lm.train.metrics.PEAK_FLOPS`); it is n/a on CPU. Prints a table.

`--data real` feeds the stage's own training batches instead (its data pipeline and tokenizer,
trained into `--workdir` if none is cached there, images included where the preset has them)
and prints every step's loss, gradient norm and `finite` flag: the way to split a non-finite
step by component (`--set kda_backend=xla`, `--set attention_backend=xla_chunked`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


GIB = 1024**3


def synthetic_batch(rows: int, seq_len: int, vocab: int, seed: int = 0,
                    shapes: dict | None = None) -> dict:
  """Random tokens in 2 packed documents per row. `shapes` (`builder.batch_shapes`) adds the
  stage's image keys, if any, as rows without an image (zero patches, image segment 0), so a
  preset with a vision encoder runs its text step."""
  import numpy as np
  rng = np.random.default_rng(seed)
  extra = {k: np.zeros(shape, dtype) for k, (shape, dtype) in (shapes or {}).items()
           if k.startswith("image_")}
  tokens = rng.integers(4, vocab, size=(rows, seq_len), dtype=np.int32)
  seg = np.ones((rows, seq_len), np.int32)
  seg[:, seq_len // 2:] = 2
  pos = np.concatenate([np.arange(seq_len // 2), np.arange(seq_len - seq_len // 2)])
  return {"tokens": tokens, "segment_ids": seg,
          "positions": np.broadcast_to(pos, (rows, seq_len)).astype(np.int32).copy(),
          "loss_mask": np.ones((rows, seq_len), np.float32), **extra}


def real_batches(stage, workdir: str, rows: int, count: int) -> list[dict]:
  """The first `count` training batches of `stage` (its data config, tokenizer and patch
  size), `rows` sequences each, as numpy arrays: what the training loop's first steps get."""
  from sparse_lm import data as data_lib
  from sparse_lm.interop import workdir as hf_import
  cfg = stage.model_config()
  tokenizer = data_lib.load_or_train_tokenizer(
      hf_import.data_config(stage.data, stage.init_from), workdir, cfg.vocab_size)
  it = data_lib.make_train_iterator(stage.data, tokenizer, seq_len=stage.seq_len,
                                    batch_size=rows, patch_size=cfg.vision_patch_size)
  return [next(it) for _ in range(count)]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="small", choices=("tiny", "small", "full"))
  p.add_argument("--seq-len", type=int, default=None, help="default: stage_8k's length")
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per step (default: stage_8k's batch, capped at 8 on 1 device)")
  p.add_argument("--micro-batches", type=int, default=1)
  p.add_argument("--remat", default=None,
                 help="override ModelConfig.remat_policy (none, full, save_dots, minimal, ...)")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="override any other ModelConfig field (repeatable)")
  p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
  p.add_argument("--quick", action="store_true", help="3 timed steps (CPU smoke run)")
  p.add_argument("--data", choices=("synthetic", "real"), default="synthetic",
                 help="synthetic rows (default) or the stage's own first training batches")
  p.add_argument("--profile", metavar="DIR", default=None,
                 help="after the timed steps, trace 3 more into DIR (with the compiled program's "
                      "text, DIR/step.hlo.txt.gz) and print the device "
                      "time per named scope (benchmarks/trace_summary.py); run with "
                      "XLA_FLAGS=--xla_gpu_enable_command_buffer= so every kernel is named")
  p.add_argument("--workdir", default="/tmp/train_step_bench",
                 help="with --data real: where the stage's tokenizer is cached or trained")
  p.add_argument("--compilation-cache", metavar="DIR", default=None,
                 help="keep compiled programs in DIR (jax's persistent cache): a later run of "
                      "the same configuration with the same DIR skips its compile")
  p.add_argument("--compile-only", action="store_true",
                 help="compile the step from the abstract state and batch into "
                      "--compilation-cache and exit: nothing on the device, no data. Several "
                      "at once (one per configuration) compile in parallel")
  args = p.parse_args(argv)
  for flag, value in (("--seq-len", args.seq_len), ("--batch", args.batch),
                      ("--micro-batches", args.micro_batches), ("--steps", args.steps)):
    if value is not None and value < 1:  # 0 used to mean the default (--batch, --seq-len)
      p.error(f"{flag} {value}: expected a positive integer")
  if args.compile_only and not args.compilation_cache:
    p.error("--compile-only needs --compilation-cache DIR (where the compiled step is kept)")

  import jax
  import numpy as np
  from experiments import base, stage_8k
  from sparse_lm import sharding as shd
  from sparse_lm.model.params import count_params, flops_per_token
  from sparse_lm.sharding import MeshLayout
  from sparse_lm.train import loop, metrics
  from sparse_lm.train.builder import batch_shapes

  stage = stage_8k.STAGES[args.preset]
  sets = [f"model.{item}" for item in args.set]
  if args.remat:
    sets.append(f"model.remat_policy={args.remat}")
  try:  # the experiments' own --set parser: typed values, unknown fields listed
    stage = base.apply_overrides(stage, sets)
  except ValueError as e:
    p.error(str(e))
  seq_len = args.seq_len if args.seq_len is not None else stage.seq_len
  batch = args.batch if args.batch is not None else min(stage.global_batch, 8)
  steps = 3 if args.quick else args.steps
  stage = dataclasses.replace(stage, seq_len=seq_len, tokens_per_batch=batch * seq_len,
                              micro_batches=args.micro_batches, steps=1000,
                              mesh=MeshLayout())
  try:  # before anything is built or compiled
    stage.validate()
  except ValueError as e:
    p.error(f"--batch {batch} / --seq-len {seq_len} / --micro-batches {args.micro_batches}: "
            f"{e}")
  cfg = stage.model_config()
  mesh = shd.make_mesh(stage.mesh, jax.devices()[:1])
  if args.compilation_cache:
    base.enable_compilation_cache(args.compilation_cache)
  parts = loop.build(stage, mesh)
  sh = parts.batch_shardings
  if args.compile_only:
    from sparse_lm.train.precompile import abstract_batch
    with shd.use_mesh(mesh):
      t0 = time.perf_counter()
      compiled = parts.train_step.lower(
          shd.with_shardings(parts.abstract_state, parts.state_shardings),
          abstract_batch(batch_shapes(stage, batch, seq_len), sh)).compile()
      mem = compiled.memory_analysis()
    skip = f" (last {cfg.remat_skip_last} units kept)" if cfg.remat_skip_last else ""
    print(f"compile-only: {args.preset}, remat {cfg.remat_policy}{skip}, {batch} x {seq_len} "
          f"tokens: compiled in {time.perf_counter() - t0:.1f} s into "
          f"{args.compilation_cache}" + (f"; arguments {mem.argument_size_in_bytes / GIB:.2f} "
                                        f"GiB, temporaries {mem.temp_size_in_bytes / GIB:.2f} "
                                        f"GiB" if mem is not None else ""), flush=True)
    return
  with shd.use_mesh(mesh):
    state = parts.init()
    if args.data == "real":
      rows = real_batches(stage, args.workdir, batch, 2)
    else:
      rows = [synthetic_batch(batch, seq_len, cfg.vocab_size, s,
                              batch_shapes(stage, batch, seq_len)) for s in range(2)]
    batches = [{k: jax.device_put(np.asarray(v), sh[k]) for k, v in b.items() if k in sh}
               for b in rows]
    t0 = time.perf_counter()
    step_fn = parts.train_step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = step_fn.memory_analysis()
    if mem is not None:
      print(f"compiled: arguments {mem.argument_size_in_bytes / GIB:.2f} GiB, temporaries "
            f"{mem.temp_size_in_bytes / GIB:.2f} GiB", flush=True)
    def show(i, m):
      if args.data == "real":
        print(f"step {i}: loss {float(m['loss']):.4f} grad_norm {float(m['grad_norm']):.4f} "
              f"finite {int(m['finite'])}", flush=True)
    for i in range(2):
      state, m = step_fn(state, batches[i])
      jax.block_until_ready(m)
      show(i, m)
    t0 = time.perf_counter()
    for i in range(steps):
      state, m = step_fn(state, batches[i % 2])
    jax.block_until_ready(m)
    show(2 + steps - 1, m)
    step_s = (time.perf_counter() - t0) / steps
    last_loss = float(m["loss"])  # the last timed step's (not a profiled step's)
    if args.profile:
      from benchmarks import trace_summary
      with jax.profiler.trace(args.profile, create_perfetto_trace=True):
        for i in range(3):
          state, m = step_fn(state, batches[i % 2])
        jax.block_until_ready(m)
      hlo_text = step_fn.as_text()
      # names every fusion of the trace (what it reads, writes, computes); gzipped: the small
      # step's text is 37 MB
      with gzip.open(os.path.join(args.profile, "step.hlo.txt.gz"), "wt") as f:
        f.write(hlo_text)
      print(trace_summary.summarize(args.profile, steps=3, hlo_text=hlo_text), flush=True)

  tokens = batch * seq_len
  tps = tokens / step_s
  fpt = flops_per_token(cfg, seq_len)["total"]
  peak = metrics.peak_flops_per_device()
  mfu = metrics.mfu(tps, fpt, 1, peak)
  n = count_params(cfg)
  rows = [
      ("device", jax.devices()[0].device_kind),
      ("preset", f"{args.preset} ({n['total'] / 1e6:,.1f}M total, "
                 f"{n['active'] / 1e6:,.1f}M active params)"),
      ("shape", f"{batch} x {seq_len} tokens, {args.micro_batches} micro-batch(es)"),
      ("remat policy", cfg.remat_policy + (f", the last {cfg.remat_skip_last} units kept"
                                            if cfg.remat_skip_last else "")),
      ("LM-head cotangent", cfg.lm_head_grad_dtype or "float32"),
      ("compile", f"{compile_s:.1f} s"),
      ("compiled temporaries", f"{mem.temp_size_in_bytes / GIB:.2f} GiB" if mem else "n/a"),
      ("step time", f"{1e3 * step_s:.1f} ms (mean of {steps})"),
      ("tokens/s", f"{tps:,.0f}"),
      ("model FLOPs/token", f"{fpt / 1e9:.4g} GFLOP"),  # .4g: the tiny preset's is 0.003
      ("MFU", f"{100 * mfu:.1f}%" if mfu is not None else "n/a (unknown peak)"),
      ("loss (last timed step)", f"{last_loss:.4f}"),
  ]
  width = max(len(k) for k, _ in rows)
  print("| " + "metric".ljust(width) + " | value |")
  print("|" + "-" * (width + 2) + "|-------|")
  for k, v in rows:
    print(f"| {k.ljust(width)} | {v} |")


if __name__ == "__main__":
  main()
