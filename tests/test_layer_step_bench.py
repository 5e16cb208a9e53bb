"""benchmarks/layer_step.py runs end to end at the tiny preset on the CPU (a KDA layer under
full remat; the MLA layer differs only in the module built), so the GPU loop it exists for
does not find it broken."""

import math
import re

import pytest

from benchmarks import layer_step


def test_layer_step_runs_and_prints_a_finite_loss(capsys):
  mixer = "kda"
  layer_step.main(["--preset", "tiny", "--mixer", mixer, "--batch", "1", "--seq-len", "64",
                   "--repeats", "1", "--remat", "full"])
  out = capsys.readouterr().out
  assert f"tiny {mixer} + moe, 1 x 64 tokens, remat full" in out
  m = re.search(r"forward \+ backward ([0-9.]+) ms .* loss (\S+)", out)
  assert m, out
  assert float(m.group(1)) > 0 and math.isfinite(float(m.group(2)))


def test_layer_step_rejects_an_odd_length_and_an_unknown_field():
  with pytest.raises(SystemExit):
    layer_step.main(["--preset", "tiny", "--seq-len", "63"])
  with pytest.raises(SystemExit):
    layer_step.main(["--preset", "tiny", "--set", "no_such_field=1"])
