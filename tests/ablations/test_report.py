"""The ablation harness end to end at a minimal size: one ablation trains through the stage
pipeline, its record holds the run's own numbers (metrics.jsonl), and the report's table is
regenerated from them (a changed record changes the table)."""

import json
import re
import shutil

from experiments.ablations import BY_NAME, report
from experiments.ablations.run import run_ablation


def test_one_ablation_runs_and_the_report_table_comes_from_its_numbers(workdir, tmp_path):
  rec = run_ablation(BY_NAME["length"], "smoke", workdir, seeds=(0,))
  (run,) = rec["variants"]["gated MLA"]["runs"]
  jsonl = workdir / "length" / "model.mla_output_gate=true" / "seed0" / "stage_8k" / "tb" / \
      "metrics.jsonl"
  records = [json.loads(l) for l in jsonl.open()]
  assert run["loss"] == {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
  final = next(r for r in records if "final/eval_loss_at_64" in r)
  assert run["final"]["eval_loss@64"] == final["final/eval_loss_at_64"]
  assert run["final"]["eval_loss@128"] == final["final/eval_loss_at_128"]

  docs = tmp_path / "docs"
  (docs / "ablations").mkdir(parents=True)
  (docs / "ablations" / "results.json").write_text(json.dumps({"length": rec}))
  assert report.main(["--from-results", f"--docs={docs}"]) == 0
  text = (docs / "ablations.md").read_text()
  row = re.search(r"\| gated MLA \| ([\d.]+) ± ([\d.]+) \| ([\d.]+) ± ([\d.]+) \|", text)
  assert row, text
  assert float(row.group(1)) == round(run["final"]["eval_loss@64"], 4)
  assert float(row.group(3)) == round(run["final"]["eval_loss@128"], 4)
  assert (docs / "ablations" / "length_loss.png").stat().st_size > 1000
  assert "## balancing" in text and "**Not run yet.**" in text  # the others are listed as such
  # Regenerated each time: another record, another table.
  rec["variants"]["gated MLA"]["runs"][0]["final"]["eval_loss@64"] = 1.25
  (docs / "ablations" / "results.json").write_text(json.dumps({"length": rec}))
  report.main(["--from-results", f"--docs={docs}"])
  assert "| gated MLA | 1.2500 ± 0.0000 |" in (docs / "ablations.md").read_text()
  shutil.rmtree(workdir / "length")
