"""The decode step's MoE (inference/forward.py) against the model's LatentMoE and the dense
reference: gathered experts for a small batch, every expert on every token for a large one,
padding rows routed nowhere. fp32, fresh random inputs and balancing biases."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.inference.forward import gathered_experts, moe_decode
from sparse_lm.moe import LatentMoE
from sparse_lm.moe.latent_moe import dense_reference

SEED = 3


def test_gathered_experts_equal_the_dense_reference():
  print(f"seed {SEED}")
  E, L, F, N, k = 6, 16, 24, 5, 2
  keys = jax.random.split(jax.random.key(SEED), 6)
  params = {"w_gate": jax.random.normal(keys[0], (E, L, F)),
            "w_up": jax.random.normal(keys[1], (E, L, F)),
            "w_down": jax.random.normal(keys[2], (E, F, L)) / 5}
  z = jax.random.normal(keys[3], (N, L))
  ids = jax.random.randint(keys[4], (N, k), 0, E + 1)  # E: the sentinel (no expert)
  ids = ids.at[0].set(E)  # a row with no expert at all
  gates = jax.random.uniform(keys[5], (N, k))
  want = dense_reference(z, ids, gates, params, beta1=4.0, beta2=25.0)
  for min_rows in (0, 2):  # 2: each assignment's row padded with a zero row (pad_rows)
    got = gathered_experts(z, ids, gates, params, beta1=4.0, beta2=25.0, min_rows=min_rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(got[0]))) == 0.0


def test_moe_decode_equals_the_models_moe():
  """Batches of 1 (projections on zero-padded rows), 2 (N k = 4 <= 8 experts: gathered) and
  6 (12 > 8: dense), padding rows included, against LatentMoE.__call__ (sorted grouped
  matmuls) at inference."""
  print(f"seed {SEED}")
  cfg = get_preset("tiny", dtype="float32", num_experts=8, experts_per_token=2)
  moe = LatentMoE(cfg, rngs=nnx.Rngs(SEED))
  moe.balancer_bias[...] = 0.1 * jax.random.normal(jax.random.key(SEED + 1), (8,))
  for B in (1, 2, 6):
    x = jax.random.normal(jax.random.key(SEED + B), (B, 1, cfg.d_model))
    valid = jnp.arange(B)[:, None] != 1  # row 1 is padding
    want, _ = nnx.jit(lambda m, x, v: m(x, valid=v, train=False))(moe, x, valid)
    got = nnx.jit(moe_decode)(moe, x, valid)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
