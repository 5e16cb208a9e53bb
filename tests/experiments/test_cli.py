"""The stage command line: --set parsing and its errors, bad data input, stage chaining."""

import json
import os
import pathlib
import shutil

import pytest

from experiments import base, stage_8k, stage_64k, stage_256k, stage_1m
from tests.train.conftest import SMALL_SETS, tokenizer_json, workdir  # noqa: F401 (fixtures)


def _argv(workdir, *sets):
  out = ["--preset=tiny", f"--workdir={workdir}", "--no-progress"]
  for s in SMALL_SETS + sets:
    out += ["--set", s]
  return out


def _jsonl(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_unknown_set_key_suggests_the_nearest_keys(capsys):
  for wrong, nearest in (("learning_rate", "optim.peak_lr"),
                         ("model.num_layer", "model.num_layers"),
                         ("optim.peak_lt", "optim.peak_lr"), ("seqlen", "seq_len"),
                         ("batch_size", "tokens_per_batch")):
    with pytest.raises(SystemExit) as e:
      base.main(stage_8k.STAGES, ["--set", f"{wrong}=1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown --set key {wrong!r}; did you mean {nearest}" in err, err
    assert "--list-keys" in err


def test_url_workdir_is_refused_before_anything_is_built(capsys):
  """--workdir gs://... became a local folder "gs:" and failed at the first checkpoint save,
  after the compile and the first steps; now the parser stops at once with the fix."""
  with pytest.raises(SystemExit) as e:
    base.main(stage_8k.STAGES, ["--workdir", "gs://bucket/runs", "--steps", "2"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--workdir='gs://bucket/runs' is a URL" in err and "gcsfuse" in err, err
  assert not pathlib.Path("gs:").exists()


def test_a_workdir_that_is_a_file_is_refused_before_anything_is_built(tmp_path, capsys):
  """A file as --workdir (or above it, or as the stage's directory in it) ended in a
  NotADirectoryError / FileExistsError traceback after the compiles; now the parser stops."""
  afile = tmp_path / "afile"
  afile.write_text("x")
  (tmp_path / "w").mkdir()
  (tmp_path / "w" / "stage_8k").write_text("x")
  for workdir, want in ((afile, f"--workdir={afile}: is a file"),
                        (afile / "sub", f"--workdir={afile / 'sub'}: {afile} is a file"),
                        (tmp_path / "w", "(the stage's directory) is a file")):
    with pytest.raises(SystemExit) as e:
      base.main(stage_8k.STAGES, ["--workdir", str(workdir), "--steps", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert want in err, err


def test_help_shows_the_stage_defaults_and_list_keys_prints_every_key(capsys):
  with pytest.raises(SystemExit) as e:
    base.main(stage_8k.STAGES, ["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "tiny       500 steps x 8 sequences of 256 tokens (2,048 tokens/step)" in out
  assert "full   120,000 steps x 4,096 sequences of 8,192 tokens" in out
  assert "--list-keys" in out and "metrics.jsonl" in out and "--allow-config-change" in out
  assert base.main(stage_8k.STAGES, ["--list-keys", "--set", "optim.peak_lr=1e-2"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "optim.peak_lr=0.01" in lines and "seq_len=256" in lines and "model.num_layers=9" in lines
  assert len(lines) == len(base.valid_keys())


def test_set_values_are_parsed_to_the_field_type():
  s = base.apply_overrides(stage_8k.TINY, ["optim.peak_lr=1e-2", "steps=7", "init_from=None",
                                           "model.kda_gate_lower_bound=None", "mesh=context=2",
                                           "data.long_documents=true", "keep_optimizer_state=0"])
  assert s.optim.peak_lr == 0.01 and s.steps == 7 and s.init_from is None
  assert s.model_config().kda_gate_lower_bound is None
  assert s.mesh.context == 2 and s.data.long_documents and not s.keep_optimizer_state
  with pytest.raises(ValueError, match="expected an int"):
    base.apply_overrides(stage_8k.TINY, ["steps=many"])
  with pytest.raises(ValueError, match="kda_num_heads"):
    base.apply_overrides(stage_8k.TINY, ["model.kda_num_heads=0"])


def test_stage_files_derive_from_each_other():
  for preset in ("tiny", "small", "full"):
    s8, s64, s256, s1m = (m.STAGES[preset] for m in (stage_8k, stage_64k, stage_256k, stage_1m))
    for s in (s8, s64, s256, s1m):
      s.validate()
    assert (s64.init_from, s256.init_from, s1m.init_from) == ("stage_8k", "stage_64k",
                                                                "stage_256k")
    assert s8.seq_len < s64.seq_len < s256.seq_len < s1m.seq_len
    assert s64.tokens_per_batch == s8.tokens_per_batch
  assert [m.STAGES["tiny"].seq_len for m in (stage_8k, stage_64k, stage_256k, stage_1m)] == [
      256, 512, 1024, 2048]
  assert stage_64k.FULL.seq_len == 8 * stage_8k.FULL.seq_len
  assert stage_256k.FULL.mesh.context > 1 and stage_1m.FULL.mesh.context > 1
  # the layouts whose memory plans fit v5p HBM (docs/scaling.md)
  assert (stage_1m.FULL.mesh.expert, stage_1m.FULL.mesh.expert_shards) == (128, "context")
  cap = lambda s: s.model_config().ragged_buffer_factor
  assert cap(stage_8k.FULL) == cap(stage_1m.FULL) == 1.25
  assert cap(stage_8k.TINY) is None  # dropless below full scale


def test_mesh_and_expert_parallel_options_from_the_command_line():
  s = base.apply_overrides(stage_8k.TINY, ["mesh=expert=2,context=2,expert_shards=context",
                                           "model.ragged_buffer_factor=2.0",
                                           "model.ep_exchange=dense"])
  cfg = s.model_config()
  assert (s.mesh.expert, s.mesh.expert_shards, cfg.ragged_buffer_factor, cfg.ep_exchange) == (
      2, "context", 2.0, "dense")
  s = base.apply_overrides(stage_8k.TINY, ["mesh.expert_shards=context"])
  assert s.mesh.expert_shards == "context"
  with pytest.raises(ValueError, match="expert_shards='seq'"):
    base.apply_overrides(stage_8k.TINY, ["mesh.expert_shards=seq"])
  with pytest.raises(ValueError, match="ep_exchange='fast'"):
    base.apply_overrides(stage_8k.TINY, ["model.ep_exchange=fast"]).validate()
  with pytest.raises(ValueError, match="ragged_buffer_factor=0.0 must be > 0"):
    base.apply_overrides(stage_8k.TINY, ["model.ragged_buffer_factor=0"]).validate()
  with pytest.raises(ValueError, match="attention_backend='cudnn' cannot run with segment"):
    base.apply_overrides(stage_8k.TINY, ["model.attention_backend=cudnn"]).validate()


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_missing_or_empty_data_path_lists_what_was_searched(tmp_path, capsys, kind):
  path = tmp_path / "corpus"
  if kind == "empty":
    path.mkdir()
  code = base.main(stage_8k.STAGES, _argv(tmp_path / "run", f"data.source=text:{path}"))
  err = capsys.readouterr().err
  assert code == 1 and "error:" in err and str(path) in err


def test_unreadable_checkpoints_stop_with_the_message_not_a_traceback(tmp_path, capsys,
                                                                      monkeypatch):
  """Every checkpoint of the stage unreadable (Checkpointer.restore_latest's named error, its
  own test in tests/train/test_train_units.py): status 1 and the message."""
  from sparse_lm.train import checkpoint, loop

  def run(*args, **kwargs):
    raise checkpoint.UnreadableCheckpointError("no readable checkpoint in W (nothing was moved)")
  monkeypatch.setattr(loop, "run", run)
  code = base.main(stage_8k.STAGES, _argv(tmp_path / "run"))
  assert code == 1 and "error: no readable checkpoint in W" in capsys.readouterr().err


def test_binary_and_non_utf8_files_are_skipped_or_repaired(workdir, capsys):
  corpus = workdir / "corpus"
  corpus.mkdir()
  src = pathlib.Path(base.__file__).parent.parent / "sparse_lm"
  for i, f in enumerate(sorted(src.rglob("*.py"))[:40]):
    shutil.copy(f, corpus / f"doc{i}.txt")
  (corpus / "blob.bin.txt").write_bytes(bytes(range(256)) * 64)  # NUL bytes: binary
  (corpus / "latin1.txt").write_bytes("café = 'naïve'\n".encode("latin-1") * 50)
  code = base.main(stage_8k.STAGES, _argv(workdir, f"data.source=text:{corpus}",
                                          "data.eval_fraction=0.2"))
  out = capsys.readouterr().out
  assert code == 0
  assert "skipped 1 binary file" in out and "done at step 5" in out


def test_stage_64k_starts_from_stage_8k_final_weights(workdir):
  same_data = ("eval_batch_size=2", "data.long_documents=false")
  assert base.main(stage_8k.STAGES, _argv(workdir, *same_data)) == 0
  assert base.main(stage_64k.STAGES, _argv(workdir, *same_data, "seq_len=128")) == 0
  final_8k = _jsonl(workdir / "stage_8k" / "tb" / "metrics.jsonl")[-1]
  first_64k = next(r for r in _jsonl(workdir / "stage_64k" / "tb" / "metrics.jsonl")
                   if "eval/loss" in r)
  assert first_64k["step"] == 0
  # stage_8k evaluated its final weights at twice its length (128) on the same held-out rows.
  assert first_64k["eval/loss"] == pytest.approx(final_8k["final/eval_loss_at_128"], rel=1e-6)


def test_one_file_corpus_trains_with_a_tail_split_or_none(tmp_path, capsys):
  """Issue 12 (newcomer): `data.source=text:input.txt` trains (held out: the file's tail), also
  with no held-out split at all; the trained tokenizer.json is group-readable."""
  src = pathlib.Path(base.__file__).parent.parent / "sparse_lm"
  book = tmp_path / "input.txt"
  book.write_text("\n".join(f.read_text() for f in sorted(src.rglob("*.py"))[:30]))
  old = os.umask(0o022)
  try:
    code = base.main(stage_8k.STAGES, _argv(tmp_path / "run", f"data.source=text:{book}"))
  finally:
    os.umask(old)
  out = capsys.readouterr().out
  assert code == 0, out
  assert "held-out fraction 0.02 by tail" in out and "done at step 5: eval_loss@64" in out
  assert os.stat(tmp_path / "run" / "tokenizer.json").st_mode & 0o040  # group-readable
  # The same workdir with another held-out fraction: the saved config says what changed.
  code = base.main(stage_8k.STAGES, _argv(tmp_path / "run", f"data.source=text:{book}",
                                          "data.eval_fraction=0"))
  err = capsys.readouterr().err
  assert code == 1 and "data.eval_fraction: 0.02 (saved) vs 0.0 (now)" in err, err
  (tmp_path / "run0").mkdir()
  shutil.copy(tmp_path / "run" / "tokenizer.json", tmp_path / "run0" / "tokenizer.json")
  code = base.main(stage_8k.STAGES, _argv(tmp_path / "run0", f"data.source=text:{book}",
                                          "data.eval_fraction=0"))
  out = capsys.readouterr().out
  assert code == 0 and "no held-out split" in out
  assert "done at step 5: no held-out split" in out
  # A file too short for its held-out tail (2 lines: 2% of it ends at the last line break):
  # the run says at its start that no held-out loss will come, and why.
  short = tmp_path / "short.txt"
  short.write_text("def f(x):\n    return x + 1\n")
  (tmp_path / "run2").mkdir()
  shutil.copy(tmp_path / "run" / "tokenizer.json", tmp_path / "run2" / "tokenizer.json")
  code = base.main(stage_8k.STAGES, _argv(tmp_path / "run2", f"data.source=text:{short}"))
  out = capsys.readouterr().out
  assert code == 0, out
  assert "warning: the held-out split of text:" in out and "has no tokens" in out
  assert "done at step 5: no held-out loss: the held-out split has no tokens" in out


@pytest.mark.parametrize("item, field", [
    ("optim.peak_lr=-1", "optim.peak_lr=-1.0 must be > 0"),
    ("optim.warmup_steps=-10", "optim.warmup_steps=-10 must be >= 0"),
    ("optim.decay_fraction=2", "optim.decay_fraction=2.0 must be in [0, 1]"),
    ("optim.min_lr_ratio=-1", "optim.min_lr_ratio=-1.0 must be in [0, 1]"),
    ("optim.b1=1.5", "optim.b1=1.5 must be in [0, 1)"),
    ("optim.b2=-1", "optim.b2=-1.0 must be in [0, 1)"),
    ("optim.eps=-1", "optim.eps=-1.0 must be > 0"),
    ("optim.weight_decay=-1", "optim.weight_decay=-1.0 must be >= 0"),
    ("optim.clip_norm=0", "optim.clip_norm=0.0 must be > 0"),
    ("optim.muon_beta=2", "optim.muon_beta=2.0 must be in [0, 1)"),
    ("optim.muon_rms=-1", "optim.muon_rms=-1.0 must be > 0"),
    ("eval_batches=0", "eval_batches=0 must be >= 1"),
    ("eval_batch_size=-3", "eval_batch_size=-3 must be >= 1"),
    ("model.attention_chunk_size=0", "attention_chunk_size=0 must be > 0"),
    ("model.norm_eps=0", "norm_eps=0.0 must be > 0"),
    ("model.aux_loss_coef=-1", "aux_loss_coef=-1.0 must be >= 0"),
])
def test_bad_values_stop_before_anything_runs_and_name_the_field(item, field, tmp_path, capsys):
  """Values no run can use (a negative learning rate trained on and diverged before these
  checks) stop with status 2 and the field's name, before data or compiles."""
  with pytest.raises(SystemExit) as e:
    base.main(stage_8k.STAGES, ["--preset=tiny", f"--workdir={tmp_path}", "--set", item])
  assert e.value.code == 2
  assert field in capsys.readouterr().err
  assert not list(tmp_path.iterdir())  # nothing written


def test_model_name_can_be_set_like_any_other_field():
  """`--list-keys` lists model.name; setting it renames the config (it used to collide with
  get_preset's own argument)."""
  stage = base.apply_overrides(stage_8k.STAGES["tiny"], ["model.name=mine"])
  assert stage.model_config().name == "mine"
  stage.validate()


def test_vision_demo_refuses_a_step_count_below_one(capsys):
  """--steps -5 was accepted and evaluated an untrained model."""
  from experiments import vision_demo
  with pytest.raises(SystemExit) as e:
    vision_demo.main(["--steps", "-5"])
  assert e.value.code == 2
  assert "--steps=-5 must be >= 1" in capsys.readouterr().err


def test_vision_demo_refuses_a_file_as_its_workdir(capsys, tmp_path):
  """A file given as --workdir ended in a FileExistsError traceback."""
  from experiments import vision_demo
  f = tmp_path / "notes.txt"
  f.write_text("x")
  with pytest.raises(SystemExit) as e:
    vision_demo.main(["--workdir", str(f)])
  assert e.value.code == 2
  assert f"--workdir={f} is a file" in capsys.readouterr().err
