"""Decode caches: their size, and that a layer never writes past one (issue 12 item 4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.inference import Engine, cache_bytes
from sparse_lm.model import Transformer
from sparse_lm.model.mla import MLA

CFG = get_preset("tiny")


def test_mla_decode_refuses_to_write_past_its_cache():
  layer = MLA(CFG, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, 20, CFG.d_model))
  cache = layer.init_cache(1, max_length=16)
  for t in range(16):
    _, cache = layer.decode(x[:, t:t + 1], cache)
  with pytest.raises(ValueError, match=r"position 16.*max_length=16"):
    layer.decode(x[:, 16:17], cache)
  with pytest.raises(ValueError, match="max_length=16"):
    layer.decode(x, layer.init_cache(1, max_length=16))
  # Under jit the length is traced: the overflowing call returns NaN, never a clamped write.
  graphdef, state = nnx.split(layer)
  step = jax.jit(lambda st, x, c: nnx.merge(graphdef, st).decode(x, c))
  y, _ = step(state, x[:, 16:17], cache)
  assert bool(jnp.all(jnp.isnan(y)))
  y, _ = step(state, x[:, 15:16], cache._replace(length=jnp.int32(15)))
  assert bool(jnp.all(jnp.isfinite(y)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_bytes_is_what_the_engine_allocates(dtype):
  cfg = get_preset("tiny", dtype=dtype)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  engine = Engine(model, max_length=128, max_batch=3, kv_block=64)
  assert engine.cache_bytes() == cache_bytes(cfg, 128, batch=3)
  # By hand: 6 KDA layers of 3 x (2*2*32 + 2*32) conv values and 2*32*32 fp32 state; 3 MLA
  # layers of 128 x (16 + 8) latent values.
  item = np.dtype(jnp.dtype(dtype)).itemsize
  kda = 3 * (2 * 64 + 64) * item + 2 * 32 * 32 * 4
  assert cache_bytes(cfg, 128, batch=3) == 3 * (6 * kda + 3 * 128 * 24 * item)
  assert cache_bytes(cfg, 128, mla_everywhere=True) == 9 * 128 * 24 * item


def test_cache_bytes_refuses_bad_arguments_by_name():
  """A negative length gave positive bytes, a negative batch negative bytes, a float length a
  float, a preset name an AttributeError."""
  cfg = get_preset("tiny")
  assert cache_bytes(cfg, 0) > 0 and cache_bytes(cfg, 64, 2) == 2 * cache_bytes(cfg, 64)
  for args, field in (((cfg, -5), "length=-5"), ((cfg, 1024, -2), "batch=-2"),
                      ((cfg, 10.5), "length=10.5"), ((cfg, 8, 0), "batch=0")):
    with pytest.raises(ValueError, match=f"cache_bytes: {field} must be an int"):
      cache_bytes(*args)
  with pytest.raises(TypeError, match=r"cfg must be a ModelConfig.*get_preset\(name\)"):
    cache_bytes("tiny", 1024)
