"""`sparse_lm.train.precompile`: a program compiled on a host thread from abstract arguments is
not compiled again by the later call, and the abstract batch the loop compiles for is exactly
the pipeline's batch (shape, dtype, sharding), or the call would miss the cache."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sparse_lm import data as data_lib
from sparse_lm import sharding as shd
from sparse_lm.train import loop
from sparse_lm.train.builder import batch_shapes, build
from sparse_lm.train.precompile import Precompiler, abstract_batch
from tests.train.conftest import small_stage

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _count_compiles():
  events = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: events.append(name) if name == _BACKEND_COMPILE else None)
  return events


def test_program_compiled_on_a_thread_is_not_compiled_again():
  seed = 3
  print("seed", seed)
  sh = NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("x",)), P())
  fn = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(axis=0), in_shardings=(sh, sh),
               out_shardings=sh)
  spec = jax.ShapeDtypeStruct((48, 40), jnp.float32, sharding=sh)
  spec_b = jax.ShapeDtypeStruct((40, 24), jnp.float32, sharding=sh)
  pre = Precompiler(True)
  pre.compile("fn", fn, spec, spec_b)
  pre.wait("fn")
  rng = np.random.default_rng(seed)
  a = jax.device_put(rng.standard_normal((48, 40), np.float32), sh)
  b = jax.device_put(rng.standard_normal((40, 24), np.float32), sh)
  events = _count_compiles()
  out = fn(a, b)
  assert events == [], events  # the call found the thread's executable
  np.testing.assert_allclose(np.asarray(out), np.tanh(np.asarray(a) @ np.asarray(b)).sum(0),
                             rtol=1e-5, atol=1e-5)
  pre.close()


def test_program_with_compiler_options_is_not_compiled_again():
  """The stage's `gpu_autotune=False` reaches XLA as the jit's `compiler_options`: a step
  precompiled with them is found by the later call (the options are part of the program)."""
  sh = NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("x",)), P())
  fn = jax.jit(lambda a: jnp.sin(a) @ a.T, in_shardings=(sh,), out_shardings=sh,
               compiler_options={"xla_gpu_autotune_level": 0})
  pre = Precompiler(True)
  pre.compile("fn", fn, jax.ShapeDtypeStruct((24, 16), jnp.float32, sharding=sh))
  pre.wait("fn")
  a = jax.device_put(np.random.default_rng(5).standard_normal((24, 16), np.float32), sh)
  events = _count_compiles()
  out = fn(a)
  assert events == [], events
  np.testing.assert_allclose(np.asarray(out), np.sin(np.asarray(a)) @ np.asarray(a).T,
                             rtol=1e-5, atol=1e-5)
  pre.close()


def test_compiler_options_only_on_gpus_and_only_when_asked():
  import dataclasses
  import types
  from sparse_lm.train import builder
  stage = small_stage()
  mesh_on = lambda platform: types.SimpleNamespace(
      devices=np.array([types.SimpleNamespace(platform=platform)]))
  gpu, cpu = mesh_on("gpu"), mesh_on("cpu")
  on, off = (dataclasses.replace(stage, gpu_autotune=x) for x in (True, False))
  assert builder.compiler_options(on, gpu) is None
  assert builder.compiler_options(off, gpu) == {"xla_gpu_autotune_level": 0}
  assert builder.compiler_options(off, cpu) is None


def test_abstract_batch_is_the_pipelines_batch(tokenizer_json):
  stage = small_stage()
  tokenizer = data_lib.load_or_train_tokenizer(stage.data, str(tokenizer_json.parent), 512)
  mesh = shd.make_mesh(stage.mesh)
  parts = build(stage, mesh)
  it = data_lib.make_train_iterator(stage.data, tokenizer, seq_len=stage.seq_len,
                                    batch_size=stage.global_batch, process_index=0,
                                    process_count=1)
  real = loop._put(next(it), parts.batch_shardings, stage.global_batch)
  abstract = abstract_batch(batch_shapes(stage, stage.global_batch, stage.seq_len),
                            parts.batch_shardings)
  assert sorted(real) == sorted(abstract)
  for k, v in real.items():
    assert (v.shape, v.dtype, v.sharding) == (abstract[k].shape, abstract[k].dtype,
                                              abstract[k].sharding), k


def test_disabled_precompiler_runs_nothing():
  pre = Precompiler(False)
  ran = []
  pre.submit("x", lambda: ran.append(1))
  pre.wait("x")
  pre.close()
  assert ran == []
