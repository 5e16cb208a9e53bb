"""A run's per-step expert loads survive an interrupt: `run.train_run` appends them as the steps
complete, so a run stopped by SIGTERM and resumed in a second call has every step's loads (and
its window / noise-floor numbers); steps whose loads are truly lost are named in run.json and
the report's table and verdict, never dropped in silence."""

import json
import os
import signal

import numpy as np
import pytest

from experiments.ablations import run as run_lib
from tests.train.conftest import small_stage


def test_a_resumed_run_keeps_the_loads_of_both_processes(workdir, monkeypatch):
  import sparse_lm.train.loop as loop  # pylint: disable=g-import-not-at-top
  stage = small_stage()  # 5 steps, checkpoints every 2, 2 MoE layers
  real_run, seen = loop.run, []  # per call, the steps it trained

  def run_then_stop(*args, on_step=None, **kwargs):
    """The first call gets SIGTERM during step 1's callback: it saves and stops."""
    seen.append([])

    def step(s, m):
      on_step(s, m)
      seen[-1].append(s)
      if len(seen) == 1 and s == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_run(*args, on_step=step, **kwargs)

  monkeypatch.setattr(loop, "run", run_then_stop)
  with pytest.raises(KeyboardInterrupt, match="rerun to resume"):
    run_lib.train_run(stage, workdir)
  entry = run_lib.train_run(stage, workdir)  # the second process resumes it
  # Two processes, each saw part of the run (the first stopped at its step-2 checkpoint).
  assert len(seen) == 2 and seen[0] and seen[1][0] > 0, seen
  assert sorted(set(seen[0] + seen[1])) == list(range(stage.steps))
  assert entry["window_max_mean_load"] is not None and entry["load_noise_floor"] is not None
  assert entry["loads_missing_steps"] == []
  d = run_lib.run_dir(workdir, stage)
  loads = np.load(d / "loads.npy")
  assert loads.shape[:2] == (stage.steps, 2)  # [steps, MoE layers, E]
  assert json.loads((d / "run.json").read_text())["window_max_mean_load"] == \
      entry["window_max_mean_load"]


def test_lost_loads_are_named_in_run_json_and_the_report(tmp_path):
  load = lambda s: np.full((2, 8), 4.0, np.float32) + np.eye(2, 8, s, dtype=np.float32)
  with (tmp_path / run_lib.LOADS).open("w") as f:
    for s in range(3, 6):  # steps 0-2 were trained before the loads were kept
      f.write(json.dumps({"step": s, "load": load(s).tolist(), "dtype": "float32"}) + "\n")
    f.write('{"step": 6, "lo')  # a line cut short by a killed process
  stats = run_lib.load_stats(tmp_path, 6)
  assert stats == {"window_max_mean_load": None, "load_noise_floor": None,
                   "loads_missing_steps": [0, 1, 2]}
  assert not (tmp_path / "loads.npy").exists()
  with (tmp_path / run_lib.LOADS).open("a") as f:  # ... and with every step there
    for s in range(3):
      f.write("\n" + json.dumps({"step": s, "load": load(s).tolist(), "dtype": "float32"}))
  full = run_lib.load_stats(tmp_path, 6)
  assert full["loads_missing_steps"] == [] and np.load(tmp_path / "loads.npy").shape == (6, 2, 8)
  assert full["window_max_mean_load"] == run_lib.window_load(tmp_path / "loads.npy")

  from experiments.ablations import report  # pylint: disable=g-import-not-at-top
  curve = {"0": 2.0, "1": 1.5}
  runs = lambda lost: [{"seed": seed, "steps": 6, "tokens_per_step": 256, "seq_len": 32,
                        "loss": curve, "max_mean_load": curve, "dead_frac": {"0": 0.0},
                        "final": {"eval_loss@32": 3.0}, "probe": {},
                        **(stats if lost and seed == 1 else full)} for seed in (0, 1)]
  record = {"name": "balancing", "preset": "smoke", "seeds": [0, 1],
            "variants": {label: {"value": label, "runs": runs(label == "none")}
                         for label in ("quantile (midpoint)", "none")}}
  _, rows = run_lib.summarize(record)
  assert rows[1][4] == "not recorded (loads lost, seed 1: 3 of 6 steps)", rows
  assert rows[0][4].startswith("1.")
  text = report.verdict(record)
  assert "none seed 1: 3 of 6 steps" in text and "second half" in text, text
  # No mean over the other seed passed off as both, and no "nan".
  assert "QB 1." in text and "`none` not recorded" in text and "nan" not in text, text
