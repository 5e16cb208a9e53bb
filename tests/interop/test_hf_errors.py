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
