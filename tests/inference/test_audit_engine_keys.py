"""Audit test of the engine's randomness contract (engine.py module docstring): request i of a
call with an int seed draws its n-th token with fold_in(fold_in(PRNGKey(seed), i), n), with a
list of seeds fold_in(PRNGKey(seed[i]), n); plain sampling draws categorical(key, logits / T).

The expected tokens are drawn here from the model's full forward pass over each history
(`Transformer.__call__`, no cache code), so a draw that reused one key for every step of a row
(correlated tokens, the same Gumbel noise each step) or keyed rows by slot shows up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.inference import Engine, SamplingParams
from sparse_lm.model import Transformer

SEED = 4
PAD = 48  # the reference pads every history to this length (one compile)


@pytest.fixture(scope="module")
def setup():
  print("seed", SEED)
  cfg = get_preset("tiny", num_layers=3, mla_every=2, residual="standard", num_dense_layers=2)
  model = Transformer(cfg, rngs=nnx.Rngs(SEED))
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda t: nnx.merge(graphdef, state)(t).astype(jnp.float32))
  # 3 decode steps per device call: 7 new tokens = the prefill's sample + 3 decode calls
  engine = Engine(model, max_length=PAD, max_batch=2, prefill_chunk=16, decode_steps=3)
  return cfg, engine, forward


def test_each_draw_uses_the_documented_key(setup):
  cfg, engine, forward = setup
  draw = jax.jit(jax.vmap(jax.random.categorical))  # one draw per (key, logits row)
  rng = np.random.default_rng(SEED)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11, 3)]  # 3 > max_batch
  T = 1.3
  sp = SamplingParams(temperature=T)
  seed = int(rng.integers(0, 2**31))
  seeds = [int(s) for s in rng.integers(0, 2**31, len(prompts))]
  for call_seed, key_of in ((seed, lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i)),
                            (seeds, lambda i: jax.random.PRNGKey(seeds[i]))):
    outs = engine.generate(prompts, max_new_tokens=7, sampling=sp, seed=call_seed)
    history = np.zeros((len(prompts), PAD), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
      assert len(o.tokens) == 7
      history[i, :len(p) + 7] = p + o.tokens
    logits = np.asarray(forward(jnp.asarray(history)))
    for i, (p, o) in enumerate(zip(prompts, outs)):
      keys = jax.vmap(jax.random.fold_in, (None, 0))(key_of(i), jnp.arange(7))
      expect = draw(keys, jnp.asarray(logits[i, len(p) - 1:len(p) + 6]) / T)
      assert o.tokens == np.asarray(expect).tolist(), (i, o.tokens, expect)
    assert len({tuple(o.tokens) for o in outs}) == len(prompts)  # really sampled, per request


def test_a_stop_token_drawn_as_the_last_allowed_token_finishes_as_stop(setup):
  """GenerationOutput.finish_reason: "stop" when the row ended on a stop token, even when that
  token was also the max_new_tokens-th (the stop token is what ended it)."""
  cfg, engine, _ = setup
  rng = np.random.default_rng(SEED + 1)
  prompt = rng.integers(0, cfg.vocab_size, 6).tolist()
  greedy = SamplingParams(temperature=0.0)
  full = engine.generate([prompt], max_new_tokens=6, sampling=greedy)[0]
  for k in (0, 4):  # the prefill's sample, and a token of a decode call
    stop = full.tokens[k]
    first = full.tokens.index(stop)
    sp = SamplingParams(temperature=0.0, stop_tokens=(stop,))
    out = engine.generate([prompt], max_new_tokens=first + 1, sampling=sp)[0]
    assert out.tokens == full.tokens[:first + 1] and out.finish_reason == "stop", (k, out)
    out = engine.generate([prompt], max_new_tokens=first + 2, sampling=sp)[0]
    assert out.tokens == full.tokens[:first + 1] and out.finish_reason == "stop", (k, out)
  other = SamplingParams(temperature=0.0, stop_tokens=tuple(
      t for t in range(cfg.vocab_size) if t not in full.tokens)[:3])
  out = engine.generate([prompt], max_new_tokens=6, sampling=other)[0]
  assert out.tokens == full.tokens and out.finish_reason == "max_new_tokens"
