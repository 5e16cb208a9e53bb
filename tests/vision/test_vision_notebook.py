"""notebooks/vision.ipynb runs top to bottom (tiny preset, a few training steps)."""

from tests.notebook_testlib import execute_notebook


def test_vision_notebook_executes():
  outputs = execute_notebook("vision.ipynb", VISION_STEPS="3", VISION_EVAL="12")
  assert "held-out digits: accuracy" in outputs and "held-out words" in outputs, outputs[-2000:]
  assert "loss mask:" in outputs
