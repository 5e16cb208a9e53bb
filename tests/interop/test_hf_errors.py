"""Bad checkpoints fail before any tensor value is read, naming the tensor or config key."""

import os
import numpy as np
import pytest

from sparse_lm.interop import hf_config
from sparse_lm.interop.hf import load_pretrained
from sparse_lm.interop.safetensors_io import CheckpointReader
from tests.interop.hf_testlib import KIMI_LINEAR, rewrite

Q = "model.layers.2.self_attn.q_proj.weight"


@pytest.fixture(autouse=True)
def no_value_reads(monkeypatch):
  """Every error must come from the headers and config.json alone."""
  def refuse(self, name):
    raise AssertionError(f"read tensor {name} before the checks failed")
  monkeypatch.setattr(CheckpointReader, "get", refuse)


def _drop(t):
  del t[Q]
  return t


def test_missing_tensor(tmp_path):
  d = rewrite(KIMI_LINEAR, tmp_path / "c", edit_tensors=_drop)
  with pytest.raises(ValueError, match=f"missing tensor.*{Q}.*shape \\[32, 64\\]"):
    load_pretrained(d)


def test_extra_tensor(tmp_path):
  extra = "model.layers.1.self_attn.rotary_emb.inv_freq"
  d = rewrite(KIMI_LINEAR, tmp_path / "c",
              edit_tensors=lambda t: {**t, extra: np.zeros(4, np.float32)})
  with pytest.raises(ValueError, match=f"unexpected tensor.*{extra}"):
    load_pretrained(d)


def test_wrong_shape(tmp_path):
  d = rewrite(KIMI_LINEAR, tmp_path / "c",
              edit_tensors=lambda t: {**t, Q: np.zeros((32, 63), np.float32)})
  with pytest.raises(ValueError, match=f"{Q} has shape \\[32, 63\\], expected \\[32, 64\\]"):
    load_pretrained(d)


@pytest.mark.parametrize("key,value", [("num_expert_group", 2), ("topk_group", 4),
                                       ("tie_word_embeddings", True),
                                       ("moe_router_activation_func", "softmax"),
                                       ("hidden_act", "gelu"), ("num_key_value_heads", 1),
                                       ("moe_renormalize", False)])
def test_unsupported_config_value(tmp_path, key, value):
  d = rewrite(KIMI_LINEAR, tmp_path / "c", edit_config=lambda c: {**c, key: value})
  with pytest.raises(ValueError, match=f"config.json: {key}="):
    load_pretrained(d)


def test_unknown_config_key_is_named_and_can_be_ignored(tmp_path):
  d = rewrite(KIMI_LINEAR, tmp_path / "c", edit_config=lambda c: {**c, "yarn_factor": 4})
  with pytest.raises(ValueError, match="unknown key.*yarn_factor"):
    load_pretrained(d)
  cfg, _ = hf_config.config_from_hf({**_conf(), "yarn_factor": 4}, ignore_keys=("yarn_factor",))
  assert cfg.num_layers == 5


def test_layer_layout_that_does_not_map(tmp_path):
  lt = ["linear_attention", "full_attention", "full_attention", "linear_attention",
        "full_attention"]
  d = rewrite(KIMI_LINEAR, tmp_path / "c", edit_config=lambda c: {**c, "layer_types": lt})
  with pytest.raises(ValueError, match="full_attn_layers=\\[2, 3, 5\\]"):
    load_pretrained(d)


def _conf():
  import json
  return json.loads((KIMI_LINEAR / "config.json").read_text())


def test_exported_shards_are_readable_as_the_index_is(tmp_path):
  """safetensors writes owner-only files; the writer gives the shards the mode the index gets
  (0666 less the umask), so a checkpoint can be shared with another user or container."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from sparse_lm.interop.safetensors_io import INDEX, ShardWriter  # pylint: disable=g-import-not-at-top
  old = os.umask(0o022)
  try:
    w = ShardWriter(tmp_path / "out", max_bytes=64)
    for i in range(3):
      w.add(f"t{i}", np.arange(16, dtype=np.float32))
    files = w.close()
  finally:
    os.umask(old)
  assert len(files) == 3
  for fn in files + [INDEX]:
    assert (tmp_path / "out" / fn).stat().st_mode & 0o777 == 0o644, fn


def test_cli_takes_dashed_and_underscored_flags(tmp_path, capsys):
  """`--hf-dir` and `--hf_dir` are one flag (the other CLIs use dashes: --max-new-tokens,
  --list-keys); either reaches the missing-directory check, not argparse's 'required'."""
  from sparse_lm.interop import hf  # pylint: disable=g-import-not-at-top
  for flag in ("--hf-dir", "--hf_dir"):
    with pytest.raises(SystemExit) as e:
      hf.main(["import", flag, str(tmp_path / "missing"), "--workdir", str(tmp_path / "w")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "missing" in err and "required" not in err, err


@pytest.mark.parametrize("what", ["scale dtype", "packed dtype", "scale shape"])
def test_mxfp4_pair_errors_come_from_the_headers_naming_the_tensor(tmp_path, what):
  """A bad MXFP4 pair failed only when its value was read (after every tensor before it) and
  the message named no tensor."""
  from tests.interop.hf_testlib import K3
  n = "language_model.model.layers.4.block_sparse_moe.experts.3.w2.weight"

  def edit(t):
    s, p = t[n + "_scale"], t[n + "_packed"]
    if what == "scale dtype":
      return {**t, n + "_scale": s.astype(np.int8)}
    if what == "packed dtype":
      return {**t, n + "_packed": p.view(np.int8)}
    return {**t, n + "_scale": np.concatenate([s, s], 1)}

  d = rewrite(K3, tmp_path / "c", edit_tensors=edit)
  with pytest.raises(ValueError, match=f"MXFP4 .*{n}_(scale|packed)"):
    load_pretrained(d)


LFS = ("version https://git-lfs.github.com/spec/v1\n"
       "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
       "size 1999654464\n")


def _hf_dir(tmp_path, shards: str, edit_config=None):
  """A copy of the Kimi-Linear fixture whose safetensors are replaced: "lfs" (Git LFS pointer
  files, what `git clone` without git-lfs leaves), "lfs index" (the index too), "random"
  (random bytes: the first 8 give a header length far larger than the file) or "truncated"
  (one shard cut to half: its header lists more data than the file holds)."""
  import json  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  d = tmp_path / "hf"
  shutil.copytree(KIMI_LINEAR, d)
  shard = d / "model-00001-of-00003.safetensors"
  if shards in ("lfs", "lfs index"):
    for f in d.glob("*.safetensors"):
      f.write_text(LFS)
    if shards == "lfs index":
      (d / "model.safetensors.index.json").write_text(LFS)
  elif shards == "random":
    shard.write_bytes(np.random.default_rng(0).bytes(300))
  else:
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
  if edit_config:
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit_config(conf)))
  return d, shard


def _cli_error(capsys, argv) -> str:
  from sparse_lm.interop import hf  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    hf.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()  # argparse's usage, then one line of error
  assert "Traceback" not in err and ": error: " in lines[-1], err
  assert not any(": error: " in line for line in lines[:-1]), err
  return err


@pytest.mark.parametrize("shards,want", [
    ("lfs", "a Git LFS pointer file, not the tensors .*git lfs pull"),
    ("lfs index", "a Git LFS pointer file: run `git lfs pull`"),
    ("random", "not a safetensors file, or truncated: its first 8 bytes give a header of "
               "[0-9,]+ bytes, but the file has 300 bytes"),
    ("truncated", "truncated: its header lists [0-9,]+ bytes of header and data, the file has")])
def test_cli_names_a_git_lfs_pointer_or_a_file_that_is_not_safetensors(tmp_path, capsys,
                                                                       shards, want):
  """A Git LFS pointer as a shard (a clone without git-lfs) ended in a MemoryError traceback
  (its first 8 bytes, "version ", read as the header length: 2**63 bytes), random bytes in an
  OverflowError; a truncated shard failed only when its tensors were read."""
  import re  # pylint: disable=g-import-not-at-top
  d, shard = _hf_dir(tmp_path, shards)
  err = _cli_error(capsys, ["import", "--hf_dir", str(d), "--workdir", str(tmp_path / "w")])
  if shards == "lfs":  # whichever shard is read first
    assert f"error: {d}/model-0000" in err and ".safetensors: a Git LFS pointer" in err, err
  else:
    named = d / "model.safetensors.index.json" if shards == "lfs index" else shard
    assert f"error: {named}: " in err, err
  assert re.search(want, err), err
  assert not (tmp_path / "w").exists()


def test_cli_names_a_config_json_that_is_not_json(tmp_path, capsys):
  """"error: Expecting property name enclosed in double quotes: line 1 column 2" named no
  file."""
  d, _ = _hf_dir(tmp_path, "lfs")
  (d / "config.json").write_text("{'vocab_size': 256}")
  err = _cli_error(capsys, ["import", "--hf_dir", str(d), "--workdir", str(tmp_path / "w")])
  assert f"error: {d / 'config.json'}: not valid JSON: Expecting property name" in err, err


def test_cli_unknown_config_key_says_which_flag_accepts_it(tmp_path, capsys):
  """The message said `pass ignore_keys=(...)`, which the CLI had no flag for."""
  d, _ = _hf_dir(tmp_path, "lfs", edit_config=lambda c: {**c, "yarn_factor": 4, "foo": 1})
  argv = ["import", "--hf_dir", str(d), "--workdir", str(tmp_path / "w")]
  err = _cli_error(capsys, argv)
  assert "unknown key(s) ['foo', 'yarn_factor']" in err and "--ignore-keys foo,yarn_factor" in err
  # with the flag the config maps: the import gets as far as the (LFS pointer) shards
  err = _cli_error(capsys, argv + ["--ignore-keys", "foo,yarn_factor"])
  assert "unknown key" not in err and "Git LFS pointer" in err, err


@pytest.mark.parametrize("below", [False, True])
def test_cli_import_into_a_workdir_that_is_a_file_is_refused_before_reading(tmp_path, capsys,
                                                                           below):
  """`--workdir <existing file>` read the whole checkpoint, then NotADirectoryError."""
  f = tmp_path / "file"
  f.write_text("x")
  w = f / "sub" if below else f
  err = _cli_error(capsys, ["import", "--hf_dir", str(KIMI_LINEAR), "--workdir", str(w)])
  assert f"workdir {w}: " + (f"{f} is a file" if below else "is a file") in err, err
  assert "give a directory" in err


def test_export_to_an_empty_out_is_refused(tmp_path, capsys, monkeypatch):
  """`--out ''` exported into the current directory (after deleting its config.json,
  tokenizer*.json and model*.safetensors)."""
  from sparse_lm.interop.hf import export_from_workdir  # pylint: disable=g-import-not-at-top
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  (cwd / "config.json").write_text("{}")
  monkeypatch.chdir(cwd)
  err = _cli_error(capsys, ["export", "--workdir", str(tmp_path / "w"), "--out", ""])
  assert "--out '' is empty: give a directory" in err, err
  with pytest.raises(ValueError, match="out is empty"):
    export_from_workdir(tmp_path / "w", "")
  assert os.listdir(cwd) == ["config.json"]
