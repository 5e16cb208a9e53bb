"""`python -m sparse_lm.generate` on a checkpoint written the way the training loop writes one,
and the end-of-stage sample (train/sample.py) through the engine."""

import io
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from sparse_lm import generate as cli
from sparse_lm.config import get_preset
from sparse_lm.data.tokenizer import train_bpe
from sparse_lm.inference import Engine, SamplingParams
from sparse_lm.model import Transformer
from sparse_lm.train import sample
from sparse_lm.train.checkpoint import Checkpointer
from sparse_lm.train.state import TrainState, split_model

WORDS = "def return class import lambda yield print value index list dict".split()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  rng = np.random.default_rng(0)
  texts = [" ".join(rng.choice(WORDS, 40)) for _ in range(200)]
  tokenizer = train_bpe(iter(texts), vocab_size=300)
  root = tmp_path_factory.mktemp("run")
  model = Transformer(get_preset("tiny"), rngs=nnx.Rngs(4))
  _, params, model_vars = split_model(model)
  for stage, step in (("stage_8k", 3), ("stage_64k", 5)):  # stage_64k is written last
    state = TrainState(step=jax.numpy.int32(step), params=params, model_vars=model_vars,
                       opt_state=optax.adamw(1e-3).init(params), rng=jax.random.PRNGKey(0))
    ckpt = Checkpointer(root / stage / "checkpoints", async_save=False)
    ckpt.save(state, data_state={}, meta={
        "stage": {"name": stage, "preset": "tiny", "model_overrides": []},
        "tokenizer": {"fingerprint": tokenizer.fingerprint, "json": tokenizer.to_json()}})
    ckpt.close()
  return root, model, tokenizer


def test_cli_streams_the_engines_greedy_completion(workdir):
  root, model, tokenizer = workdir
  assert cli.find_checkpoint(root) == root / "stage_64k" / "checkpoints" / "5"
  loaded, tok, meta = cli.load_checkpoint(cli.find_checkpoint(root))
  assert meta["step"] == 5 and tok.fingerprint == tokenizer.fingerprint
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded))):
    np.testing.assert_array_equal(a, b)
  out = io.StringIO()
  assert cli.main(["--workdir", str(root), "--prompt", "def ", "--max-new-tokens", "5",
                   "--max-length", "64", "--prefill-chunk", "64"], out=out) == 0
  ids = [tokenizer.bos_id] + tokenizer.encode("def ")
  engine = Engine(model, max_length=64, max_batch=1, prefill_chunk=64)
  want = engine.generate([ids], max_new_tokens=5, sampling=SamplingParams(
      temperature=0, stop_tokens=[tokenizer.eos_id]))[0].tokens
  assert out.getvalue() == "def " + tokenizer.decode(want, skip_special=True) + "\n"
  # The end-of-stage sample: the same engine, eos not returned.
  _, params, model_vars = split_model(model)
  got = sample.generate(nnx.graphdef(model), params, model_vars, ids, max_new_tokens=5,
                        eos_id=tokenizer.eos_id)
  assert got == [t for t in want if t != tokenizer.eos_id]


def test_cli_refuses_another_preset_before_compiling(workdir):
  root, _, _ = workdir
  with pytest.raises(ValueError, match=r"--preset='small'.*'tiny' model.*--preset=tiny"):
    cli.main(["--workdir", str(root), "--preset", "small", "--prompt", "x"])
  with pytest.raises(FileNotFoundError, match="--workdir"):
    cli.main(["--workdir", str(root / "nothing"), "--prompt", "x"])
