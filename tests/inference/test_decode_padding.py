"""A batch-1 decode step with its projections on zero-padded rows (forward.pad_rows, the GPU
fast path) against the same step without padding (DECODE_MIN_ROWS = 0), and the same step
through the fused Pallas kernels (decode_backend="pallas": interpret mode on CPU, compiled on a
GPU; sparse_lm/inference/fused.py, with the KDA and MoE input projections prebuilt as one matrix
per layer, as the engine holds them) against the padded one, from a random cache: random conv
tails, KDA states and latent cache entries (never zeros). tiny preset, fp32, random weights.
The unpadded step is itself checked against the full forward pass in test_engine.py; each
kernel alone in test_fused_decode.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.inference import cache as cache_lib, forward as forward_lib, fused
from sparse_lm.model import Transformer

SEED = 5


@pytest.mark.parametrize("gate_up", [False, True], ids=["gate_up_gemm", "gate_up_in_kernel"])
def test_padded_and_fused_decode_steps_equal_unpadded(gate_up, monkeypatch):
  print(f"seed {SEED} gate_up {gate_up}")
  monkeypatch.setitem(fused.FUSE, "gate_up", gate_up)
  # KDA + dense FFN; MLA + MoE, committing AttnRes block 1; the last MLA + MoE
  cfg = get_preset("tiny", num_layers=3, mla_every=2, attnres_block_layers=2)
  model = Transformer(cfg, rngs=nnx.Rngs(SEED))
  stack = forward_lib.DecoderStack(model)
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

  def step(graphdef, state):  # a new function each time: traced anew
    return jax.jit(lambda s, c: forward_lib.forward_cached(
        nnx.merge(graphdef, s), tokens, c, start, n_valid, kv_block=1))(state, cache)

  outs = {}
  for rows in (2, 0):
    monkeypatch.setattr(forward_lib, "DECODE_MIN_ROWS", rows)
    outs[rows] = step(graphdef, state)
  monkeypatch.setattr(forward_lib, "DECODE_MIN_ROWS", 2)
  model.cfg = dataclasses.replace(cfg, decode_backend="pallas")
  assert fused.decode_kernels(model.cfg)[0]
  # the engine's stack: each KDA and MLA layer's input projections prebuilt as one matrix
  pallas_stack = forward_lib.DecoderStack(model, input_matrices=True)
  assert list(pallas_stack.kda_inputs.keys()) == ["0"]  # layer 0 is the one KDA layer
  assert list(pallas_stack.moe_inputs.keys()) == ["1", "2"]  # the MoE layers (latent, shared)
  assert list(pallas_stack.moe_outputs.keys()) == ["1", "2"]
  assert list(pallas_stack.mla_inputs.keys()) == ["1", "2"]  # the MLA layers' one input GEMM
  outs["pallas"] = step(*nnx.split(pallas_stack))
  ref_logits = outs[0][0]
  assert float(jnp.std(ref_logits)) > 1e-2
  for got_from, want_from in ((2, 0), ("pallas", 2)):
    (logits, new_cache), (want_logits, want_cache) = outs[got_from], outs[want_from]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5,
                               atol=1e-5)
    for got, want in zip(jax.tree.leaves(new_cache), jax.tree.leaves(want_cache)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
