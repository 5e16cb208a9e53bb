"""The inference engine against the model's full forward pass (tiny preset, fp32, random
weights, MoE top-2 with non-zero balancing biases, Block AttnRes).

The reference is `Transformer.__call__` over the whole history (chunked KDA, blocked attention
over decompressed keys): it shares no code with the cache path (forward.py), so a wrong cache,
conv tail, position or absorbed weight shows up as a different token or log-prob.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.inference import Engine, SamplingParams, engine as engine_lib
from sparse_lm.inference.forward import DecoderStack
from sparse_lm.model import Transformer
from tests.inference.engine_testlib import randomize_balancer_biases

SEED = 0
MAX_LENGTH = 224  # the reference pads every history to this length (one compile)


@pytest.fixture(scope="module")
def setup():
  print(f"seed {SEED}")
  cfg = get_preset("tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(SEED))
  # Non-zero routing biases: the engine must route with them, as the trained model does.
  randomize_balancer_biases(model, SEED + 1)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda st, t: jax.nn.log_softmax(nnx.merge(graphdef, st)(t), axis=-1))

  def reference(history):
    """log p(. | history[:t+1]) for every t: [len(history), vocab] from the full forward."""
    tokens = np.zeros((1, MAX_LENGTH), np.int32)
    tokens[0, :len(history)] = history
    return np.asarray(forward(state, tokens))[0, :len(history)]

  # 5 decode steps per device call: 8 new tokens take two calls (a row's decode spans calls).
  engine = Engine(model, max_length=MAX_LENGTH, max_batch=4, prefill_chunk=64, decode_steps=5)
  return cfg, model, engine, reference


def _compiled():
  """Programs compiled so far by the engine's prefill-piece and decode-loop calls."""
  return engine_lib._step._cache_size() + engine_lib._decode._cache_size()


def _prompts(cfg, lengths, seed):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in lengths]


def _check_against_reference(reference, prompt, out, tol=1e-4, greedy=True):
  logp = reference(prompt + out.tokens)
  n = len(prompt)
  for i, tok in enumerate(out.tokens):
    row = logp[n - 1 + i]
    if greedy:
      assert tok == int(np.argmax(row)), f"step {i}: engine {tok}, full forward {np.argmax(row)}"
    assert abs(out.logprobs[i] - row[tok]) < tol, (i, out.logprobs[i], row[tok])


def test_greedy_decode_equals_recompute(setup):
  """Lengths 1, 5, 70, 150 in one batch: 150 takes three 64-token prefill pieces and more
  than two 64-token KDA chunks; every step's token is the full forward's argmax."""
  cfg, _, engine, reference = setup
  prompts = _prompts(cfg, (1, 5, 70, 150), SEED)
  outs = engine.generate(prompts, max_new_tokens=8, sampling=SamplingParams(temperature=0.0))
  for p, o in zip(prompts, outs):
    assert len(o.tokens) == 8 and o.finish_reason == "max_new_tokens"
    _check_against_reference(reference, p, o)


def test_the_fused_kernel_engine_equals_recompute(setup):
  """The engine with the fused decode kernels (decode_backend="pallas": interpret mode on CPU,
  Triton on a GPU), which prebuilds each KDA, MLA and MoE layer's input projections, and each MoE
  layer's output projections, as one matrix:
  greedy tokens and log-probs against the same full forward, the same weights."""
  cfg, _, _, reference = setup
  cfg_k = dataclasses.replace(cfg, decode_backend="pallas")
  model = Transformer(cfg_k, rngs=nnx.Rngs(SEED))
  randomize_balancer_biases(model, SEED + 1)  # the fixture's weights exactly
  engine = Engine(model, max_length=MAX_LENGTH, max_batch=2, prefill_chunk=64, decode_steps=5)
  layers = DecoderStack(model).layers
  n_kda, n_moe = (sum(layer.mixer_kind == "kda" for layer in layers),
                  sum(not layer.dense_ffn for layer in layers))
  assert n_kda > 0 and len(engine._weights["kda_inputs"]) == n_kda
  assert n_moe > 0 and len(engine._weights["moe_inputs"]) == n_moe
  assert len(engine._weights["moe_outputs"]) == n_moe
  assert len(engine._weights["mla_inputs"]) == len(layers) - n_kda > 0
  prompts = _prompts(cfg, (5, 70), SEED + 7)
  outs = engine.generate(prompts, max_new_tokens=6, sampling=SamplingParams(temperature=0.0))
  for p, o in zip(prompts, outs):
    assert len(o.tokens) == 6
    _check_against_reference(reference, p, o)


def test_sampled_logprobs_are_the_models(setup):
  """Sampled tokens (temperature, top-k, top-p) carry log p under the unmodified model."""
  cfg, _, engine, reference = setup
  prompts = _prompts(cfg, (3, 40), SEED + 2)
  sp = SamplingParams(temperature=1.3, top_k=50, top_p=0.9)
  outs = engine.generate(prompts, max_new_tokens=6, sampling=sp, seed=7)
  for p, o in zip(prompts, outs):
    _check_against_reference(reference, p, o, greedy=False)
  again = engine.generate(prompts, max_new_tokens=6, sampling=sp, seed=7)
  assert [o.tokens for o in outs] == [o.tokens for o in again]
  other = engine.generate(prompts, max_new_tokens=6, sampling=sp, seed=8)
  assert [o.tokens for o in outs] != [o.tokens for o in other]
  # top_k = 1 and a tiny nucleus are greedy.
  greedy = engine.generate(prompts, max_new_tokens=6, sampling=SamplingParams(temperature=0))
  for sp in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
    assert [o.tokens for o in engine.generate(prompts, max_new_tokens=6, sampling=sp)] == \
        [o.tokens for o in greedy]


def test_stop_tokens_end_a_row(setup):
  cfg, _, engine, _ = setup
  prompt = _prompts(cfg, (12,), SEED + 3)[0]
  full = engine.generate([prompt], max_new_tokens=10, sampling=SamplingParams(temperature=0))[0]
  stop = full.tokens[3]
  first = full.tokens.index(stop)
  out = engine.generate([prompt], max_new_tokens=10,
                        sampling=SamplingParams(temperature=0, stop_tokens=[stop]))[0]
  assert out.tokens == full.tokens[:first + 1] and out.finish_reason == "stop"
  assert out.logprobs == pytest.approx(full.logprobs[:first + 1], abs=1e-6)


def test_multi_turn_state_equals_concatenated_history(setup):
  cfg, _, engine, reference = setup
  p1, p2 = _prompts(cfg, (37, 20), SEED + 4)
  greedy = SamplingParams(temperature=0.0)
  turn1 = engine.generate([p1], max_new_tokens=5, sampling=greedy)[0]
  turn2 = engine.generate([p2], max_new_tokens=6, sampling=greedy, states=[turn1.state])[0]
  history = p1 + turn1.tokens + p2
  once = engine.generate([history], max_new_tokens=6, sampling=greedy)[0]
  assert turn2.tokens == once.tokens
  np.testing.assert_allclose(turn2.logprobs, once.logprobs, atol=1e-5)
  _check_against_reference(reference, history, turn2)
  assert turn2.state.history_length == len(history) + 6
  # A state is not consumed: continuing it again gives the same turn.
  again = engine.generate([p2], max_new_tokens=6, sampling=greedy, states=[turn1.state])[0]
  assert again.tokens == turn2.tokens


def test_continuous_batching_matches_one_at_a_time(setup):
  """20 prompts through 4 slots (rows finish at different steps: stop tokens and a cap) equal
  each prompt alone, greedy and sampled; refilling slots compiles nothing new."""
  cfg, _, engine, _ = setup
  rng = np.random.default_rng(SEED + 5)
  prompts = _prompts(cfg, rng.integers(1, 90, 20), SEED + 5)
  stops = [int(t) for t in rng.integers(0, cfg.vocab_size, 40)]
  seeds = [int(s) for s in rng.integers(0, 2**31, 20)]
  engine.generate(prompts[:1], max_new_tokens=2, sampling=SamplingParams(temperature=0))
  engine.generate(prompts[:1], max_new_tokens=2, sampling=SamplingParams(top_k=40, top_p=0.9))
  compiled = _compiled()
  for sp in (SamplingParams(temperature=0, stop_tokens=stops),
             SamplingParams(temperature=0.9, top_k=40, top_p=0.9, stop_tokens=stops)):
    batched = engine.generate(prompts, max_new_tokens=12, sampling=sp, seed=seeds)
    assert len({len(o.tokens) for o in batched}) > 1  # rows really finished at different steps
    for p, s, o in zip(prompts, seeds, batched):
      alone = engine.generate([p], max_new_tokens=12, sampling=sp, seed=[s])[0]
      assert alone.tokens == o.tokens and alone.finish_reason == o.finish_reason
      np.testing.assert_allclose(alone.logprobs, o.logprobs, atol=1e-5)
  assert _compiled() == compiled


def test_cache_full_ends_generation(setup):
  cfg, _, engine, _ = setup
  prompt = _prompts(cfg, (MAX_LENGTH - 3,), SEED + 6)[0]
  out = engine.generate([prompt], max_new_tokens=10, sampling=SamplingParams(temperature=0))[0]
  # 3 free positions: the tokens sampled after the prompt and after each of 3 fed tokens.
  assert len(out.tokens) == 4 and out.finish_reason == "max_length"
  with pytest.raises(ValueError, match="max_length"):
    engine.generate([[1]], max_new_tokens=1, states=[out.state])


def test_bad_input_is_refused_before_compiling(setup):
  cfg, model, _, _ = setup
  engine = Engine(model, max_length=32, max_batch=2, prefill_chunk=16)
  compiled = _compiled()
  ok = [[1, 2, 3]]
  cases = [
      (dict(prompts=[[]]), r"prompts\[0\] is empty"),
      (dict(prompts=[[1, 2], list(range(33))]), r"prompts\[1\].*max_length=32"),
      (dict(prompts=[[1, cfg.vocab_size]]), r"prompts\[0\].*token id 512.*vocabulary"),
      (dict(prompts=[[-1]]), r"prompts\[0\].*token id -1"),
      (dict(prompts=ok, max_new_tokens=0), "max_new_tokens"),
      (dict(prompts=ok, seed=[1, 2]), "seed"),
      # past the int32 / 64-bit ranges (OverflowError tracebacks before) and bools
      (dict(prompts=ok, max_new_tokens=2**31), r"max_new_tokens=2147483648 .*\[1, 2\*\*31\)"),
      (dict(prompts=ok, max_new_tokens=True), "max_new_tokens"),
      (dict(prompts=ok, seed=2**70), "64-bit"),
      (dict(prompts=ok, seed=[True]), "seed"),
      (dict(prompts="hello"), "prompts"),
      (dict(prompts=ok, states=[None, None]), "states"),
  ]
  for kwargs, match in cases:
    with pytest.raises(ValueError, match=match):
      engine.generate(**kwargs)
  with pytest.raises(ValueError, match="decode_steps"):
    Engine(model, max_length=32, decode_steps=0)
  for top_p in (0.0, 1.5, -0.1):
    with pytest.raises(ValueError, match="top_p"):
      SamplingParams(top_p=top_p)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1)
  for top_k in (3_000_000_000, -1, True, 2.0):
    with pytest.raises(ValueError, match="top_k"):
      SamplingParams(top_k=top_k)
  assert SamplingParams(top_k=np.int64(5)).top_k == 5  # numpy ints are ints
  with pytest.raises(ValueError, match="stop_tokens"):
    engine.generate(ok, sampling=SamplingParams(stop_tokens=[10**6]))
  other = Transformer(get_preset("tiny", d_model=32, vocab_size=256), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"load_weights.*\['vocab_size', 'd_model'\]"):
    engine.load_weights(other)
  assert _compiled() == compiled
  # a list of seeds takes each one's low 32 bits: negatives and numpy arrays work, and
  # a seed and its value + 2**32 draw the same tokens
  sp = SamplingParams(temperature=1.0)
  a = engine.generate(ok, max_new_tokens=3, sampling=sp, seed=[7])[0].tokens
  assert engine.generate(ok, max_new_tokens=3, sampling=sp, seed=np.array([7]))[0].tokens == a
  assert engine.generate(ok, max_new_tokens=3, sampling=sp, seed=[7 + 2**32])[0].tokens == a
  engine.generate(ok, max_new_tokens=3, sampling=sp, seed=[-1])


def test_engine_keeps_its_own_weights_and_a_second_call_compiles_nothing():
  """A model whose weights sit on a one-device mesh (as `train.load` leaves a trained state):
  the second `generate` compiles no program (the zero caches are committed to the weights'
  device, as the calls' outputs are; they used to differ and the second call compiled its
  prefill again), and a later change of the model's weights does not reach the engine until
  `load_weights`, after which it equals a new engine on those weights."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from sparse_lm import sharding as shd  # pylint: disable=g-import-not-at-top
  cfg = get_preset("tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(SEED + 3))
  mesh = shd.make_mesh(shd.MeshLayout(), jax.devices()[:1])
  _, state = nnx.split(model)
  nnx.update(model, jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), state))
  kw = dict(max_length=48, max_batch=2, prefill_chunk=16, decode_steps=4)
  greedy = dict(max_new_tokens=6, sampling=SamplingParams(temperature=0.0))
  engine = Engine(model, **kw)
  prompt = [[5, 6, 7, 8]]
  first = engine.generate(prompt, **greedy)[0].tokens
  compiled = _compiled()
  assert engine.generate(prompt, **greedy)[0].tokens == first
  assert _compiled() == compiled  # nothing traced or compiled anew
  _, state = nnx.split(model)
  nnx.update(model, jax.tree.map(
      lambda a: 1.5 * a if jnp.issubdtype(a.dtype, jnp.floating) else a, state))
  assert engine.generate(prompt, **greedy)[0].tokens == first  # the engine's own copy
  fresh = Engine(model, **kw).generate(prompt, **greedy)[0].tokens
  assert fresh != first  # the change matters to the model's output
  engine.load_weights(model)
  assert engine.generate(prompt, **greedy)[0].tokens == fresh


def test_caches_larger_than_the_device_are_refused_before_allocating(setup):
  cfg, model, _, _ = setup
  with pytest.raises(ValueError, match=r"max_length=.*max_batch=8.*GiB.*lower max_length"):
    Engine(model, max_length=10**11, max_batch=8)
  with pytest.raises(ValueError, match="kv_block=0 must be a positive int"):
    Engine(model, max_length=32, kv_block=0)
  with pytest.raises(ValueError, match="max_length=True must be a positive int"):
    Engine(model, max_length=True)  # a bool was taken as a length of 1
