"""A training stage starts from an imported HF checkpoint (`--set init_from=W`)."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from sparse_lm import sharding as shd

from sparse_lm.interop.hf import import_to_workdir, load_pretrained
from sparse_lm.train import loop
from tests.interop.hf_testlib import KIMI_LINEAR
from tests.train.conftest import small_stage

ROOT = KIMI_LINEAR.parents[3]


def test_cli_import_export_round_trip(tmp_path):
  w, out = tmp_path / "w", tmp_path / "out"
  env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
  for args in (["import", "--hf_dir", str(KIMI_LINEAR), "--workdir", str(w)],
               ["export", "--workdir", str(w), "--out", str(out)]):
    p = subprocess.run([sys.executable, "-m", "sparse_lm.interop.hf", *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
  conf = json.loads((out / "config.json").read_text())
  assert (conf["pad_token_id"], conf["bos_token_id"], conf["eos_token_id"]) == (0, 1, 2)
  a, _ = load_pretrained(KIMI_LINEAR)
  b, _ = load_pretrained(out)
  for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
    assert np.array_equal(np.asarray(x[...]), np.asarray(y[...])), p


def _init_from_import(tmp_path, *overrides):
  """(stage, parts, state): a stage with init_from=<import of the Kimi-Linear fixture> (no
  remat, KDA chunk 16, and `overrides`) and the loop's initial state from it."""
  w = tmp_path / "w"
  import_to_workdir(KIMI_LINEAR, w)
  stage = small_stage(name="ft", init_from=str(w), model_overrides=(
      ("remat_policy", "none"), ("kda_chunk_size", 16)) + overrides)
  mesh = shd.make_mesh(stage.mesh)
  parts = loop.build(stage, mesh)
  with shd.use_mesh(mesh, stage.mesh.rules):
    target = shd.with_shardings(parts.abstract_state, parts.state_shardings)
    state = loop._init_from(stage, tmp_path, mesh, target, "unused", parts,  # pylint: disable=protected-access
                            print)
  return stage, parts, state


def test_stage_starts_from_the_import(tmp_path):
  """StageConfig(init_from=W): the model is the import's (plus the stage's non-architecture
  overrides) and the loop's initial state holds its weights bit-exact, in the stage's
  shardings, with a fresh optimizer. (The training step itself is the loop's, tested in
  tests/train; a 2-step run from this import is recorded in docs/interop.md.)"""
  stage, parts, state = _init_from_import(tmp_path)
  cfg = stage.model_config()
  assert cfg.name == "kimi_linear" and cfg.ffn_activation == "swiglu" and cfg.kda_chunk_size == 16
  assert int(state.step) == 0
  imported, _ = load_pretrained(KIMI_LINEAR, remat_policy="none", kda_chunk_size=16)
  want = dict(nnx.to_flat_state(nnx.state(imported)))
  got = {**dict(nnx.to_flat_state(state.params)), **dict(nnx.to_flat_state(state.model_vars))}
  assert want.keys() == got.keys()
  shardings = {p: v.get_value() for part in (parts.state_shardings.params,
                                             parts.state_shardings.model_vars)
               for p, v in nnx.to_flat_state(part)}
  for p in want:
    assert np.array_equal(np.asarray(want[p][...]), np.asarray(got[p][...])), p
    assert got[p][...].sharding.is_equivalent_to(shardings[p], got[p][...].ndim), p


def test_export_reads_a_stage_checkpoint(tmp_path):
  """`export --workdir W` takes W's newest stage checkpoint (the loop's Orbax format: a
  TrainState item and a meta item with the model config) without importing sparse_lm.train."""
  from sparse_lm.interop import workdir
  from sparse_lm.train.checkpoint import Checkpointer
  from sparse_lm.train.state import TrainState
  model, cfg = load_pretrained(KIMI_LINEAR)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  state = TrainState(step=np.int32(3), params=params, model_vars=rest, opt_state={},
                     rng=np.zeros(2, np.uint32))
  ckpt = Checkpointer(tmp_path / "w" / "ft" / "checkpoints", async_save=False)
  ckpt.save(state, data_state={}, meta={"model": dataclasses.asdict(cfg)}, final=True)
  ckpt.close()
  back, cfg2 = workdir.load_stage_checkpoint(tmp_path / "w")
  assert cfg2 == cfg
  for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(model)),
                            nnx.to_flat_state(nnx.state(back))):
    assert np.array_equal(np.asarray(x[...]), np.asarray(y[...])), p

  # A newer step whose write was cut short: the export falls back to step 3, as training
  # and `sparse_lm.train.load` do, and says so (it used to fail on the newest step).
  from tests import checkpoint_testlib
  import jax
  newer = state.replace(step=np.int32(5), params=jax.tree.map(lambda x: x + 1, params))
  ckpt = Checkpointer(tmp_path / "w" / "ft" / "checkpoints", async_save=False)
  ckpt.save(newer, data_state={}, meta={"model": dataclasses.asdict(cfg)}, final=True)
  ckpt.close()
  checkpoint_testlib.truncate_arrays(tmp_path / "w" / "ft" / "checkpoints" / "5")
  with pytest.warns(RuntimeWarning, match=r"ft: step\(s\) 5 \(.*\) could not be read; "
                    r"using step 3"):
    back, _ = workdir.load_stage_checkpoint(tmp_path / "w")
  for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(model)),
                            nnx.to_flat_state(nnx.state(back))):
    assert np.array_equal(np.asarray(x[...]), np.asarray(y[...])), p


def test_exported_stage_imports_back_with_its_tokenizer(tmp_path):
  """export -> import -> generate: a trained stage's export carries its tokenizer
  (tokenizer.json, tokenizer_config.json, the bos / eos / pad ids in config.json), so the
  import has the same weights and a tokenizer with the same ids, and `generate --workdir`
  loads it (a new user's export could not be imported back: no tokenizer, null ids)."""
  import pathlib
  from sparse_lm import generate
  from sparse_lm.config import get_preset
  from sparse_lm.data.tokenizer import train_bpe
  from sparse_lm.interop import workdir
  from sparse_lm.interop.hf import export_from_workdir
  from sparse_lm.model import Transformer
  from sparse_lm.train.checkpoint import Checkpointer
  from sparse_lm.train.state import TrainState
  cfg = get_preset("tiny")
  texts = [p.read_text() for p in sorted(pathlib.Path(json.__file__).parent.glob("*.py"))]
  tok = train_bpe(texts, cfg.vocab_size)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  _, params, rest = nnx.split(model, nnx.Param, ...)
  state = TrainState(step=np.int32(2), params=params, model_vars=rest, opt_state={},
                     rng=np.zeros(2, np.uint32))
  ckpt = Checkpointer(tmp_path / "w" / "stage_8k" / "checkpoints", async_save=False)
  ckpt.save(state, data_state={}, final=True,
            meta={"model": dataclasses.asdict(cfg),
                  "tokenizer": {"fingerprint": tok.fingerprint, "json": tok.to_json()}})
  ckpt.close()

  _, _, saved_tok = workdir.load_stage_with_tokenizer(tmp_path / "w")
  assert saved_tok.fingerprint == tok.fingerprint
  assert workdir.stage_tokenizer(tmp_path / "w").fingerprint == tok.fingerprint
  with pytest.raises(ValueError, match=r"layout='kimi_linear' .* cannot hold "
                     r"ffn_activation='situ'.*moe_latent=True.*mla_output_gate=True.*"
                     r"residual='attnres_block'.*use layout='kimi_k3'"):
    export_from_workdir(tmp_path / "w", tmp_path / "refused", layout="kimi_linear")
  assert not (tmp_path / "refused").exists()  # refused before the tokenizer files
  out = tmp_path / "hf"
  export_from_workdir(tmp_path / "w", out)  # the preset's K3 features: kimi_k3 by default
  conf = json.loads((out / "config.json").read_text())
  assert conf["model_type"] == "kimi_k3"
  conf = conf["text_config"]
  assert (conf["bos_token_id"], conf["eos_token_id"], conf["pad_token_id"]) == (
      tok.bos_id, tok.eos_id, tok.pad_id)
  assert (out / "tokenizer.json").is_file()

  import_to_workdir(out, tmp_path / "w2")
  back, back_tok, _ = generate.load_workdir(tmp_path / "w2")
  text = "def f(x):\n    return {'a': x}  # <bos> stays text\n"
  assert back_tok.encode(text) == tok.encode(text)
  assert back_tok.decode(tok.encode(text)) == text
  assert (back_tok.bos_id, back_tok.eos_id, back_tok.pad_id) == (tok.bos_id, tok.eos_id,
                                                                 tok.pad_id)
  for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                            nnx.to_flat_state(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x[...], np.float32), np.asarray(y[...], np.float32),
                                  err_msg=str(p))


def test_init_from_takes_the_import_directory_itself_and_names_what_a_wrong_path_is(tmp_path):
  """`init_from` may name W or W/hf_import (what `import` prints it wrote); a raw HF
  checkpoint directory or another path gets a message that says to import it, not to run a
  stage of that name."""
  from sparse_lm.interop import workdir as hf_import
  w = tmp_path / "w"
  import_to_workdir(KIMI_LINEAR, w)
  assert hf_import.imported_config(w) == hf_import.imported_config(w / "hf_import")
  assert hf_import.imported_config(w).name == "kimi_linear"
  assert hf_import.imported_config(tmp_path) is None
  from sparse_lm.train import load  # an import is not a stage: the message says how to load it
  with pytest.raises(FileNotFoundError, match=r"it holds an HF import .*load_from_workdir.*"
                     r"--set init_from="):
    load(w)
  missing = loop._init_from_missing  # pylint: disable=protected-access
  msg = missing(small_stage(name="ft", init_from=str(KIMI_LINEAR)), tmp_path, tmp_path / "x")
  assert "HF checkpoint directory, not an import" in msg
  assert f"sparse_lm.interop.hf import --hf_dir {KIMI_LINEAR}" in msg
  msg = missing(small_stage(name="ft", init_from="/nonexistent"), tmp_path, tmp_path / "x")
  assert "neither an HF import" in msg and "experiments./" not in msg
  msg = missing(small_stage(name="ft", init_from="stage_8k"), tmp_path, tmp_path / "x")
  assert "python -m experiments.stage_8k --preset=" in msg


def test_cli_errors_are_one_line_with_status_2(tmp_path, capsys):
  """The interop CLI's errors (missing directories, a non-HF directory, --quantize with the
  kimi_linear layout, --out an existing file) exit with argparse's status 2 and the message, no traceback; the
  refused export writes nothing. A Kimi-Linear model exports as kimi_linear by default."""
  from sparse_lm.interop import hf
  from sparse_lm.interop import hf_config
  w = tmp_path / "w"
  import_to_workdir(KIMI_LINEAR, w)
  cases = [
      (["import", "--hf_dir", str(tmp_path / "none"), "--workdir", str(tmp_path / "x")],
       "no config.json"),
      (["export", "--workdir", str(tmp_path / "none"), "--out", str(tmp_path / "o1")],
       str(tmp_path / "none")),
      (["export", "--workdir", str(w), "--out", str(tmp_path / "o2"), "--quantize",
        "--layout", "kimi_linear"], "--quantize needs --layout kimi_k3"),
      (["export", "--workdir", str(w), "--out", str(KIMI_LINEAR / "config.json")],
       "is a file: give a directory"),
      (["import", "--hf_dir", str(w), "--workdir", str(tmp_path / "x")], "no config.json"),
  ]
  for argv, want in cases:
    with pytest.raises(SystemExit) as e:
      hf.main(argv)
    assert e.value.code == 2, argv
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err, (argv, err)
  assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
  _, cfg = load_pretrained(KIMI_LINEAR)
  assert hf_config.default_layout(cfg) == "kimi_linear" and not \
      hf_config.kimi_linear_cannot_express(cfg)
  hf.main(["export", "--workdir", str(w), "--out", str(tmp_path / "o3")])
  assert json.loads((tmp_path / "o3" / "config.json").read_text())["model_type"] == "kimi_linear"


@pytest.mark.parametrize("override", [("balancer_bins", 256), ("balancer", "bias_sign")])
def test_stage_from_the_import_with_other_balancer_settings(tmp_path, override):
  """`--set model.balancer_bins=256` (or another balancer) with init_from=W: the balancer
  statistics have another shape (or none), and the restore failed with Orbax's "Requested
  shape ... not compatible" (or "tree structures do not match") and pages of TensorStore
  specs. They are statistics reset at every balancer update: they start at zero; the weights
  and the balancer bias are the import's."""
  _, _, state = _init_from_import(tmp_path, override)
  imported, _ = load_pretrained(KIMI_LINEAR)
  want = dict(nnx.to_flat_state(nnx.state(imported)))
  got = {**dict(nnx.to_flat_state(state.params)), **dict(nnx.to_flat_state(state.model_vars))}
  for p, v in got.items():
    if p[-1] in ("balancer_hist", "balancer_load"):
      assert not np.asarray(v[...]).any(), p
    else:
      assert np.array_equal(np.asarray(want[p][...]), np.asarray(v[...])), p


def test_stage_from_the_import_with_another_architecture_names_it(tmp_path):
  """`--set model.num_experts=16` with init_from=W: Orbax's "Requested shape (64, 16) is not
  compatible with the stored shape" named neither the variable nor the override to drop."""
  w = tmp_path / "w"
  import_to_workdir(KIMI_LINEAR, w)
  stage = small_stage(name="ft", init_from=str(w), model_overrides=(
      ("remat_policy", "none"), ("kda_chunk_size", 16), ("num_experts", 16)))
  mesh = shd.make_mesh(stage.mesh)
  parts = loop.build(stage, mesh)
  with shd.use_mesh(mesh, stage.mesh.rules):
    target = shd.with_shardings(parts.abstract_state, parts.state_shardings)
    with pytest.raises(ValueError, match=r"not the import's architecture \(.*expert_down: the "
                       r"import has shape \[1, 8, .*\], the model shape \[1, 16, .*drop the --set "
                       r"model\.\* overrides"):
      loop._init_from(stage, tmp_path, mesh, target, "unused", parts, print)  # pylint: disable=protected-access
