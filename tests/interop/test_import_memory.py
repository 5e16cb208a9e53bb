"""The import streams: its transient host memory does not grow with the checkpoint.

Runs benchmarks/interop_import_rss.py on a ~70 MB synthetic sharded checkpoint in fresh
processes (docs/interop.md has the 2 GB run). On the CPU backend the imported arrays live in
host memory, so the measure is peak RSS - baseline - the model's bytes.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_overhead_is_a_few_tensors_not_the_checkpoint(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "interop_import_rss.py"), "--small",
       "--size_gb", "0.05", "--shard_mb", "16", "--dir", str(tmp_path / "ckpt"), "--json"],
      capture_output=True, text=True, timeout=600, cwd=tmp_path,
      # as docs/interop.md runs it: the script path, no PYTHONPATH, from any directory
      env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  print({k: round(v / 2**20, 1) for k, v in r.items() if k in
         ("bytes", "largest", "baseline", "peak", "model_bytes", "overhead")}, "MB")
  assert r["bytes"] > 40 * 2**20 and r["files"] > 2
  # Holding the whole checkpoint in host memory would add its size (> 40 MB) to the peak.
  assert r["overhead"] < 4 * r["largest"] + 16 * 2**20
  assert r["overhead"] < 0.5 * r["model_bytes"]
