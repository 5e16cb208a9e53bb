"""The inference engine: chunked prefill, cached decode, continuous batching, multi-turn state.

    from sparse_lm.inference import Engine, SamplingParams
    engine = Engine(model, max_length=4096, max_batch=8)
    outs = engine.generate(prompts, max_new_tokens=32, sampling=SamplingParams(temperature=0.0),
                           seed=0)
    outs[i].tokens, outs[i].logprobs, outs[i].state
    more = engine.generate([next_turn_ids], max_new_tokens=32, states=[outs[0].state])

The engine owns a fixed batch of `max_batch` slots, each a row of every layer's cache
(cache.py). A request takes a free slot, is prefilled in pieces of `prefill_chunk` tokens (all
prefilling slots together, one jitted call per piece), then decodes together with every other
decoding slot: one jitted call runs up to `decode_steps` decode steps on the device (a
`lax.while_loop`; caches donated and updated in place; sampling, stop tokens, max_new_tokens
and the cache limit checked on the device) and returns the new tokens and log-probs in one
transfer. The loop ends early when every row has finished, or, while requests wait for a
slot, when any row finishes (so its slot is refilled at once). Both calls have fixed shapes
([max_batch, prefill_chunk] and [max_batch] x decode_steps), so refilling slots never
recompiles. Each row keeps its own length: no shared position, no left padding.

On a mesh (`Engine(..., mesh=mesh)` or an active `sparse_lm.sharding.use_mesh`) the weights
stay sharded as in training, the caches are sharded and both calls are jitted with in / out
shardings (calls.py; docs/inference.md, "On a mesh").

Randomness: request i of a call with an int `seed` draws its n-th token with
fold_in(fold_in(PRNGKey(seed), i), n) (with a list of seeds, fold_in(PRNGKey(seed[i]), n)), so
results do not depend on which slot or which other requests it ran with.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm import sharding as shd
from sparse_lm.inference import cache as cache_lib
from sparse_lm.inference import calls as calls_lib
from sparse_lm.inference import fused
from sparse_lm.inference.forward import DecoderStack
from sparse_lm.inference.sampling import SamplingParams

# The one-device jitted calls (tests and benchmarks count their compiled programs).
_step, _decode = calls_lib._STEP, calls_lib._DECODE


def _weights(graphdef, state, cfg):
  """The stack's state with its kernels in the compute dtype (`calls.compute_weights`)."""
  del graphdef
  return calls_lib.compute_weights(state, cfg)


@dataclasses.dataclass(frozen=True)
class DecodeState:
  """What continues a conversation: one row of every layer's cache (device arrays, batch 1),
  the number of tokens in it, and the history tokens not yet in it (the last generated token,
  which no forward pass has read yet). History = the prompts and completions so far."""
  cache: list
  length: int
  pending: tuple[int, ...]
  signature: tuple

  @property
  def history_length(self) -> int:
    return self.length + len(self.pending)


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
  """One request's result.

  tokens: the new token ids (a stop token included). logprobs: log p(token | history) under
  the model (log_softmax of the logits at temperature 1, untruncated: what the trainer computes).
  state: DecodeState after prompt + tokens. finish_reason: "stop" (a stop token),
  "max_new_tokens", or "max_length" (the engine's cache is full).
  """
  tokens: list[int]
  logprobs: list[float]
  state: DecodeState
  finish_reason: str


def _device_bytes(device) -> int | None:
  """Memory of one device in bytes: the accelerator's allocator limit, or the host's physical
  memory for a CPU device; None where neither is known."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if device.platform == "cpu":
    try:
      return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
  return None


def _check_cache_fits(cfg, cache_length: int, max_batch: int, mesh) -> None:
  """Raise ValueError, naming max_length and max_batch, when the decode caches alone exceed
  the memory of the devices they go on (before anything is allocated or compiled)."""
  devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
  # A device of this process: memory_stats() of another process's device raises (a
  # multi-process mesh); the mesh's devices are alike.
  local = [d for d in devices if d.process_index == jax.process_index()]
  limit = _device_bytes(local[0]) if local else None
  if limit is None:
    return
  need = cache_lib.cache_bytes(cfg, cache_length, max_batch)
  if need > limit * len(devices):
    raise ValueError(
        f"Engine: the decode caches of max_length={cache_length} x max_batch={max_batch} take "
        f"{need / 2**30:.1f} GiB (cache_bytes), more than the {limit * len(devices) / 2**30:.1f}"
        f" GiB of {len(devices)} {devices[0].platform} device(s); lower max_length or "
        "max_batch")


class Engine:
  """Batched generation from a `sparse_lm.model.Transformer` (see the module docstring).

  Args:
    model: the Transformer (its current weights are copied in: see `load_weights`).
    max_length: tokens of history (prompts + generated) one row can hold.
    max_batch: slots decoded together.
    prefill_chunk: tokens per row per prefill call (bounds prefill memory).
    kv_block: key block of the prefill's latent attention (default cfg.attention_chunk_size).
    decode_steps: the most decode steps one device call runs (tokens per host round trip).
    mesh: a `jax.sharding.Mesh` to run on (default: the active `sparse_lm.sharding.use_mesh`
      mesh, if any). With more than one device the weights are placed as the model's logical
      axis rules say (as in training), the caches sharded (`cache.cache_shardings`) and the
      calls jitted with those in / out shardings (calls.py); one device: the plain path.

  Raises:
    ValueError: a size argument that is not a positive int (names it); caches larger than the
      device memory (names max_length and max_batch).
  """

  def __init__(self, model, *, max_length: int = 4096, max_batch: int = 8,
               prefill_chunk: int = 512, kv_block: int | None = None, decode_steps: int = 64,
               mesh: jax.sharding.Mesh | None = None):
    for name, v in (("max_length", max_length), ("max_batch", max_batch),
                    ("prefill_chunk", prefill_chunk), ("kv_block", 1 if kv_block is None
                                                       else kv_block),
                    ("decode_steps", decode_steps)):
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"Engine: {name}={v!r} must be a positive int"
                         + (" (or None: the model's attention_chunk_size)"
                            if name == "kv_block" else ""))
    self.cfg = model.cfg
    self.max_length = int(max_length)
    self.max_batch = int(max_batch)
    self.kv_block = int(kv_block or self.cfg.attention_chunk_size)
    self.cache_length = cache_lib.padded_length(self.max_length, self.kv_block)
    self.prefill_chunk = int(min(prefill_chunk, self.cache_length))
    self.decode_steps = int(decode_steps)
    self.signature = (self.cfg, self.cache_length)
    mesh = shd.current_mesh() if mesh is None else mesh
    self.mesh = mesh if mesh is not None and mesh.size > 1 else None
    _check_cache_fits(self.cfg, self.cache_length, self.max_batch, self.mesh)
    self._w_sh = None
    self.load_weights(model)
    self._cache = calls_lib.new_cache(
        self.cfg, self.max_batch, self.cache_length, self.mesh,
        None if self.mesh is not None else calls_lib.weights_device(self._weights))

  def load_weights(self, model) -> None:
    """Take `model`'s current weights (e.g. after a training step); no recompile.

    Raises:
      ValueError: `model` has another config than the engine's.
    """
    if model.cfg != self.cfg:
      diff = [f.name for f in dataclasses.fields(self.cfg)
              if getattr(model.cfg, f.name) != getattr(self.cfg, f.name)]
      raise ValueError(f"Engine.load_weights: model config differs from the engine's in {diff} "
                       f"(model preset {model.cfg.name!r}, engine {self.cfg.name!r}); build a "
                       "new Engine for another model")
    matrices = self.mesh is None and fused.decode_kernels(self.cfg)[0]
    graphdef, state = nnx.split(DecoderStack(model, input_matrices=matrices))
    self._graphdef = graphdef
    if self.mesh is None:
      self._weights = calls_lib.compute_weights(calls_lib.own_weights(state), self.cfg)
      self._calls = calls_lib.one_device_calls(graphdef, kv_block=self.kv_block,
                                               num_steps=self.decode_steps)
      return
    if self._w_sh is None:
      self._w_sh = calls_lib.weight_shardings(state, self.mesh)
      self._calls = calls_lib.mesh_calls(
          graphdef, self.mesh, self._w_sh, self.cfg, batch=self.max_batch,
          cache_length=self.cache_length, kv_block=self.kv_block, num_steps=self.decode_steps)
      self._cast = (None if self.cfg.dtype == self.cfg.param_dtype else jax.jit(
          functools.partial(calls_lib.compute_weights, cfg=self.cfg), out_shardings=self._w_sh))
    # device_put: no copy where the model is already laid out so (a trained state)
    state = jax.device_put(state, self._w_sh)
    self._weights = state if self._cast is None else self._cast(state)

  def step(self, tokens, lengths, n_valid, sampling: SamplingParams | None = None, seed=0):
    """Low level, for benchmarks and custom schedulers: one jitted call on all slots.

    tokens [max_batch, prefill_chunk] (a prefill piece) or [max_batch, 1] (a decode step)
    int32; lengths [max_batch] int32, tokens already in each slot's cache; n_valid
    [max_batch] int32, real tokens per row. Appends them to the caches (no checks) and returns
    (next tokens [max_batch], their log-probs) as device arrays.
    """
    sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
    keys = jax.random.split(jax.random.PRNGKey(seed), self.max_batch)
    self._cache, tok, logp = self._calls.step(
        self._weights, self._cache, jnp.asarray(tokens, jnp.int32),
        jnp.asarray(lengths, jnp.int32), jnp.asarray(n_valid, jnp.int32), keys,
        jnp.zeros((self.max_batch,), jnp.int32), *self._knobs(sampling))
    return tok, logp

  def decode(self, tokens, lengths, sampling: SamplingParams | None = None, seed=0):
    """Low level, for benchmarks: `decode_steps` decode steps of every slot in one device
    call, no stop tokens. tokens [max_batch] int32 (the last token of each row, not yet in
    its cache); lengths [max_batch] int32 (tokens in each row's cache; lengths +
    decode_steps <= cache length). Returns the new tokens [decode_steps, max_batch] and their
    log-probs as device arrays."""
    sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
    B = self.max_batch
    keys = jax.random.split(jax.random.PRNGKey(seed), B)
    self._cache, tok, logp, _, _ = self._calls.decode(
        self._weights, self._cache, jnp.asarray(tokens, jnp.int32),
        jnp.asarray(lengths, jnp.int32), jnp.ones((B,), bool), keys, jnp.zeros((B,), jnp.int32),
        np.int32(2**30), np.int32(self.cache_length), jnp.zeros((self.cfg.vocab_size,), bool),
        np.bool_(False), *self._knobs(sampling))
    return tok, logp

  def _knobs(self, sampling: SamplingParams) -> tuple:
    """The sampling parameters as the traced scalars the jitted calls take (mode,
    temperature, top_k, top_p)."""
    return (np.int32(sampling.mode), np.float32(max(sampling.temperature, 1e-6)),
            np.int32(sampling.top_k), np.float32(sampling.top_p))

  def cache_bytes(self) -> int:
    """Bytes of the engine's allocated caches (all slots)."""
    return sum(a.nbytes for a in jax.tree.leaves(self._cache))

  # ------------------------------------------------------------------ validation
  def _check(self, prompts, max_new_tokens, sampling, seed, states):
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
      raise ValueError("prompts must be a list of token-id lists (list[list[int]]), got "
                       f"{type(prompts).__name__}; encode text with the tokenizer first")
    if not prompts:
      raise ValueError("prompts is empty: give at least one prompt")
    if (not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool)
        or not 1 <= max_new_tokens < 2**31):
      raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int in [1, 2**31)")
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if isinstance(seed, (Sequence, np.ndarray)):
      if len(seed) != len(prompts) or not all(
          isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in seed):
        raise ValueError(f"seed: a list of seeds needs one int per prompt ({len(prompts)}), "
                         f"got {seed!r}")
    elif (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
          or not -2**63 <= seed < 2**63):
      raise ValueError(f"seed={seed!r} must be a 64-bit int or one int per prompt")
    if states is not None and len(states) != len(prompts):
      raise ValueError(f"states has {len(states)} entries for {len(prompts)} prompts: give one "
                       "per prompt (None for a fresh conversation)")
    vocab = self.cfg.vocab_size
    for t in sampling.stop_tokens:
      if not 0 <= t < vocab:
        raise ValueError(f"sampling.stop_tokens holds {t}, outside the vocabulary [0, {vocab})")
    feeds = []
    for i, p in enumerate(prompts):
      if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)):
        raise ValueError(f"prompts[{i}] must be a list of token ids, got {type(p).__name__}")
      ids = np.asarray(p, np.int64).reshape(-1) if len(p) else np.zeros((0,), np.int64)
      if len(p) and not np.issubdtype(np.asarray(p).dtype, np.integer):
        raise ValueError(f"prompts[{i}] must hold integer token ids")
      bad = ids[(ids < 0) | (ids >= vocab)]
      if bad.size:
        raise ValueError(f"prompts[{i}] holds token id {int(bad[0])}, outside the vocabulary "
                         f"[0, {vocab}) of model {self.cfg.name!r}")
      state = None if states is None else states[i]
      if state is not None:
        if not isinstance(state, DecodeState):
          raise ValueError(f"states[{i}] must be a DecodeState (an output's .state) or None")
        if state.signature != self.signature:
          raise ValueError(f"states[{i}] was made by an engine with another model or cache "
                           "length; continue it with that engine")
      prefix = 0 if state is None else state.length
      feed = ([] if state is None else list(state.pending)) + [int(t) for t in ids]
      if not feed:
        raise ValueError(f"prompts[{i}] is empty: give at least one token (e.g. the BOS id)")
      if prefix + len(feed) > self.max_length:
        raise ValueError(f"prompts[{i}]: {prefix + len(feed)} tokens of history (state + "
                         f"prompt) exceed the engine's max_length={self.max_length}; shorten "
                         "it or build the Engine with a larger max_length")
      feeds.append((feed, state))
    return feeds

  # ------------------------------------------------------------------ generation
  def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
               sampling: SamplingParams | None = None, seed: int | Sequence[int] = 0,
               states: Sequence[DecodeState | None] | None = None,
               stream: Callable[[int, list[int]], None] | None = None
               ) -> list[GenerationOutput]:
    """Continue each prompt (after its state, if given) by up to max_new_tokens tokens.

    Args:
      prompts: token ids per request (list[list[int]]); any number (slots are reused).
      max_new_tokens: tokens to generate per request (fewer on a stop token or a full cache).
      sampling: SamplingParams (default: temperature 1, no truncation).
      seed: an int, the randomness of the whole call (see the module docstring), or one int
        per prompt: request i then draws with PRNGKey(seed[i]), independent of the others.
      states: per request, a DecodeState from an earlier output (the conversation so far) or
        None. A state is not consumed: it can be continued several times.
      stream: called as stream(i, tokens_so_far) for each new token of request i, once the
        device call that made it returns (decode tokens arrive in bursts of up to
        decode_steps).

    Returns:
      One GenerationOutput per prompt, in order.

    Raises:
      ValueError (before anything is compiled or run): an empty prompt, a token id outside the
        vocabulary, history longer than max_length, a bad sampling / seed / max_new_tokens, or
        a state from an engine of another model config or cache length (a state is not
        tied to the weights: one from an engine of the same config continues here).
    """
    sampling = SamplingParams() if sampling is None else sampling
    feeds = self._check(prompts, max_new_tokens, sampling, seed, states)
    n, B, P = len(feeds), self.max_batch, self.prefill_chunk
    if isinstance(seed, (Sequence, np.ndarray)):  # each seed's low 32 bits, negatives too
      req_keys = np.asarray(jax.vmap(jax.random.PRNGKey)(
          jnp.asarray([int(x) % 2**32 for x in seed], jnp.uint32)))
    else:
      req_keys = np.asarray(jax.vmap(jax.random.fold_in, (None, 0))(
          jax.random.PRNGKey(seed), jnp.arange(n, dtype=jnp.uint32)))
    queue = collections.deque(range(n))
    slot_req = [-1] * B
    lengths = np.zeros(B, np.int32)
    fed = [0] * n
    gen = [[] for _ in range(n)]
    logps = [[] for _ in range(n)]
    results: list[GenerationOutput | None] = [None] * n
    stops = set(sampling.stop_tokens)
    stop_mask = np.zeros(self.cfg.vocab_size, bool)
    stop_mask[list(stops)] = True
    knobs = self._knobs(sampling)

    def finish(s, reason):
      r = slot_req[s]
      state = DecodeState(self._calls.read_row(self._cache, s), int(lengths[s]),
                          (gen[r][-1],), self.signature)
      results[r] = GenerationOutput(gen[r], logps[r], state, reason)
      slot_req[s] = -1

    def append(s, tok, logp):
      """Token tok (log-prob logp) of slot s's request; ends the request when it is done."""
      r = slot_req[s]
      gen[r].append(int(tok))
      logps[r].append(float(logp))
      if stream is not None:
        stream(r, gen[r])
      if gen[r][-1] in stops:
        finish(s, "stop")
      elif len(gen[r]) >= max_new_tokens:
        finish(s, "max_new_tokens")
      elif lengths[s] >= self.max_length:
        finish(s, "max_length")

    while queue or any(r >= 0 for r in slot_req):
      for s in range(B):
        if slot_req[s] < 0 and queue:
          r = queue.popleft()
          slot_req[s] = r
          state = feeds[r][1]
          if state is None:
            self._cache = self._calls.reset_row(self._cache, s)
            lengths[s] = 0
          else:
            self._cache = self._calls.write_row(self._cache,
                                                self._calls.place_row(state.cache), s)
            lengths[s] = state.length
      busy = [s for s in range(B) if slot_req[s] >= 0]
      keys = np.zeros((B,) + req_keys.shape[1:], req_keys.dtype)
      counts = np.zeros(B, np.int32)
      for s in busy:
        keys[s], counts[s] = req_keys[slot_req[s]], len(gen[slot_req[s]])
      prefilling = [s for s in busy if fed[slot_req[s]] < len(feeds[slot_req[s]][0])]
      if not prefilling:  # every busy slot decodes: many steps in one device call
        tokens = np.zeros(B, np.int32)
        for s in busy:
          tokens[s] = gen[slot_req[s]][-1]
        self._cache, *out = self._calls.decode(
            self._weights, self._cache, tokens, lengths.copy(),
            np.isin(np.arange(B), busy), keys, counts, np.int32(max_new_tokens),
            np.int32(self.max_length), stop_mask, np.bool_(bool(queue)), *knobs)
        tok, logp, counts_out, _ = jax.device_get(out)
        for s in busy:
          for j in range(int(counts_out[s] - counts[s])):
            lengths[s] += 1
            append(s, tok[j, s], logp[j, s])
        continue
      tokens = np.zeros((B, P), np.int32)
      n_valid = np.zeros(B, np.int32)
      for s in prefilling:
        r = slot_req[s]
        piece = feeds[r][0][fed[r]:fed[r] + P]
        tokens[s, :len(piece)] = piece
        n_valid[s] = len(piece)
      self._cache, tok, logp = self._calls.step(self._weights, self._cache, tokens,
                                                lengths.copy(), n_valid, keys, counts, *knobs)
      tok, logp = jax.device_get((tok, logp))
      lengths += n_valid
      for s in prefilling:
        r = slot_req[s]
        fed[r] += int(n_valid[s])
        if fed[r] == len(feeds[r][0]):  # the last piece: its sample is the first new token
          append(s, tok[s], logp[s])
    return results
