"""The ablation harness end to end at a minimal size: one ablation trains through the stage
pipeline, its record holds the run's own numbers (metrics.jsonl), and the report's table is
regenerated from them (a changed record changes the table)."""

import json
import pathlib
import shutil

from experiments.ablations import BY_NAME, report
from experiments.ablations.run import run_ablation


def test_one_ablation_runs_and_the_report_table_comes_from_its_numbers(workdir, tmp_path):
  rec = run_ablation(BY_NAME["length"], "smoke", workdir, seeds=(0,), probes=False)
  (run,) = rec["variants"]["gated MLA"]["runs"]
  jsonl = pathlib.Path(run["run_dir"]) / "stage_8k" / "tb" / "metrics.jsonl"
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
  assert (docs / "ablations" / "length_loss.png").stat().st_size > 1000
  assert "## balancing" in text and "**Not run yet.**" in text  # the others are listed as such
  # Regenerated each time: another record (a probe's numbers), another table.
  run["probe"] = {"length": {"position_losses": {"loss@1L": 1.25, "loss@2L": 2.5,
                                                 "positions 0L-1L": 1.25,
                                                 "positions 1L-2L": 3.75},
                             "passkey": {"1L@0": 0.5, "2L@0": 0.0, "1L@1": 1.0, "2L@1": 0.25}}}
  (docs / "ablations" / "results.json").write_text(json.dumps({"length": rec}))
  report.main(["--from-results", f"--docs={docs}"])
  text = (docs / "ablations.md").read_text()
  assert "| gated MLA | 1.2500 ± 0.0000 | 2.5000 ± 0.0000 |" in text, text
  assert "| 1.2500 | 3.7500 |" in text and "| depth 1 | 1.00 | 0.25 |" in text, text
  shutil.rmtree(pathlib.Path(run["run_dir"]))
