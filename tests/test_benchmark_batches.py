"""benchmarks/train_step.py's synthetic batch has every key, shape and dtype the stage's train
step takes (a preset with images included: the `small` stage_8k step once failed its lowering
with "different numbers of pytree children" because the image keys were missing)."""

import importlib.util
import pathlib
import re

import numpy as np

from experiments import stage_8k
from sparse_lm.train.builder import batch_shapes

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"


def _train_step_module():
  spec = importlib.util.spec_from_file_location("bench_train_step", _PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_synthetic_batch_matches_the_stage_batch_with_and_without_images():
  synthetic_batch = _train_step_module().synthetic_batch
  for preset in ("small", "tiny"):
    stage = stage_8k.STAGES[preset]
    shapes = batch_shapes(stage, 2, 64)
    batch = synthetic_batch(2, 64, 100, 0, shapes)
    assert sorted(batch) == sorted(shapes), preset
    for key, (shape, dtype) in shapes.items():
      assert batch[key].shape == shape and batch[key].dtype == np.dtype(dtype), (preset, key)
  assert "image_patches" in batch_shapes(stage_8k.STAGES["small"], 2, 64)
  tokens = synthetic_batch(2, 64, 100, 0)["tokens"]
  assert tokens.min() >= 4 and tokens.max() < 100 and len(np.unique(tokens)) > 10


def test_real_batches_are_the_stage_pipeline_batches_with_the_step_shapes(tmp_path):
  """`--data real`: the stage's own first training batches, every key the step takes, with
  its shape and dtype; two draws are different batches."""
  real_batches = _train_step_module().real_batches
  stage = stage_8k.STAGES["tiny"]
  got = real_batches(stage, str(tmp_path), 2, 2)
  shapes = batch_shapes(stage, 2, stage.seq_len)
  for b in got:
    for key, (shape, dtype) in shapes.items():
      assert np.asarray(b[key]).shape == shape, key
      assert np.asarray(b[key]).dtype == np.dtype(dtype), key
  assert not np.array_equal(got[0]["tokens"], got[1]["tokens"])
  assert np.asarray(got[0]["segment_ids"]).max() >= 1


def test_compile_only_fills_the_cache_that_the_timed_run_then_hits(tmp_path):
  """--compile-only compiles the step from the abstract state and batch into
  --compilation-cache; the timed run of the same configuration finds it there (jax writes a
  new program on a miss, so the step's entry stays the one) and prints its table. Subprocesses: the
  cache directory is process-wide jax configuration."""
  import os
  import subprocess
  import sys
  cache = tmp_path / "jcc"
  cmd = [sys.executable, str(_PATH), "--preset", "tiny", "--batch", "2", "--seq-len", "64",
         "--steps", "1", "--compilation-cache", str(cache)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(cmd + ["--compile-only"], capture_output=True, text=True, env=env,
                       timeout=600, cwd=_PATH.parents[1])
  assert out.returncode == 0, out.stderr[-3000:]
  assert "compile-only: tiny, remat none, 2 x 64 tokens: compiled in" in out.stdout
  programs = lambda: sorted(f for f in os.listdir(cache) if f.endswith("-cache"))
  entries = programs()
  assert len(entries) == 1, os.listdir(cache)
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                       cwd=_PATH.parents[1])
  assert out.returncode == 0, out.stderr[-3000:]
  assert "| step time" in out.stdout and "| tokens/s" in out.stdout, out.stdout
  # The table's numbers by hand: tokens/s = 2 x 64 tokens / the step time; the loss row names
  # the step it comes from (it read "loss after warm-up": the last timed step's loss); the
  # FLOPs per token keep their digits at the tiny preset (it printed 0.003 GFLOP).
  step_ms = float(re.search(r"\| step time +\| ([0-9.]+) ms \(mean of 1\)",
                            out.stdout).group(1))
  tps = float(re.search(r"\| tokens/s +\| ([0-9,]+) \|",
                        out.stdout).group(1).replace(",", ""))
  assert abs(tps - 2 * 64 / (step_ms / 1e3)) <= 0.06 / step_ms * tps + 1, (tps, step_ms)
  assert re.search(r"\| loss \(last timed step\) +\| [0-9.]+ \|", out.stdout), out.stdout
  assert re.search(r"\| model FLOPs/token +\| 0\.00\d{2,} GFLOP \|", out.stdout), out.stdout
  # The step's program is the one entry of its name: a miss would have written a second one.
  # (The timed run's small helper programs, such as jax.random.normal's, are written too when
  # their compile passes jax's 1 s minimum, as on a loaded machine: they are not the step.)
  name = entries[0].rsplit("-", 2)[0]
  assert [e for e in programs() if e.rsplit("-", 2)[0] == name] == entries, programs()
