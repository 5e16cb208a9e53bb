"""Ahead-of-time memory plan: compile a stage's real steps for a TPU topology, no TPU needed.

    JAX_PLATFORMS=cpu python -m launch.aot_plan --stage stage_8k --preset full \
        [--topology v5p:8x16x16] [--num-slices 1] [--set micro_batches=32 ...] \
        [--eval | --steps eval,eval_2x | --steps sample_prefill,sample_decode]

Everything comes from the stage file (`experiments/<stage>.py`, its `StageConfig` for the
preset): the topology and number of slices it is planned for, the mesh, batch, micro-batches,
model overrides and expert-parallel options. `--set key=value` changes any field exactly as
the training command line does (`experiments.base.apply_overrides`: `micro_batches=32`,
`mesh=fsdp=-1,expert=16`, `model.num_layers=9`, ...).

The steps are the training loop's own (`sparse_lm.train.builder.build`, as MaxText's
`train_compile.py` reuses its `train_step`): the train step (micro-batch scan, forward,
backward, clipping, AdamW, balancer update, donated state); with `--eval`, the eval step
at the stage's eval batch, at its length and at twice its length; with `--steps
sample_prefill,sample_decode`, the inference engine's calls for the end-of-stage sample on the
stage's mesh (`sparse_lm.inference.calls.lower_calls`: one 512-token prefill piece and one
64-step decode call of one row, caches of the stage's seq_len, the weights as the rules place
them). Each is lowered with the abstract train state (the sample: abstract weights and
caches; `jax.eval_shape`: nothing is materialised on the host) and compiled with the real TPU
compiler (libtpu) for the compile-only devices of
`jax.experimental.topologies.get_topology_desc`. For each it prints the per-chip memory the
compiler reports (`compiled.memory_analysis()`: arguments, outputs, temporaries, generated
code, and their total with donated buffers counted once) against the chip's HBM, its compile
time and the planner's own peak host memory (resident set, `launch.host_memory`).

Exit status: 0 if every compiled step fits in HBM (or `--lower-only` lowered them all), 2 if
one does not, 1 on errors.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import re
import sys
from typing import Any

HBM_BYTES = {  # per chip (a tpu7x chip is two JAX devices of 96 GB each)
    "v5p": 95 * 1000**3,
    "v5e": 16 * 1000**3,
    "v6e": 32 * 1000**3,
    "v4": 32 * 1000**3,
    "tpu7x": 192 * 1000**3,
}

GB = 1000**3


def chip_of(topology: str) -> str:
  return topology.split(":")[0].split("-")[0]


def stage_name(stage: str) -> str:
  """The stage name (the module under experiments/) of a --stage value: `stage_8k`, or the
  same given as its file (`experiments/stage_8k.py`, `./experiments/stage_8k.py`,
  `stage_8k.py`) or module (`experiments.stage_8k`).

  Raises:
    ValueError: a path or module outside experiments/ (the message says to pass the name).
  """
  s = stage.strip()
  s = s[:-3] if s.endswith(".py") else s
  parts = [q for q in re.split(r"[/\\]" if ("/" in s or "\\" in s) else r"\.", s)
           if q not in ("", ".")]
  if "experiments" in parts:
    parts = parts[len(parts) - parts[::-1].index("experiments"):]
  elif len(parts) > 1 and ("/" in s or "\\" in s):
    parts = []
  if not parts or not all(re.fullmatch(r"\w+", q) for q in parts):
    raise ValueError(f"--stage {stage}: give the name of a stage in experiments/ (e.g. "
                     "stage_8k for experiments/stage_8k.py)")
  return ".".join(parts)


def stage_config(stage: str, preset: str):
  """The experiment's StageConfig for (stage, preset); `stage` as `stage_name` takes it.

  Raises:
    ValueError: no experiments/<stage>.py, or it has no such preset.
  """
  stage = stage_name(stage)
  try:
    mod = importlib.import_module(f"experiments.{stage}")
  except ModuleNotFoundError as e:
    if not f"experiments.{stage}.".startswith(f"{e.name}."):
      raise  # the stage file exists; something it imports does not
    raise ValueError(f"--stage {stage}: no experiments/{stage.replace('.', '/')}.py (give "
                     "the name of a stage in experiments/, e.g. stage_8k)") from None
  stages = getattr(mod, "STAGES", {})
  if preset not in stages:
    raise ValueError(f"--preset {preset}: experiments/{stage.replace('.', '/')}.py has "
                     f"{sorted(stages)}")
  return stages[preset]


def check_writable(path: str) -> None:
  """Check that the --json report can be written at `path` (before a plan's minutes of
  compiling and tens of GB of host memory; the write came after them).

  Raises:
    ValueError: `path` is a directory, or its directory does not exist, is not a directory or
      is not writable (named).
  """
  if os.path.isdir(path):
    raise ValueError(f"--json {path}: is a directory; give a file name (e.g. {path}/plan.json)")
  parent = os.path.dirname(path) or "."
  if not os.path.isdir(parent):
    raise ValueError(f"--json {path}: " + (f"{parent} is not a directory" if os.path.exists(
        parent) else f"directory {parent} does not exist") + " (create it first)")
  if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(
      path, os.W_OK)):
    raise ValueError(f"--json {path}: not writable")


def topology_devices(topology: str, num_slices: int = 1):
  """Compile-only TPU devices of `topology` (e.g. "v5p:16x16x16"), optionally multislice."""
  from jax.experimental import topologies
  kw = {} if num_slices == 1 else {"num_slices": num_slices}
  return topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw).devices


def memory_report(compiled, hbm: int) -> dict[str, Any]:
  """Per-device bytes from the compiler's memory analysis."""
  ma = compiled.memory_analysis()
  get = lambda name: int(getattr(ma, name, 0) or 0)
  arg, out, tmp = (get("argument_size_in_bytes"), get("output_size_in_bytes"),
                   get("temp_size_in_bytes"))
  alias, code = get("alias_size_in_bytes"), get("generated_code_size_in_bytes")
  total = arg + out - alias + tmp + code
  return dict(arguments=arg, outputs=out, aliased=alias, temporaries=tmp, code=code,
              total=total, hbm=hbm, fits=total <= hbm)


def _batch(stage, shardings, rows: int, seq_len: int):
  from sparse_lm.train.builder import batch_shapes
  from sparse_lm.train.precompile import abstract_batch
  # with the image keys of a multimodal stage
  return abstract_batch(batch_shapes(stage, rows, seq_len), shardings)


# eval_2x: the eval step at twice the stage's length. sample_prefill / sample_decode: the
# inference engine's calls for the end-of-stage sample on the stage's mesh (one prefill piece of
# SAMPLE_PREFILL_CHUNK tokens, one decode call of SAMPLE_DECODE_STEPS steps; SAMPLE_BATCH rows;
# caches of the stage's seq_len).
STEPS = ("train", "eval", "eval_2x", "sample_prefill", "sample_decode")
SAMPLE_BATCH, SAMPLE_PREFILL_CHUNK, SAMPLE_DECODE_STEPS = 1, 512, 64  # train/sample.py's engine


def _sample_calls(cfg, mesh, seq_len: int) -> dict:
  """The engine's prefill piece and decode call (`sparse_lm.inference.calls.lower_calls`) as
  `train/sample.py` runs them on `mesh`, with caches of seq_len positions."""
  from sparse_lm.inference.cache import padded_length
  from sparse_lm.inference.calls import lower_calls
  length = padded_length(seq_len, cfg.attention_chunk_size)
  return lower_calls(cfg, mesh, batch=SAMPLE_BATCH, cache_length=length,
                     prefill_chunk=min(SAMPLE_PREFILL_CHUNK, length),
                     kv_block=cfg.attention_chunk_size, decode_steps=SAMPLE_DECODE_STEPS)


def plan_steps(stage, devices, *, hbm: int, rss, steps=("train",),
               lower_only: bool = False) -> list[dict]:
  """Compile the stage's `steps` (names from STEPS) for `devices`; one report per step.

  Each report holds the memory_report fields, "step", "rows", "seq_len", "lower_s",
  "compile_s" and the phase's peak host RSS. With `lower_only` the steps are traced and
  lowered (shapes, shardings, the layout's collectives) but not compiled: no memory fields,
  "fits" is None. Compiled programs are dropped as soon as they
  are measured, so one plan's compiler memory is freed before the next.

  Raises:
    ValueError: the layout does not divide the model / batch (from validate_layout), or a
      name in `steps` is not one of STEPS.
  """
  unknown = [s for s in steps if s not in STEPS]
  if unknown:
    raise ValueError(f"--steps {','.join(unknown)}: choose from {','.join(STEPS)}")
  import jax
  from sparse_lm import sharding as shd
  from sparse_lm.train.builder import build

  cfg = stage.model_config()
  mesh = shd.make_mesh(stage.mesh, devices)
  shd.validate_layout(cfg, stage.mesh, mesh, global_batch=stage.global_batch,
                      seq_len=stage.seq_len, num_microbatches=stage.micro_batches)
  with rss.phase("build (abstract state)"):
    parts = build(stage, mesh)
    state = shd.with_shardings(parts.abstract_state, parts.state_shardings)
  eval_rows = stage.eval_batch_size or stage.global_batch
  step = lambda fn: lambda rows, seq_len: fn.lower(
      state, _batch(stage, parts.batch_shardings, rows, seq_len))
  sample_calls = {}

  def sample(which):
    def lower(rows, seq_len):
      if not sample_calls:  # both calls are traced together, compiled one at a time
        sample_calls.update(_sample_calls(cfg, mesh, seq_len))
      return sample_calls.pop(which)
    return lower
  plans = {"train": (step(parts.train_step), stage.global_batch, stage.seq_len),
           "eval": (step(parts.eval_step), eval_rows, stage.seq_len),
           "eval_2x": (step(parts.eval_step), eval_rows, 2 * stage.seq_len),
           "sample_prefill": (sample("prefill"), SAMPLE_BATCH, stage.seq_len),
           "sample_decode": (sample("decode"), SAMPLE_BATCH, stage.seq_len)}
  todo = [(name, *plans[name]) for name in steps]
  reports = []
  for name, lower, rows, seq_len in todo:
    what = (f"{rows} x {seq_len:,} tokens" if not name.startswith("sample") else
            f"{rows} row, cache {seq_len:,}: " + (
                f"a {min(SAMPLE_PREFILL_CHUNK, seq_len)}-token piece" if name == "sample_prefill"
                else f"{SAMPLE_DECODE_STEPS} decode steps"))
    with rss.phase(f"{name}: lower") as lo:
      lowered = lower(rows, seq_len)
    if lower_only:
      del lowered
      reports.append(dict(step=name, rows=rows, seq_len=seq_len, lower_s=lo["seconds"],
                          peak_rss=lo["peak_rss"], fits=None))
      print(f"[aot_plan] {name} ({what}): lowered in {lo['seconds']:.0f}s "
            f"(not compiled), host peak RSS {lo['peak_rss'] / GB:.2f} GB", flush=True)
      continue
    with rss.phase(f"{name}: compile") as co:
      compiled = lowered.compile()
      del lowered
    rep = memory_report(compiled, hbm)
    del compiled
    gc.collect()
    rep.update(step=name, rows=rows, seq_len=seq_len, lower_s=lo["seconds"],
               compile_s=co["seconds"], peak_rss=max(lo["peak_rss"], co["peak_rss"]))
    reports.append(rep)
    print(f"[aot_plan] {name} ({what}): per device arguments "
          f"{rep['arguments'] / GB:.2f} GB, outputs {rep['outputs'] / GB:.2f} GB (aliased "
          f"{rep['aliased'] / GB:.2f}), temporaries {rep['temporaries'] / GB:.2f} GB, code "
          f"{rep['code'] / GB:.3f} GB; total {rep['total'] / GB:.2f} GB of {hbm / GB:.0f} GB "
          f"-> {'FITS' if rep['fits'] else 'DOES NOT FIT'}; lower {rep['lower_s']:.0f}s, "
          f"compile {rep['compile_s']:.0f}s, host peak RSS {rep['peak_rss'] / GB:.2f} GB",
          flush=True)
  leaves = jax.tree.leaves(parts.abstract_state)
  params = jax.tree.leaves(parts.abstract_state.params)
  info = dict(mesh=dict(mesh.shape), expert_shards=stage.mesh.expert_shards,
              num_params=int(sum(math.prod(x.shape) for x in params)),
              state_bytes_global=int(sum(math.prod(x.shape) * x.dtype.itemsize
                                         for x in leaves)))
  for r in reports:
    r.update(info)
  return reports


def _params(n: int) -> str:
  """A parameter count for a line of text: 2.80T, 451.0M, 1.94M, 12.3K."""
  for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= div:
      return f"{n / div:.{2 if unit in 'TB' else 1}f}{unit}"
  return str(n)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.aot_plan",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--stage", default="stage_8k", help="the stage name, e.g. stage_8k for "
                 "experiments/stage_8k.py (that path is taken too)")
  p.add_argument("--preset", default="full")
  p.add_argument("--topology", default=None, help="e.g. v5p:16x16x16 (default: the stage's "
                 "StageConfig.topology)")
  p.add_argument("--num-slices", type=int, default=None,
                 help="default: the stage's StageConfig.num_slices")
  p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                 help="a StageConfig field, as in training: micro_batches=32, mesh=..., "
                 "model.num_layers=9, model.ragged_buffer_factor=None")
  p.add_argument("--eval", action="store_true", help="also the eval step at the eval batch, "
                 "at the stage's length and at twice it (= --steps train,eval,eval_2x)")
  p.add_argument("--steps", default=None, help=f"comma-separated, from {','.join(STEPS)} "
                 "(default: train; e.g. --steps eval,eval_2x compiles only the eval steps, "
                 "--steps sample_prefill,sample_decode the end-of-stage sample's engine calls)")
  p.add_argument("--lower-only", action="store_true", help="trace and lower the steps, do not "
                 "compile them (checks shapes and shardings in seconds; no memory numbers)")
  p.add_argument("--json", default=None, help="also write the report here (its directory "
                 "must exist: checked before anything is compiled)")
  p.add_argument("--malloc-arenas", type=int, default=int(os.environ.get(
      "SPARSE_LM_MALLOC_ARENAS", 2)), help="glibc malloc arenas (0 = glibc's default)")
  p.add_argument("--trim-every", type=float, default=float(os.environ.get(
      "SPARSE_LM_TRIM_EVERY", 2)), help="seconds between malloc_trim calls (0 = never)")
  p.add_argument("--mmap-threshold", type=int, default=int(os.environ.get(
      "SPARSE_LM_MMAP_THRESHOLD", 0)), help="bytes from which malloc uses mmap (0 = glibc's "
                 "dynamic threshold)")
  args = p.parse_args(argv)
  accelerator = re.fullmatch(r"(v\d+[a-z]*|tpu7x)-(\d+)", args.topology or "")
  if accelerator:  # launch.tpu's --tpu form; the mesh check only said "unknown TPU generation"
    gen, n = accelerator.group(1), int(accelerator.group(2))
    chips = n // 2 if gen in ("v4", "v5p") else n  # v4-N / v5p-N count TensorCores
    p.error(f"--topology {args.topology}: that is an accelerator type (launch.tpu --tpu); "
            f"give the slice's chip grid as generation:XxYxZ ({chips} chips), e.g. "
            "v5p:4x4x8 for v5p-256, v5p:16x16x16 for v5p-8192, v6e:16x16 for v6e-256")
  steps = (tuple(args.steps.split(",")) if args.steps else
           ("train", "eval", "eval_2x") if args.eval else ("train",))
  if any(s not in STEPS for s in steps):
    p.error(f"--steps {args.steps}: choose from {','.join(STEPS)}")
  try:
    args.stage = stage_name(args.stage)
    if args.json:
      check_writable(args.json)
  except ValueError as e:
    p.error(str(e))

  from launch.host_memory import GB as _GB, RssSampler, bound_malloc
  if args.malloc_arenas > 0:  # before jax starts its threads
    bound_malloc(args.malloc_arenas, args.mmap_threshold or None)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # compile-only use of libtpu: do not take (or wait for) the single-process TPU lockfile
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # The TPU backend holds about 10 bytes of host memory per byte of generated code until the
  # compile ends; without its debug info 7% less (8.70 -> 8.08 GB on the full stage_8k eval
  # step, the same per-chip numbers; docs/scaling.md). A plan is never debugged on a TPU.
  libtpu_args = os.environ.get("LIBTPU_INIT_ARGS", "")
  if "xla_jf_debug_level" not in libtpu_args:
    os.environ["LIBTPU_INIT_ARGS"] = f"{libtpu_args} --xla_jf_debug_level=0".strip()
  from experiments.base import apply_overrides

  if args.num_slices is not None and args.num_slices < 1:
    p.error(f"--num-slices={args.num_slices} must be >= 1")
  # --topology / --num-slices are stage fields: the mesh layout is checked against them
  # (a dcn_data=2 layout needs num_slices=2 when the config is validated, not after).
  sets = list(args.sets) + ([f"topology={args.topology}"] if args.topology else []) + (
      [f"num_slices={args.num_slices}"] if args.num_slices else [])
  try:
    stage = apply_overrides(stage_config(args.stage, args.preset), sets)
  except ValueError as e:
    p.error(str(e))
  topology, num_slices = stage.topology, stage.num_slices
  if topology is None:
    p.error(f"{args.stage} ({args.preset}) names no topology; pass --topology")
  chip = chip_of(topology)
  hbm = HBM_BYTES.get(chip)
  if hbm is None:
    p.error(f"unknown chip {chip!r}; known: {sorted(HBM_BYTES)}")
  cfg = stage.model_config()
  with RssSampler(trim_every=args.trim_every or None) as rss:
    with rss.phase("topology devices"):
      devices = topology_devices(topology, num_slices)
    # memory_analysis() is per JAX device; a tpu7x chip is two devices (one per TensorCore
    # die), each with half of the chip's HBM.
    per_chip = max(1, len({getattr(d, "core_on_chip", 0) for d in devices}))
    hbm //= per_chip
    print(f"[aot_plan] {args.stage} preset={args.preset} topology={topology} x{num_slices} "
          f"({len(devices)} devices, {per_chip} per chip) mesh={stage.mesh} "
          f"seq_len={stage.seq_len:,} global_batch={stage.global_batch} "
          f"micro_batches={stage.micro_batches} remat={cfg.remat_policy} "
          f"kda_backend={cfg.kda_backend} gmm_backend={cfg.gmm_backend} "
          f"attention_backend={cfg.attention_backend} ep_exchange={cfg.ep_exchange} "
          f"ragged_buffer_factor={cfg.ragged_buffer_factor}", flush=True)
    try:
      reports = plan_steps(stage, devices, hbm=hbm, rss=rss, steps=steps,
                           lower_only=args.lower_only)
    except ValueError as e:
      print(f"[aot_plan] failed: {e}", file=sys.stderr)
      return 1
  peak = rss.peak()  # resident high-water, or resident + swapped where swap was used
  r0 = reports[0]
  print(f"[aot_plan] mesh {r0['mesh']}; {_params(r0['num_params'])} params; train state "
        f"{r0['state_bytes_global'] / GB:.1f} GB global = "
        f"{r0['state_bytes_global'] / len(devices) / GB:.2f} GB/device if evenly sharded")
  print(f"[aot_plan] host memory: {rss.report()}")
  print(f"[aot_plan] peak host RSS {peak / _GB:.2f} GB")
  if args.json:
    out = dict(r0)  # the first step's numbers on top (the train step unless --steps)
    out.update(args=vars(args), stage=args.stage, topology=topology, num_slices=num_slices,
               layout=str(stage.mesh), global_batch=stage.global_batch,
               micro_batches=stage.micro_batches, remat=cfg.remat_policy,
               kda_backend=cfg.kda_backend, ep_exchange=cfg.ep_exchange,
               ragged_buffer_factor=cfg.ragged_buffer_factor, gmm_backend=cfg.gmm_backend,
               attention_backend=cfg.attention_backend, peak_rss=peak, phases=rss.phases,
               steps=reports)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0 if all(r["fits"] is not False for r in reports) else 2


if __name__ == "__main__":
  sys.exit(main())
