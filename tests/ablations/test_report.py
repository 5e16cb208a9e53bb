"""The ablation harness end to end at a minimal size: equal configurations share one run, one
ablation trains through the stage pipeline, its record holds the run's own numbers
(metrics.jsonl), a worker process (pinned to one core) reuses the finished run, training
nothing, and the report's table is regenerated from the record (a changed record changes the
table)."""

import json
import os
import pathlib

import pytest

from experiments.ablations import BY_NAME, jobs, report
from experiments.ablations.run import collect, config_key, run_ablation, stage_for


def test_equal_configurations_share_one_run():
  key = lambda name, i: config_key(stage_for(BY_NAME[name], "tiny", BY_NAME[name].variants[i], 0))
  # The default model under four names (bounded gate, block AttnRes, gated MLA, SiTU-GLU).
  assert key("gate", 0) == key("residual", 0) == key("length", 0) == key("activation", 0)
  assert len({key("gate", 1), key("residual", 1), key("residual", 2), key("activation", 1),
              key("gate", 0)}) == 5
  assert config_key(stage_for(BY_NAME["gate"], "tiny", BY_NAME["gate"].variants[0], 1)) == \
      key("gate", 0)  # the seed is not part of the key (it names the run's subdirectory)
  tasks = jobs.plan(["gate", "residual", "length", "activation", "balancing"], "tiny", (0, 1))
  assert len(tasks) == 5 + 5  # the default + 4 other models, 5 balancers
  (default,) = [t for t in tasks if len(t["users"]) > 1]
  assert sorted(default["users"]) == ["activation / SiTU-GLU", "gate / bounded (-5)",
                                      "length / gated MLA", "residual / block AttnRes"]
  assert sorted(default["probes"]) == ["activation", "gate", "length"]
  assert [t["users"][0].split(" / ")[0] for t in tasks[:5]] == ["balancing"] * 5  # heaviest


def test_one_ablation_runs_a_worker_reuses_it_and_the_report_table_comes_from_its_numbers(
    workdir, tmp_path):
  ablation = BY_NAME["length"]
  rec = run_ablation(ablation, "smoke", workdir, seeds=(0,), probes=False)
  (run,) = rec["variants"]["gated MLA"]["runs"]
  jsonl = pathlib.Path(run["run_dir"]) / "stage_8k" / "tb" / "metrics.jsonl"
  records = [json.loads(l) for l in jsonl.open()]
  assert run["loss"] == {str(r["step"]): r["train/loss"] for r in records if "train/loss" in r}
  final = next(r for r in records if "final/eval_loss_at_64" in r)
  assert run["final"]["eval_loss@64"] == final["final/eval_loss_at_64"]
  assert run["final"]["eval_loss@128"] == final["final/eval_loss_at_128"]
  # A worker process, pinned to one core, given the same configuration reads the finished run
  # back and trains nothing (its checkpoints are gone).
  (jsonl.parent.parent / "checkpoints").rename(tmp_path / "moved")
  tasks = [{**t, "probes": []} for t in jobs.plan(["length"], "smoke", (0,))]  # as above
  used = jobs.run_tasks(tasks, 1, "smoke", workdir, say=lambda s: None)
  log = (workdir / "logs" / f"{tasks[0]['key']}.log").read_text()
  assert f"affinity [{sorted(os.sched_getaffinity(0))[0]}]" in log, log[-3000:]
  assert used["jobs"] == 1 and 0 < used["worker_peak_rss_gb"] < 3
  assert collect(ablation, "smoke", workdir, (0,)) == rec
  with pytest.raises(FileNotFoundError, match="seed 1: no finished run"):
    collect(ablation, "smoke", workdir, (0, 1))

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
  # A parallel invocation too short for a load sample (recorded as None) still renders, on this
  # and every later run.
  meta = {"_runs": [{"command": "python -m experiments.ablations.report --jobs 2",
                     "date": "2026-12-06", "commit": "abc1234", "seconds": 4.2,
                     "load_start": 0.5, "load_end": 0.7, "load_mean": None, "load_max": None,
                     "jobs": 2, "worker_peak_rss_gb": 1.25, "machine": "2 cores"}]}
  (docs / "ablations" / "results.json").write_text(json.dumps({"length": rec, "_meta": meta}))
  assert report.main(["--from-results", f"--docs={docs}"]) == 0
  text = (docs / "ablations.md").read_text()
  assert ("2 worker processes, 1-minute load average not sampled mean and not sampled max "
          "over the run, largest worker's peak resident memory 1.25 GB") in text, text


@pytest.mark.parametrize("argv,needle", [
    (["--only", ","], "names no ablation"),
    (["--only", "gate,nope"], "unknown ablation"),
    (["--seeds", "a,b"], "comma-separated integers"),
    (["--seeds", "1,1"], "a seed is repeated"),
    (["--seeds", "0"], "at least 2 seeds"),
])
def test_bad_arguments_stop_with_the_flag_named(argv, needle, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    report.main(argv + [f"--docs={tmp_path}", f"--workdir={tmp_path}/w"])
  assert e.value.code == 2
  assert needle in capsys.readouterr().err
  assert not (tmp_path / "w").exists()


def test_a_rerun_that_reuses_every_run_keeps_the_claims_date_and_commit(tmp_path,
                                                                        monkeypatch):
  """A rerun that trained nothing rewrote the claim's line with its own time, commit and
  0 s; the record's meta now stays that of the invocation that trained the runs, and a
  changed record gets new meta."""
  from experiments.ablations import run as run_lib
  rec = {"name": "length", "variants": {"a": {"value": 1, "runs": [{"seconds": 12.0}]}}}
  old = {"date": "2026-12-01 10:00 UTC", "commit": "abc1234", "seconds": 12.0,
         "seconds_are": "wall", "machine": "m"}
  monkeypatch.setattr(run_lib, "run_ablation", lambda *a, **k: json.loads(json.dumps(rec)))
  monkeypatch.setattr(report, "write_report", lambda results, docs: None)
  args = type("A", (), {"jobs": 1, "workdir": str(tmp_path), "preset": "smoke"})()
  store = tmp_path / "results.json"
  results = {"length": json.loads(json.dumps(rec)), "_meta": {"length": dict(old)}}
  out = report._run(args, ["length"], (0,), results, store, tmp_path, ["--only", "length"])
  assert out["_meta"]["length"] == old
  rec["variants"]["a"]["runs"][0]["seconds"] = 13.0  # a retrained run: new numbers, new meta
  out = report._run(args, ["length"], (0,), out, store, tmp_path, ["--only", "length"])
  assert out["_meta"]["length"]["date"] != old["date"]


def test_a_budget_is_named_as_one_on_the_tiny_model(tmp_path, capsys):
  """`--preset small` trains stage_8k's tiny model (9 layers, d_model 64) for 2,000 steps, not
  the small model: --help, BUDGETS and the report's label say so, from the resolved config."""
  from experiments.ablations import BUDGETS, PRESETS
  assert set(BUDGETS) == set(PRESETS)
  for preset, text in BUDGETS.items():
    stage = stage_for(BY_NAME["gate"], preset, BY_NAME["gate"].variants[0], 0)
    model = stage.model_config()
    assert model.name == "tiny" and text.startswith("tiny model")
    assert f"{model.num_layers} layers" in text and f"{stage.steps:,} steps" in text
    assert f"{stage.tokens_per_batch // stage.seq_len} x {stage.seq_len} tokens" in text
  with pytest.raises(SystemExit):
    report.main(["--help"])
  assert "small = tiny model at its own 9 layers, 2,000 steps" in " ".join(
      capsys.readouterr().out.split())
  record = {"name": "optimizer", "preset": "small", "seeds": [0],
            "variants": {"AdamW": {"value": "adamw", "runs": [
                {"seed": 0, "steps": 2000, "tokens_per_step": 2048, "seq_len": 256,
                 "loss": {"0": 5.0, "1": 4.0}, "max_mean_load": {}, "dead_frac": {},
                 "final": {"eval_loss@256": 4.0}, "probe": {}, "seconds": 1.0}]}}}
  label = ("budget `small` (tiny model: 9 layers, d_model 64, 8 experts; 2,000 steps of "
           "2,048 tokens in rows of 256)")
  assert report.budget_label(record) == label
  text = report.write_report({"optimizer": record}, tmp_path)
  assert f", {label}, seeds [0]," in text and "preset `small`" not in text, text


def test_jobs_beyond_the_cores_are_printed_and_recorded_as_run(tmp_path, monkeypatch, capsys):
  """--jobs 2 with one allowed core runs one (here, in this process) and says so."""
  from experiments.ablations import run as run_lib
  rec = {"name": "length", "variants": {"a": {"value": 1, "runs": [{"seconds": 1.0}]}}}
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
  monkeypatch.setattr(run_lib, "run_ablation", lambda *a, **k: json.loads(json.dumps(rec)))
  monkeypatch.setattr(run_lib, "collect", lambda *a, **k: json.loads(json.dumps(rec)))
  monkeypatch.setattr(jobs, "plan", lambda *a: [])
  monkeypatch.setattr(jobs, "run_tasks", lambda *a, **k: {"jobs": 1, "cores": [0]})
  monkeypatch.setattr(report, "write_report", lambda results, docs: None)
  args = type("A", (), {"jobs": 2, "workdir": str(tmp_path), "preset": "smoke"})()
  out = report._run(args, ["length"], (0,), {}, tmp_path / "results.json", tmp_path,
                    ["--jobs", "2"])
  printed = capsys.readouterr().out
  assert "2 workers" not in printed and "--jobs 2: this process may use 1 core" in printed
  (whole,) = out["_meta"]["_runs"]
  assert whole["jobs"] == 1 and whole["jobs_asked"] == 2


@pytest.mark.parametrize("make,needle", [
    (lambda docs: None, "no such directory"),
    (lambda docs: docs.mkdir(), "no recorded results at"),
])
def test_from_results_without_results_stops_with_a_clear_error(tmp_path, capsys, make, needle):
  docs = tmp_path / "docs"
  make(docs)
  with pytest.raises(SystemExit) as e:
    report.main(["--from-results", f"--docs={docs}"])
  assert e.value.code == 2 and needle in capsys.readouterr().err
  assert not (docs / "ablations.md").exists()


def _gate_record(exps_by_seed: dict[int, dict[str, list[float]]]) -> dict:
  """A gate record whose runs' probes have these dense-tile exponents ({seed: {step: per KDA
  layer}}), the unbounded variant's 10 nats above the bounded one's."""
  runs = lambda shift: [
      {"seed": seed, "steps": 4, "tokens_per_step": 256, "seq_len": 64,
       "loss": {"0": 5.0, "2": 4.0}, "max_mean_load": {}, "dead_frac": {},
       "final": {"eval_loss@64": 4.0}, "seconds": 1.0,
       "probe": {"gate": {"step": 4, "gate_exponent": {
           s: [x + shift for x in e] for s, e in exps.items()}}}}
      for seed, exps in exps_by_seed.items()]
  return {"name": "gate", "preset": "smoke", "seeds": sorted(exps_by_seed),
          "variants": {"bounded (-5)": {"value": "-5.0", "runs": runs(0.0)},
                       "unbounded": {"value": "None", "runs": runs(10.0)}}}


def test_gate_steps_kept_by_one_seed_only_are_left_out(tmp_path, monkeypatch):
  """A run stopped by Ctrl-C saves an off-grid checkpoint (here step 1, seed 0 only) and its
  gate probe covers it: the report, its tables and plot use the steps every seed has (a step
  list from the first seed raised KeyError, and `--from-results` could never rebuild it)."""
  import matplotlib.axes  # pylint: disable=g-import-not-at-top
  from experiments.ablations.run import extra_tables  # pylint: disable=g-import-not-at-top
  record = _gate_record({0: {"1": [7.0, 8.0], "2": [10.0, 20.0], "4": [12.0, 30.0]},
                         1: {"2": [10.0, 22.0], "4": [12.0, 34.0]}})
  tables = extra_tables(record)
  assert [[row[0] for row in body] for _, _, body in tables] == [["2", "4"], ["2", "4"]]
  assert tables[0][2][0] == ["2", "10.0", "21.0"], tables
  text = report.verdict(record)
  # worst layer, mean over both seeds: 21 at step 2, 32 at step 4 (not seed 0's step 1 alone)
  assert "grows over training: 31.0 nats at step 2, 42.0 at step 4" in text, text
  assert "(bounded: 21.0 -> 32.0)" in text, text
  plotted = {}
  real_plot = matplotlib.axes.Axes.plot

  def spy(ax, xs, ys, *args, **kwargs):
    plotted.setdefault(kwargs.get("label"), (list(xs), list(ys)))
    return real_plot(ax, xs, ys, *args, **kwargs)
  monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
  assert "gate_exponent.png" in report.plot(record, tmp_path / "plots")
  assert plotted["bounded (-5)"] == ([2 * 256, 4 * 256], [21.0, 32.0]), plotted
  docs = tmp_path / "docs"
  (docs / "ablations").mkdir(parents=True)
  (docs / "ablations" / "results.json").write_text(json.dumps({"gate": record}))
  assert report.main(["--from-results", f"--docs={docs}"]) == 0
  assert "| 2 | 10.0 | 21.0 |" in (docs / "ablations.md").read_text()


def test_a_run_of_another_budget_does_not_replace_a_record_without_replace(tmp_path,
                                                                           monkeypatch, capsys):
  """A smoke run with the default --docs replaced the published 80-step tiny record with a
  2-step one; it now stops before training, naming the record's budget and --replace."""
  record = {**_gate_record({0: {"80": [1.0]}, 1: {"80": [1.0]}}), "preset": "tiny"}
  for v in record["variants"].values():
    for r in v["runs"]:
      r.update(steps=80, tokens_per_step=2048, seq_len=128)
  docs = tmp_path / "docs"
  (docs / "ablations").mkdir(parents=True)
  stored = json.dumps({"gate": record})
  (docs / "ablations" / "results.json").write_text(stored)
  assert report.other_budgets({"gate": record}, ["gate", "length"], "tiny") == []
  argv = ["--preset", "smoke", "--only", "gate", f"--docs={docs}", f"--workdir={tmp_path}/w"]
  with pytest.raises(SystemExit) as e:
    report.main(argv)
  err = " ".join(capsys.readouterr().err.split())
  assert e.value.code == 2 and "--replace" in err, err
  assert "gate (budget `tiny` (" in err and "80 steps of 2,048 tokens" in err, err
  assert not (tmp_path / "w").exists()
  assert (docs / "ablations" / "results.json").read_text() == stored
  assert not (docs / "ablations.md").exists()
  ran = []
  monkeypatch.setattr(report, "_run", lambda args, names, *a: ran.append(names) or {})
  monkeypatch.setattr(report, "write_report", lambda results, docs: None)
  assert report.main(argv + ["--replace"]) == 0 and ran == [["gate"]]
  # A run of the record's own budget (resuming or redoing it) needs no flag.
  assert report.main(["--preset", "tiny", "--only", "gate", f"--docs={docs}"]) == 0
  assert ran == [["gate"], ["gate"]]


@pytest.mark.parametrize("message,said", [
    ("/w/runs/abc/seed0 stopped at step 1; rerun to resume", "rerun to resume"),  # train_run
    ("stopped by SIGINT: 2 worker(s) saved their runs and stopped. Rerun the same command to "
     "resume (finished runs are read back).", "Rerun the same command"),  # jobs.Stopped
    ("", "Rerun the same command"),
])
def test_an_interrupt_says_to_rerun_once(message, said, tmp_path, monkeypatch, capsys):
  def stop(*a):
    raise KeyboardInterrupt(message)
  monkeypatch.setattr(report, "_run", stop)
  assert report.main(["--preset", "smoke", "--jobs", "1", f"--docs={tmp_path}"]) == 130
  err = capsys.readouterr().err
  assert said in err and err.lower().count("rerun") == 1, err
