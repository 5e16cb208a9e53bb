"""Peak host memory of `load_pretrained` on a synthetic sharded Kimi-Linear checkpoint.

    python benchmarks/interop_import_rss.py --size_gb 2 [--dir DIR]

Writes a random fp32 checkpoint of about --size_gb (Kimi-Linear layout, shards of --shard_mb,
written one tensor at a time from the importer's own name table), then imports it in a fresh
process and prints: the baseline RSS (interpreter, jax, the abstract model), the peak RSS
(getrusage ru_maxrss; the baseline is the current VmRSS), the model's bytes (on a CPU backend the imported arrays themselves live
in host memory), the largest single tensor, and overhead = peak - baseline - model bytes: the
import's own transient memory, which should stay near one tensor plus one target shard.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import tempfile
import json
import math
import os
import pathlib
import resource
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SYNTH = dict(vocab_size=16384, d_model=1024, num_layers=9, mla_every=4, num_dense_layers=1,
             kda_num_heads=8, kda_head_dim=128, kda_value_dim=128, kda_output_gate_rank=128,
             kda_gate_lower_bound=None, mla_num_heads=8, q_lora_rank=0, kv_lora_rank=256,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, mla_output_gate=False,
             dense_hidden=4096, ffn_activation="swiglu", moe_latent=False, expert_hidden=512,
             shared_expert_hidden=512, num_shared_experts=1, experts_per_token=4,
             residual="standard", norm_eps=1e-5, mla_norm_eps=1e-6, dtype="float32",
             param_dtype="float32", name="kimi_linear")


SMALL = dict(vocab_size=4096, d_model=512, dense_hidden=1024, expert_hidden=64,
             shared_expert_hidden=64, kv_lora_rank=128, kda_num_heads=4, mla_num_heads=4)


def write(out: pathlib.Path, size_gb: float, small: bool = False, shard_mb: int = 256) -> dict:
  import numpy as np
  from flax import nnx
  from sparse_lm.config import ModelConfig
  from sparse_lm.interop import hf_config, hf_names
  from sparse_lm.interop.hf import _abstract
  from sparse_lm.interop.safetensors_io import ShardWriter

  synth = {**SYNTH, **(SMALL if small else {})}
  base = ModelConfig(**synth, num_experts=8)
  flat = dict(nnx.to_flat_state(_abstract(base)[1]))
  per_expert = 3 * base.d_model * base.expert_hidden * 4 * base.num_moe_layers
  other = sum(int(np.prod(v.shape)) * 4 for p, v in flat.items()
              if "expert" not in "".join(map(str, p)))
  experts = int((size_gb * 2**30 - other) // per_expert)
  if experts < 8:  # the layout's floor: 8 experts (a smaller size writes this much anyway)
    floor = (other + 8 * per_expert) / 2**30
    print(f"interop_import_rss: --size_gb {size_gb:g} is below the smallest checkpoint of this "
          f"layout (8 experts{', --small' if small else ''}): writing about {floor:.2f} GB",
          file=sys.stderr, flush=True)
    experts = 8
  cfg = ModelConfig(**synth, num_experts=experts)
  _, state = _abstract(cfg)
  flat = dict(nnx.to_flat_state(state))
  rng = np.random.default_rng(0)
  w = ShardWriter(out, max_bytes=shard_mb << 20)
  largest = 0
  for s in hf_names.sources(cfg, "kimi_linear"):
    block = tuple(flat[s.path].shape[len(s.lead):])
    for idx in itertools.product(*[range(n) for n in s.lead]):
      b = (0.02 * rng.standard_normal(block, np.float32)).astype(np.float32)
      for name, t in zip(s.names(idx), s.to_hf(b)):
        w.add(name, t)
        largest = max(largest, t.nbytes)
  files = w.close()
  (out / "config.json").write_text(json.dumps(hf_config.config_to_hf(cfg, "kimi_linear")))
  total = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
  return {"experts": experts, "files": len(files), "bytes": total, "largest": largest}


def measure(path: str) -> None:
  """In a fresh process: import `path`, print JSON with RSS numbers (bytes)."""
  import jax
  from flax import nnx
  from sparse_lm.interop import hf
  peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  cfg, _ = hf.hf_config.config_from_hf(json.loads((pathlib.Path(path) / "config.json").read_text()))
  hf._abstract(cfg)  # warm the imports and tracing
  jax.device_put(0.0).block_until_ready()
  base = _current_rss()
  model, _ = hf.load_pretrained(path)
  jax.block_until_ready(nnx.state(model))
  model_bytes = sum(v[...].nbytes for _, v in nnx.to_flat_state(nnx.state(model)))
  print(json.dumps({"baseline": base, "peak": peak(), "model_bytes": model_bytes}))


def _current_rss() -> int:
  """Resident set size now (bytes), from /proc/self/status (ru_maxrss is the peak so far)."""
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size_gb", type=float, default=2.0,
                  help="checkpoint size in GB (--small writes a narrower model, same size)")
  ap.add_argument("--dir", help="where to write the checkpoint (kept); default: a temporary "
                  "directory, removed at the end")
  ap.add_argument("--measure", help=argparse.SUPPRESS)  # the measuring process
  ap.add_argument("--small", action="store_true", help="narrower model (for the test)")
  ap.add_argument("--json", action="store_true", help="print one JSON line of numbers")
  ap.add_argument("--shard_mb", type=int, default=256, help="safetensors shard size in MB")
  args = ap.parse_args(argv)
  if args.measure:
    measure(args.measure)
    return
  # Every argument is checked here, before anything is written.
  if not (math.isfinite(args.size_gb) and args.size_gb > 0):
    ap.error(f"--size_gb {args.size_gb:g}: expected a size in GB > 0")
  if args.shard_mb < 1:
    ap.error(f"--shard_mb {args.shard_mb}: expected a shard size in MB >= 1")
  if args.dir is not None:
    try:
      os.makedirs(args.dir, exist_ok=True)
    except OSError as e:
      ap.error(f"--dir {args.dir!r}: cannot create it ({e.strerror or e})")
    if not os.access(args.dir, os.W_OK | os.X_OK):
      ap.error(f"--dir {args.dir!r}: not a writable directory")
  if args.dir is None:
    tmp = tempfile.mkdtemp(prefix="interop_rss_ckpt_")
    try:
      _run(args, pathlib.Path(tmp))
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  else:
    _run(args, pathlib.Path(args.dir))


def _run(args, out: pathlib.Path):
  info = write(out, args.size_gb, small=args.small, shard_mb=args.shard_mb)
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", str(out)],
                        capture_output=True, text=True)
  if proc.returncode:
    sys.exit(f"interop_import_rss: the measuring process failed (status {proc.returncode}):\n"
             + proc.stderr[-3000:])
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  mb = lambda b: f"{b / 2**20:.0f} MB"
  over = r["peak"] - r["baseline"] - r["model_bytes"]
  if args.json:
    print(json.dumps({**info, **r, "overhead": over}))
    return
  print(f"checkpoint {mb(info['bytes'])} in {info['files']} shards ({info['experts']} experts), "
        f"largest tensor {mb(info['largest'])}")
  print(f"baseline RSS {mb(r['baseline'])}, peak RSS {mb(r['peak'])}, model "
        f"{mb(r['model_bytes'])}: import overhead {mb(over)} "
        f"({over / info['largest']:.2f} x the largest tensor)")


if __name__ == "__main__":
  main()
