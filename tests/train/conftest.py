"""Shared fixtures: one small stage config and one tokenizer for every in-process run."""

import dataclasses
import pathlib
import shutil

import pytest

# Every in-process run uses exactly these fields, so the jitted steps are built and compiled
# once per pytest process (sparse_lm.train.loop caches them per configuration; the session's
# compilation cache serves the other processes). 3 layers (KDA + dense FFN, MLA + MoE, MLA + MoE;
# AttnRes blocks open at layers 0 and 2): every kind of layer, few to compile.
SMALL_SETS = ("model.num_layers=3", "model.mla_every=2", "model.attnres_block_layers=2",
              "seq_len=64", "tokens_per_batch=256", "steps=5",
              "checkpoint_every=2", "eval_every=100", "eval_batches=1", "sample_tokens=0",
              "optim.warmup_steps=2")


def small_stage(**changes):
  from experiments import stage_8k
  from experiments.base import apply_overrides
  return dataclasses.replace(apply_overrides(stage_8k.TINY, SMALL_SETS), **changes)


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> pathlib.Path:
  """A tokenizer trained once on the default source (stdlib)."""
  from sparse_lm.data import DataConfig, load_or_train_tokenizer
  d = tmp_path_factory.mktemp("tok")
  load_or_train_tokenizer(DataConfig(), str(d), 512)
  return d / "tokenizer.json"


@pytest.fixture
def workdir(tmp_path, tokenizer_json) -> pathlib.Path:
  """A fresh workdir holding the shared tokenizer (so no run retrains it)."""
  shutil.copy(tokenizer_json, tmp_path / "tokenizer.json")
  return tmp_path
