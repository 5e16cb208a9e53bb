"""What an export leaves on disk: refusals come before any file, a write into a directory that
held an earlier checkpoint leaves none of its files behind, a failed write leaves no loadable
mix, and the model's math is what an import gives back (eps values HF cannot spell are
refused, not dropped)."""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.interop import hf, hf_config, mxfp4, workdir
from sparse_lm.interop.hf import export_from_workdir, import_to_workdir, load_pretrained
from sparse_lm.interop.hf import save_pretrained
from sparse_lm.model import Transformer
from tests.interop.hf_testlib import DATA, KIMI_LINEAR, flat_state


@pytest.fixture(scope="module")
def tiny():
  cfg = get_preset("tiny")
  return Transformer(cfg, rngs=nnx.Rngs(0)), cfg


def test_reexport_into_the_same_directory_leaves_no_stale_shards(tiny, tmp_path):
  """A second export into the same --out (fewer shards) used to keep the first one's 14
  shards beside the new one, and a `model.safetensors` there (which transformers loads before
  the index) was kept too."""
  model, cfg = tiny
  out = tmp_path / "out"
  first = save_pretrained(model, cfg, out, layout="kimi_k3", max_shard_bytes=1 << 18)
  assert len(first) > 1
  shutil.copy(out / first[0], out / "model.safetensors")
  files = save_pretrained(model, cfg, out, layout="kimi_k3")
  assert files == ["model-00001-of-00001.safetensors"]
  assert sorted(os.listdir(out)) == ["config.json", *files, "model.safetensors.index.json"]


def test_reexport_does_not_leave_an_earlier_tokenizer_to_be_imported(tmp_path):
  """--out held an earlier export's tokenizer.json; the new export's model ships tiktoken.model,
  which `import` reads only when there is no tokenizer.json: the stale file was imported as the
  tokenizer of the new checkpoint."""
  hf_dir = tmp_path / "hf"
  shutil.copytree(KIMI_LINEAR, hf_dir)
  for f in (DATA / "tokenizer_tiktoken").iterdir():
    shutil.copy(f, hf_dir / f.name)
  import_to_workdir(hf_dir, tmp_path / "w")
  out = tmp_path / "out"
  out.mkdir()
  for f in (DATA / "tokenizer_json").iterdir():  # an earlier export's tokenizer files
    shutil.copy(f, out / f.name)
  export_from_workdir(tmp_path / "w", out)
  assert (out / "tiktoken.model").is_file() and not (out / "tokenizer.json").exists()
  import_to_workdir(out, tmp_path / "w2")
  from sparse_lm.data import Tokenizer
  back = Tokenizer.load(workdir.tokenizer_path(tmp_path / "w2"))
  want = Tokenizer.load(workdir.tokenizer_path(tmp_path / "w"))
  assert back.to_json() == want.to_json()


def test_export_without_a_tokenizer_removes_an_earlier_one(tmp_path):
  """An import that recorded no tokenizer, exported over an export that had one: the stale
  tokenizer files would pair another vocabulary with these weights."""
  import_to_workdir(KIMI_LINEAR, tmp_path / "w")  # the fixture ships no tokenizer
  out = tmp_path / "out"
  out.mkdir()
  for f in (DATA / "tokenizer_json").iterdir():
    shutil.copy(f, out / f.name)
  export_from_workdir(tmp_path / "w", out)
  assert not any((out / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                              "tiktoken.model"))


def test_quantized_export_that_cannot_pack_is_refused_before_any_file(tmp_path):
  """moe_latent_dim=48 is not a multiple of MXFP4's block of 32: the error came from the
  quantizer half-way through the shards (after the tokenizer files and some shards were
  written, `shard-*.tmp` files left behind) and named no field."""
  cfg = get_preset("tiny", moe_latent_dim=48)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"moe_latent_dim=48 is not a multiple of 32"):
    save_pretrained(model, cfg, tmp_path / "q", layout="kimi_k3", quantize_experts=True,
                    max_shard_bytes=1 << 16)
  assert not (tmp_path / "q").exists()


def test_a_write_that_fails_half_way_leaves_no_loadable_mix(tiny, tmp_path, monkeypatch):
  """Re-export over an earlier checkpoint that stops in the middle: the earlier config.json
  was kept over a mix of old and new shards, and the temporary shards stayed."""
  model, cfg = tiny
  out = tmp_path / "out"
  save_pretrained(model, cfg, out, layout="kimi_k3", max_shard_bytes=1 << 18)
  calls = []
  real = mxfp4.quantize

  def fail_late(w):
    calls.append(1)
    if len(calls) > 20:
      raise OSError("disk full")
    return real(w)

  monkeypatch.setattr(mxfp4, "quantize", fail_late)
  with pytest.raises(OSError, match="disk full"):
    save_pretrained(model, cfg, out, layout="kimi_k3", quantize_experts=True,
                    max_shard_bytes=1 << 14)
  assert not (out / "config.json").exists()
  assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_pretrained(out)


def test_eps_values_hf_cannot_spell_are_refused_not_dropped(tiny, tmp_path):
  """l2_norm_eps has no config key (import gives 1e-6) and the K3 config has one rms_norm_eps:
  an export used to write such a model and the import gave another model back silently."""
  _, cfg = tiny
  for bad, layout, match in [
      (get_preset("tiny", l2_norm_eps=1e-5), "kimi_k3", r"l2_norm_eps=1e-05 has no HF spelling"),
      (get_preset("tiny", norm_eps=1e-5, mla_norm_eps=1e-6), "kimi_k3",
       r"mla_norm_eps=1e-06 .* no spelling in layout='kimi_k3'.*import would give eps 1e-05"),
  ]:
    model = Transformer(bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
      save_pretrained(model, bad, tmp_path / "e", layout=layout)
    assert not (tmp_path / "e").exists()
  # A Kimi-Linear import (rms_norm_eps 1e-5, MLA norms at 1e-6) as kimi_k3: refused, naming
  # the layout that holds it; as kimi_linear it round-trips exactly.
  model, kl = load_pretrained(KIMI_LINEAR)
  assert (kl.norm_eps, kl.mla_norm_eps) == (1e-5, 1e-6)
  with pytest.raises(ValueError, match=r"or use layout='kimi_linear'"):
    hf_config.config_to_hf(kl, "kimi_k3")
  save_pretrained(model, kl, tmp_path / "kl", layout="kimi_linear")
  back, kl2 = load_pretrained(tmp_path / "kl")
  assert kl2 == kl
  a, b = flat_state(model), flat_state(back)
  assert all(np.array_equal(a[p], b[p]) for p in a)


def test_exported_preset_imports_back_with_the_same_math(tiny, tmp_path):
  """The tiny preset through kimi_k3: every field that changes the forward pass comes back
  (the import differs only in non-architecture fields: chunk sizes, remat, balancer bins)."""
  model, cfg = tiny
  save_pretrained(model, cfg, tmp_path / "k3", layout="kimi_k3")
  back, cfg2 = load_pretrained(tmp_path / "k3")
  math_fields = ("norm_eps", "mla_norm_eps", "l2_norm_eps", "dtype", "param_dtype",
                 "route_scale", "situ_beta1", "situ_beta2", "kda_gate_lower_bound",
                 "attnres_block_layers", "residual", "ffn_activation", "moe_latent")
  assert {f: getattr(cfg2, f) for f in math_fields} == {f: getattr(cfg, f) for f in math_fields}
  a, b = flat_state(model), flat_state(back)
  assert all(np.array_equal(a[p], b[p]) for p in a if "balancer_hist" not in str(p))


def test_reimport_that_fails_half_way_leaves_no_import(tmp_path, monkeypatch):
  """A re-import over an earlier one that stops while the weights are written: the earlier
  sparse_lm_model.json (another config) stayed beside the new, partial weights."""
  import orbax.checkpoint as ocp
  w = tmp_path / "w"
  import_to_workdir(KIMI_LINEAR, w)
  assert workdir.imported_config(w) is not None
  real = ocp.StandardCheckpointer.save

  def fail_on_model_vars(self, path, *a, **k):
    if str(path).endswith("model_vars"):
      raise OSError("disk full")
    return real(self, path, *a, **k)

  monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail_on_model_vars)
  model, cfg = load_pretrained(DATA / "kimi_k3_tiny")
  with pytest.raises(OSError, match="disk full"):
    workdir.save_import(model, cfg, json.loads((DATA / "kimi_k3_tiny" / "config.json")
                                               .read_text()), w)
  assert workdir.imported_config(w) is None
  with pytest.raises(FileNotFoundError, match="no HF import"):
    workdir.load_from_workdir(w)


def test_cli_names_the_quantize_field_with_status_2(tmp_path, capsys):
  """The refusal reaches the CLI as one line, status 2, before --out is created."""
  from sparse_lm.train.checkpoint import Checkpointer
  from sparse_lm.train.state import TrainState
  import dataclasses
  cfg = get_preset("tiny", moe_latent_dim=48)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  _, params, rest = nnx.split(model, nnx.Param, ...)
  state = TrainState(step=np.int32(1), params=params, model_vars=rest, opt_state={},
                     rng=np.zeros(2, np.uint32))
  ckpt = Checkpointer(tmp_path / "w" / "stage_8k" / "checkpoints", async_save=False)
  ckpt.save(state, data_state={}, final=True, meta={"model": dataclasses.asdict(cfg)})
  ckpt.close()
  with pytest.raises(SystemExit) as e:
    hf.main(["export", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
             "--quantize"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "moe_latent_dim=48 is not a multiple of 32" in err and "Traceback" not in err
  assert not (tmp_path / "o").exists()
