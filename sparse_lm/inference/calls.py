"""The engine's jitted device calls: a prefill piece, the decode loop, and the row moves of
multi-turn state (engine.py schedules them).

Each call exists in two forms:
  one device  module-level `jax.jit` functions (`one_device_calls`), the graph definition static;
  a mesh      `mesh_calls(...)`: the same functions jitted with explicit in / out shardings for
              a `jax.sharding.Mesh`: the weights as the model's logical-axis rules place them
              (`weight_shardings`), the caches by `cache.cache_shardings` (rows over the
              batch axes where the batch divides, KDA heads over tensor), the small per-row
              arrays replicated; the caches donated. The forward pass is traced under
              `sharding.use_mesh(mesh)` (the default rules: a prompt is never split over
              expert x context), so the model's sharding constraints and its expert-parallel
              MoE apply, and forward.py takes its mesh path (no fused Pallas kernels; routed
              experts read where they are stored, never gathered whole onto one device).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparse_lm import sharding as shd
from sparse_lm.inference import cache as cache_lib
from sparse_lm.inference.forward import DecoderStack, forward_cached
from sparse_lm.inference.sampling import sample
from sparse_lm.model.transformer import Transformer

# Kernels cast to the compute dtype once (the model casts them at every use anyway); norms,
# the router, gates' A_log / dt_bias, conv kernels and the embedding stay as trained.
_CAST = {"w_q", "w_k", "w_v", "w_g_down", "w_g_up", "w_beta", "w_og", "w_og_down", "w_og_up",
         "w_o", "w_dq", "w_uq", "w_dkv", "w_ukv", "w_gate", "w_up", "w_down", "expert_gate",
         "expert_up", "expert_down", "lm_head"}


def compute_weights(state, cfg):
  """The DecoderStack's state with the kernels in _CAST in the compute dtype (cfg.dtype)."""
  dt = jnp.dtype(cfg.dtype)
  if dt == jnp.dtype(cfg.param_dtype):
    return state

  def cast(path, x):
    names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    return x.astype(dt) if names & _CAST and jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree_util.tree_map_with_path(cast, state)


def own_weights(state):
  """The one-device engine's own copy of a DecoderStack state: new Variables holding the same
  (immutable) arrays, so a later update of the model's Variables does not reach the engine
  until `Engine.load_weights`, each committed to the weights' device as a plain single-device
  array (`new_cache` puts the zero caches there too). A trained state sits on a one-device
  mesh (NamedSharding), and fresh zeros are uncommitted: left so, the caches the first call
  returns would differ in layout from the ones it took, and the next call would compile anew."""
  single = jax.sharding.SingleDeviceSharding(weights_device(state))
  return jax.tree.map(lambda a: jax.device_put(a, single), state)


def weights_device(state):
  """The device of a one-device state's first array (the default device for an empty one)."""
  leaves = jax.tree.leaves(state)
  return next(iter(leaves[0].devices())) if leaves else jax.devices()[0]


def weight_shardings(state, mesh: jax.sharding.Mesh):
  """NamedShardings of a DecoderStack state on `mesh` by the one rules table
  (`sharding.state_shardings` under LOGICAL_AXIS_RULES: the training layout of each weight)."""
  return shd.state_shardings(state, mesh, shd.LOGICAL_AXIS_RULES)


def step_impl(graphdef, weights, cache, tokens, start, n_valid, req_keys, counts, mode,
              temperature, top_k, top_p, *, kv_block, mesh=None):
  """One prefill piece (T > 1) or decode step (T = 1) for all slots, then sampling."""
  with shd.use_mesh(mesh):
    stack = nnx.merge(graphdef, weights)
    logits, cache = forward_cached(stack, tokens, cache, start, n_valid, kv_block=kv_block)
  keys = jax.vmap(jax.random.fold_in)(req_keys, counts)
  tok, logp = sample(logits, keys, mode=mode, temperature=temperature, top_k=top_k,
                     top_p=top_p)
  return cache, tok, logp


def decode_impl(graphdef, weights, cache, tokens, lengths, active, req_keys, counts, max_new,
                max_length, stop_mask, exit_on_finish, mode, temperature, top_k, top_p, *,
                num_steps, mesh=None):
  """Up to num_steps decode steps for all slots in one device call (lax.while_loop).

  tokens [B] int32: each row's last token, not yet in its cache; lengths [B] int32; active [B]
  bool (rows that decode; the others ride along unchanged); counts [B] int32: tokens already
  generated per row (the fold_in index of the next draw); max_new, max_length: int32 scalars;
  stop_mask [vocab] bool; exit_on_finish: bool scalar, stop after the first step in which a
  row finishes. Returns (cache, new tokens [num_steps, B] and log-probs (row b's are the first
  counts_out[b] - counts[b] entries), counts_out [B], lengths_out [B]).
  """
  B = tokens.shape[0]

  def cond(carry):
    i, _, _, _, _, act, _, _, finished = carry
    return (i < num_steps) & jnp.any(act) & ~(exit_on_finish & finished)

  def body(carry):
    i, cache, tok, lengths, counts, act, out_tok, out_logp, finished = carry
    n_valid = act.astype(jnp.int32)
    with shd.use_mesh(mesh):
      stack = nnx.merge(graphdef, weights)
      logits, cache = forward_cached(stack, tok[:, None], cache, lengths, n_valid, kv_block=1)
    keys = jax.vmap(jax.random.fold_in)(req_keys, counts)
    new, logp = sample(logits, keys, mode=mode, temperature=temperature, top_k=top_k,
                       top_p=top_p)
    lengths, counts = lengths + n_valid, counts + n_valid
    done = act & (stop_mask[new] | (counts >= max_new) | (lengths >= max_length))
    return (i + 1, cache, jnp.where(act, new, tok), lengths, counts, act & ~done,
            out_tok.at[i].set(new), out_logp.at[i].set(logp), finished | jnp.any(done))

  init = (jnp.int32(0), cache, tokens, lengths, counts, active,
          jnp.zeros((num_steps, B), jnp.int32), jnp.zeros((num_steps, B), jnp.float32),
          jnp.bool_(False))
  _, cache, _, lengths, counts, _, out_tok, out_logp, _ = jax.lax.while_loop(cond, body, init)
  return cache, out_tok, out_logp, counts, lengths


def read_row(cache, slot):
  return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0), cache)


def write_row(cache, row, slot):
  return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=0),
                      cache, row)


def reset_row(cache, slot):
  """Zero a slot's KDA state and conv tails (its latent cache is unread beyond length 0)."""
  def zero(path, a):
    if any(getattr(k, "key", None) in ("conv", "S") for k in path):
      return jax.lax.dynamic_update_slice_in_dim(a, jnp.zeros((1,) + a.shape[1:], a.dtype),
                                                 slot, axis=0)
    return a
  return jax.tree_util.tree_map_with_path(zero, cache)


class Calls(NamedTuple):
  """step(weights, cache, ...) -> (cache, tok, logp); decode(weights, cache, ...) -> (cache,
  tokens, logps, counts, lengths); read_row(cache, slot); write_row(cache, row, slot);
  reset_row(cache, slot); place_row(row): a DecodeState's cache onto this engine's devices."""
  step: object
  decode: object
  read_row: object
  write_row: object
  reset_row: object
  place_row: object


def one_device_calls(graphdef, *, kv_block: int, num_steps: int) -> Calls:
  """The one-device calls (module-level jits: shared by every engine of the process)."""
  return Calls(functools.partial(_STEP, graphdef, kv_block=kv_block),
               functools.partial(_DECODE, graphdef, num_steps=num_steps),
               _READ_ROW, _WRITE_ROW, _RESET_ROW, lambda row: row)


_STEP = jax.jit(step_impl, static_argnames=("graphdef", "kv_block", "mesh"), donate_argnums=(2,))
_DECODE = jax.jit(decode_impl, static_argnames=("graphdef", "num_steps", "mesh"),
                  donate_argnums=(2,))
_READ_ROW = jax.jit(read_row)
_WRITE_ROW = jax.jit(write_row, donate_argnums=(0,))
_RESET_ROW = jax.jit(reset_row, donate_argnums=(0,))
# The mesh calls of the most recently used engine configurations, least recent first. Bounded:
# each entry holds a graph definition and (once run) its compiled programs, and a process that
# builds engines of changing models or shapes (an RL loop, a notebook) would otherwise keep every
# one for its whole life. A configuration evicted and asked for again is jitted and compiled anew.
MESH_CALLS_MAXSIZE = 8
_MESH_CALLS: collections.OrderedDict = collections.OrderedDict()


class _Compiled:
  """A jitted call compiled ahead of time on first use, per shape of its small arguments (the
  weights' and caches' are fixed per engine); the executables stay in `compiled`, so the
  programs the engine runs can be inspected (`compiled[shapes].as_text()`: the tests read
  their collectives and array shapes)."""

  def __init__(self, jitted):
    self.jitted, self.compiled = jitted, {}

  def __call__(self, *args):
    key = tuple(np.shape(a) for a in args[2:])
    if key not in self.compiled:
      self.compiled[key] = self.jitted.lower(*args).compile()
    return self.compiled[key](*args)

  def lower(self, *args):
    return self.jitted.lower(*args)


def mesh_calls(graphdef, mesh: jax.sharding.Mesh, w_sh, cfg, *, batch: int, cache_length: int,
               kv_block: int, num_steps: int) -> Calls:
  """The calls jitted for `mesh` with explicit shardings (see the module docstring).

  w_sh: the weights' shardings (`weight_shardings`); cfg, batch, cache_length: the cache's
  shape. Cached per (graphdef, mesh, batch, cache_length, kv_block, num_steps), which fix
  every sharding, so a second engine of the same model on the same mesh compiles nothing; the
  cache keeps the MESH_CALLS_MAXSIZE most recently used configurations (least recently used
  dropped first).
  """
  key = (graphdef, mesh, batch, cache_length, kv_block, num_steps)
  calls = _MESH_CALLS.get(key)
  if calls is None:
    calls = _build_mesh_calls(graphdef, mesh, w_sh, cfg, batch=batch,
                              cache_length=cache_length, kv_block=kv_block, num_steps=num_steps)
  _MESH_CALLS[key] = calls
  _MESH_CALLS.move_to_end(key)
  while len(_MESH_CALLS) > MESH_CALLS_MAXSIZE:
    _MESH_CALLS.popitem(last=False)
  return calls


def _build_mesh_calls(graphdef, mesh, w_sh, cfg, *, batch, cache_length, kv_block,
                      num_steps) -> Calls:
  """mesh_calls' jitted calls for one configuration (uncached)."""
  rep = NamedSharding(mesh, P())
  c_sh = cache_lib.cache_shardings(abstract_cache(cfg, batch, cache_length), mesh)
  row_sh = cache_lib.cache_shardings(abstract_cache(cfg, 1, cache_length), mesh)
  step = jax.jit(functools.partial(step_impl, graphdef, kv_block=kv_block, mesh=mesh),
                 in_shardings=(w_sh, c_sh) + (rep,) * 9, out_shardings=(c_sh, rep, rep),
                 donate_argnums=(1,))
  decode = jax.jit(functools.partial(decode_impl, graphdef, num_steps=num_steps, mesh=mesh),
                   in_shardings=(w_sh, c_sh) + (rep,) * 13,
                   out_shardings=(c_sh, rep, rep, rep, rep), donate_argnums=(1,))
  calls = Calls(
      _Compiled(step), _Compiled(decode),
      jax.jit(read_row, in_shardings=(c_sh, rep), out_shardings=row_sh),
      jax.jit(write_row, in_shardings=(c_sh, row_sh, rep), out_shardings=c_sh,
              donate_argnums=(0,)),
      jax.jit(reset_row, in_shardings=(c_sh, rep), out_shardings=c_sh, donate_argnums=(0,)),
      lambda row: jax.device_put(row, row_sh))
  return calls


def abstract_cache(cfg, batch: int, length: int):
  """init_cache's tree as ShapeDtypeStructs (nothing allocated)."""
  return jax.eval_shape(lambda: cache_lib.init_cache(cfg, batch, length))


def new_cache(cfg, batch: int, length: int, mesh: jax.sharding.Mesh | None, device=None):
  """Zero caches, made in place on `mesh` (sharded; never whole on one device) or committed
  to `device` (default: the default device), as the calls' outputs are."""
  if mesh is None:
    single = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    return jax.device_put(cache_lib.init_cache(cfg, batch, length), single)
  c_sh = cache_lib.cache_shardings(abstract_cache(cfg, batch, length), mesh)
  return jax.jit(lambda: cache_lib.init_cache(cfg, batch, length), out_shardings=c_sh)()


def lower_calls(cfg, mesh: jax.sharding.Mesh, *, batch: int, cache_length: int,
                prefill_chunk: int, kv_block: int, decode_steps: int) -> dict:
  """The engine's prefill piece and decode call for `cfg` on `mesh`, lowered from abstract
  weights and caches (nothing allocated: `nnx.eval_shape`), as `Engine(model, mesh=mesh,
  max_batch=batch, ...)` would run them with max_length = cache_length. For compile-only
  memory plans (`launch.aot_plan --steps sample_prefill,sample_decode`) and the tests.

  Returns {"prefill": Lowered, "decode": Lowered}: a [batch, prefill_chunk] piece appended to
  caches of cache_length positions, and decode_steps decode steps of every row.
  """
  stack = nnx.eval_shape(lambda: DecoderStack(Transformer(cfg, rngs=nnx.Rngs(0))))
  graphdef, state = nnx.split(stack)
  w_sh = weight_shardings(state, mesh)
  weights = jax.eval_shape(functools.partial(compute_weights, cfg=cfg), state)
  calls = mesh_calls(graphdef, mesh, w_sh, cfg, batch=batch, cache_length=cache_length,
                     kv_block=kv_block, num_steps=decode_steps)
  cache = abstract_cache(cfg, batch, cache_length)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = jax.ShapeDtypeStruct((), jnp.float32)
  keys = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
  knobs = (i32(), f32, i32(), f32)
  prefill = calls.step.lower(weights, cache, i32(batch, prefill_chunk), i32(batch), i32(batch),
                             keys, i32(batch), *knobs)
  decode = calls.decode.lower(weights, cache, i32(batch), i32(batch),
                              jax.ShapeDtypeStruct((batch,), jnp.bool_), keys, i32(batch),
                              i32(), i32(), jax.ShapeDtypeStruct((cfg.vocab_size,), jnp.bool_),
                              jax.ShapeDtypeStruct((), jnp.bool_), *knobs)
  return {"prefill": prefill, "decode": decode}
