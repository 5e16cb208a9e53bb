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


def test_residuals_table_shows_what_each_policy_keeps(capsys):
  """--residuals (trace only): under "full" the KDA operator keeps nothing across the
  checkpoint; under "save_kda" its output and the state pass's H_n and V' (the tiny preset is
  fp32: the intra-chunk step is XLA's, so only these 3 are the kernels'), under a
  shard_map; "save_kda_experts" adds the routed experts' grouped-matmul outputs."""
  def table(policy):
    layer_step.main(["--preset", "tiny", "--batch", "1", "--seq-len", "64", "--remat", policy,
                     "--residuals", "--set", "kda_backend=pallas_gpu",
                     "--set", "gmm_backend=ragged_dot"])
    out = capsys.readouterr().out
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^\| ([^|]+?) \| [0-9.]+ \| (\d+) \|$", out, re.M)}

  full, kda, both = table("full"), table("save_kda"), table("save_kda_experts")
  assert "other (cp_chunk_kda)" not in full, full
  assert kda["other (cp_chunk_kda)"] == 3, kda
  assert "named moe_expert_matmul" not in kda, kda
  assert both["other (cp_chunk_kda)"] == 3 and both["named moe_expert_matmul"] >= 1, both
  assert full["total"] < kda["total"] < both["total"]
