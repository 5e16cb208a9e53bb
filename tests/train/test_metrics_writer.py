"""MetricsWriter: the TensorBoard events hold every value written, and importing the metrics
module does not import PyTorch (tensorboardX would, when it is installed)."""

import os
import struct
import subprocess
import sys
import textwrap

import numpy as np

from sparse_lm.train import metrics


def read_events(logdir):
  """Every Event in the tfevents files of logdir (TFRecord framing: u64 length, u32 crc,
  data, u32 crc), parsed with tensorboardX's own proto."""
  from tensorboardX.proto import event_pb2
  events = []
  for name in sorted(os.listdir(logdir)):
    if ".tfevents." not in name:
      continue
    with open(os.path.join(logdir, name), "rb") as f:
      data = f.read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
      at += 12 + length + 4
  return events


def test_scalars_and_layer_vectors_reach_tensorboard(tmp_path):
  rng = np.random.default_rng(0)
  loss, layers, load = float(rng.uniform(1, 5)), rng.uniform(0, 1, 3), rng.uniform(0, 1, (2, 80))
  w = metrics.MetricsWriter(tmp_path)
  w.write(7, {"loss": np.float32(loss), "moe/max_violation": layers, "moe/load": load,
              "note": "text"}, prefix="train/")
  w.write(8, {"loss": 2.5}, prefix="eval/")
  w.close()
  got, histograms = {}, []
  for e in read_events(tmp_path):
    for v in e.summary.value:
      if v.HasField("histo"):
        histograms.append((e.step, v.tag, v.histo.num))
      else:
        got[(e.step, v.tag)] = v.simple_value
  want = {(7, "train/loss"): loss, (8, "eval/loss"): 2.5,
          **{(7, f"train/moe/max_violation/layer_{i}"): x for i, x in enumerate(layers)}}
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6)  # simple_value is float32
  assert histograms == [(7, "train/moe/load", 160)]
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2 and '"train/note": "text"' in lines[0]


def test_importing_metrics_does_not_import_torch(tmp_path):
  # A stand-in `torch` on the path records whether anything imported it.
  (tmp_path / "torch").mkdir()
  marker = tmp_path / "imported"
  (tmp_path / "torch" / "__init__.py").write_text(
      f"open({str(marker)!r}, 'w').close()\nTensor = object\n")
  code = textwrap.dedent("""
      import sys
      from sparse_lm.train import metrics
      assert "torch" not in sys.modules, "torch still in sys.modules"
      import torch  # importable again afterwards
      print("ok")
      """)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), repo]),
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().endswith("ok")
  # imported once: by the test's own `import torch`, after the metrics module loaded
  assert marker.exists()


def test_a_resumed_writer_drops_what_a_killed_run_logged_past_its_checkpoint(tmp_path):
  """A run killed after step 9 with its last checkpoint at step 8 resumes at 8 and logs 9
  again: metrics.jsonl held step 9 twice. after_step=8 drops the old lines past 8 (a line
  without a step is kept) and asks TensorBoard to purge its events from step 9 on."""
  w = metrics.MetricsWriter(tmp_path)
  for step in range(1, 10):
    w.write(step, {"loss": float(step)})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"note": "no step"}\n')
  w = metrics.MetricsWriter(tmp_path, after_step=8)
  for step in range(9, 13):
    w.write(step, {"loss": 100.0 + step})
  w.close()
  import json
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [x.get("step") for x in lines] == [1, 2, 3, 4, 5, 6, 7, 8, None, 9, 10, 11, 12]
  assert lines[9]["loss"] == 109.0
  purges = [e for e in read_events(tmp_path) if e.HasField("session_log")]
  assert len(purges) == 1 and purges[0].step == 9
  assert metrics.drop_lines_after(tmp_path / "absent.jsonl", 3) == 0
