"""Muon in the stage pipeline: `--set optim.name=muon` with QK-clip trains, a checkpoint saved
mid-run resumes bit-exact (Muon momentum and AdamW moments restored), and two Muon steps on
8 CPU devices equal one device (subprocess, muon_sharded.py)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

from experiments.base import apply_overrides
from sparse_lm.train import loop
from sparse_lm.train.checkpoint import Checkpointer
from tests._xla_flags import with_devices
from tests.train.conftest import small_stage
from tests.train.test_loop import _signal_at

MUON_SETS = ("optim.name=muon", "optim.qk_clip_threshold=0.05", "model.num_layers=3",
             "model.mla_every=2",
             "steps=4")


def test_muon_checkpoint_resumes_bit_exact(workdir, tmp_path_factory):
  stage = apply_overrides(small_stage(), MUON_SETS)
  other = tmp_path_factory.mktemp("uninterrupted")
  (other / "tokenizer.json").write_bytes((workdir / "tokenizer.json").read_bytes())
  full = loop.run(stage, other, progress=False)
  assert sorted(full.losses) == [0, 1, 2, 3]
  records = [json.loads(l) for l in (other / stage.name / "tb" / "metrics.jsonl").open()]
  train = [r for r in records if "train/loss" in r]
  assert all(r["train/attn/max_logit"] > 0 for r in train)
  assert sum(r["train/attn/clipped_heads"] for r in train) > 0  # tau 0.05 clips at this size

  first = loop.run(stage, workdir, progress=False, on_step=_signal_at(1))
  assert first.preempted and 2 <= first.end_step < 4
  second = loop.run(stage, workdir, progress=False)
  assert second.start_step == first.end_step
  assert {**first.losses, **second.losses} == full.losses  # exact, step by step
  assert second.final_eval == full.final_eval

  states = []
  for d in (other, workdir):
    ck = Checkpointer(d / stage.name / "checkpoints")
    states.append(ck.restore_latest(None)[0])
    ck.close()
  same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), *states)
  assert all(jax.tree.leaves(same))  # params, Muon momentum, AdamW moments, balancer state


def test_sharded_muon_step_equals_one_device():
  script = pathlib.Path(__file__).with_name("muon_sharded.py")
  env = dict(os.environ, XLA_FLAGS=with_devices(8))
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                        timeout=900)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  assert "OK" in proc.stdout
