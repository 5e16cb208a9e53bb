"""A batch-1 decode step with its projections on zero-padded rows (forward.pad_rows, the GPU
fast path) against the same step without padding (DECODE_MIN_ROWS = 0), from a random cache:
random conv tails, KDA states and latent cache entries (never zeros). tiny preset, fp32, random
weights. The unpadded step is itself checked against the full forward pass in test_engine.py."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.inference import cache as cache_lib, forward as forward_lib
from sparse_lm.model import Transformer

SEED = 5


def test_padded_decode_step_equals_unpadded(monkeypatch):
  print(f"seed {SEED}")
  cfg = get_preset("tiny", num_layers=3, mla_every=2)  # KDA + dense FFN; MLA + MoE; last MLA
  stack = forward_lib.DecoderStack(Transformer(cfg, rngs=nnx.Rngs(SEED)))
  graphdef, state = nnx.split(stack)
  length = 32
  cache = cache_lib.init_cache(cfg, 1, length)
  leaves, treedef = jax.tree.flatten(cache)
  keys = jax.random.split(jax.random.key(SEED), len(leaves))
  cache = jax.tree.unflatten(treedef, [
      (0.5 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
      for k, a in zip(keys, leaves)])
  tokens = jnp.array([[7]], jnp.int32)
  start, n_valid = jnp.array([20], jnp.int32), jnp.array([1], jnp.int32)

  def step(state, cache):
    return forward_lib.forward_cached(nnx.merge(graphdef, state), tokens, cache, start,
                                      n_valid, kv_block=1)

  outs = {}
  for rows in (2, 0):
    monkeypatch.setattr(forward_lib, "DECODE_MIN_ROWS", rows)
    outs[rows] = jax.jit(step)(state, cache)
  (logits, new_cache), (ref_logits, ref_cache) = outs[2], outs[0]
  assert float(jnp.std(ref_logits)) > 1e-2
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(new_cache), jax.tree.leaves(ref_cache)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
