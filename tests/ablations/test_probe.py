"""The ablation probes' metrics against independent NumPy computations on random inputs:
the dense diagonal-tile exponent, the per-call recording (max |activation|), the held-out
position buckets, pass-key scoring and prompts, and the summed expert load."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.ablations import probe
from pallas_kernels.kda.tiles import dense_diag_max_exponent


def _seed():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print("seed", seed)
  return seed


def _np_exponent(g, chunk):
  """Largest r - G_j over 16-token tiles (chunks of `chunk`), r at the tile's first row:
  -sum of g over tile positions 1..j, maximised over j, tiles, batch, heads, channels."""
  B, T, H, K = g.shape
  sub = min(16, chunk)
  best = 0.0
  for c0 in range(0, T, chunk):
    for t0 in range(c0, min(c0 + chunk, T), sub):
      run = np.zeros((B, H, K))
      for j in range(t0 + 1, min(t0 + sub, c0 + chunk, T)):
        run = run - g[:, j]
        best = max(best, float(run.max()))
  return best


def test_dense_tile_exponent_matches_numpy():
  rng = np.random.default_rng(_seed())
  for lo, chunk in ((-5.0, 16), (-40.0, 32)):  # bounded-like and unbounded-like gates
    g = rng.uniform(lo, 0.0, (2, 45, 2, 3)).astype(np.float32)
    got = float(dense_diag_max_exponent(jnp.asarray(g), chunk_size=chunk))
    np.testing.assert_allclose(got, _np_exponent(g.astype(np.float64), chunk), rtol=1e-5)
  assert got > 75  # the unbounded-like gate goes past the bounded gate's 15 * 5 nats


@pytest.mark.skipif(not probe.has_cpu_platform(),
                    reason="jax.debug.callback needs the CPU platform (JAX_PLATFORMS=cuda alone "
                           "has none; record_calls then raises, naming the fix)")
def test_record_calls_reports_each_call_in_order():
  rng = np.random.default_rng(_seed())
  mod = types.SimpleNamespace(act=lambda x: jnp.tanh(x) * 3.0)
  xs = rng.standard_normal((4, 5, 6)).astype(np.float32)

  def model(stack):
    def body(c, x):
      return c + mod.act(x).sum(), None
    return jax.lax.scan(body, 0.0, stack)[0]

  out = []
  with probe.record_calls(mod, "act", lambda h, *a: jnp.max(jnp.abs(h)), out):
    jax.block_until_ready(jax.jit(model)(jnp.asarray(xs)))
    jax.effects_barrier()
  np.testing.assert_allclose(out, np.abs(np.tanh(xs) * 3.0).max(axis=(1, 2)), rtol=1e-6)
  assert mod.act(jnp.ones(())) == jnp.tanh(1.0) * 3.0  # restored


def test_position_buckets_and_passkey_scoring():
  rng = np.random.default_rng(_seed())
  L = 4
  losses = rng.uniform(0, 5, (3, 8 * L - 1))
  got = probe.position_losses(losses, L)
  edges = [0, L - 1, 2 * L - 1, 4 * L - 1, 8 * L - 1]
  for i, m in enumerate((1, 2, 4, 8)):
    assert np.isclose(got[f"loss@{m}L"], losses[:, :edges[i + 1]].mean())
    prev = (0, 1, 2, 4)[i]
    assert np.isclose(got[f"positions {prev}L-{m}L"], losses[:, edges[i]:edges[i + 1]].mean())
  # Pass-key scoring: logits whose argmax is the true next token everywhere, except the last
  # answer token of the rows marked wrong.
  rows = rng.integers(0, 50, (4, 12)).astype(np.int32)
  lens = np.array([2, 3, 2, 1])
  wrong = np.array([False, True, False, True])

  def logits_fn(t):
    t = np.asarray(t)
    out = np.zeros(t.shape + (50,), np.float32)
    for r in range(t.shape[0]):
      i = int(np.flatnonzero((rows == t[r]).all(1))[0])
      nxt = np.append(t[r, 1:], 0)
      if wrong[i]:
        nxt[-2] = (nxt[-2] + 1) % 50  # position T-2 predicts the last token
      out[r, np.arange(t.shape[1]), nxt] = 1.0
    return jnp.asarray(out)

  assert probe.passkey_accuracy(logits_fn, rows, lens, batch=3) == 0.5
  wrong[:] = False
  assert probe.passkey_accuracy(logits_fn, rows, lens) == 1.0


def test_passkey_prompts_hide_the_key_at_the_depth():
  class Tok:  # characters as ids
    def encode(self, text):
      return [ord(c) for c in text]

  filler = np.full((2, 400), ord("."), np.int32)
  rows, lens = probe.passkey_prompts(Tok(), filler, 300, 0.5, [12345, 67890])
  assert rows.shape == (2, 300) and list(lens) == [7, 7]
  text = "".join(map(chr, rows[1]))
  assert text.endswith("The pass key is 67890.")
  needle = text.index("\nThe pass key is 67890. Remember it.")
  n_fill = 300 - len("\nThe pass key is 67890. Remember it. 67890 is the pass key.\n") - \
      len("\nWhat is the pass key? The pass key is") - 7
  assert needle == round(0.5 * n_fill)


def test_moe_load_sums_the_loads_over_batches():
  rng = np.random.default_rng(_seed())
  loads = rng.integers(0, 30, (3, 2, 8)).astype(np.float32)  # 3 batches, 2 layers, 8 experts

  class Model:
    def forward_hidden(self, t):
      return None, {"load": jnp.asarray(loads)[t[0, 0]]}

  tokens = np.repeat(np.arange(3), 2)[:, None].astype(np.int32)  # batch i -> loads[i]
  got = probe.moe_load(Model(), tokens, batch=2)
  total = loads.sum(0)
  np.testing.assert_allclose(got, total.max(-1) / total.mean(-1), rtol=1e-6)


def test_load_rows_route_the_same_heldout_tokens_at_any_training_length(monkeypatch):
  rng = np.random.default_rng(_seed())
  docs = rng.integers(0, 512, (5, 1000)).astype(np.int32)  # 5 held-out documents' tokens
  asked = []

  def heldout_rows(stage, tokenizer, length, max_rows):
    asked.append(length)
    return docs[:max_rows, :length]

  monkeypatch.setattr(probe, "heldout_rows", heldout_rows)
  at_128 = probe.load_rows(None, None, 128)
  assert at_128.shape == (5, 128) and (at_128 == docs[:, :128]).all()
  for length in (32, 64):  # the same 128 tokens per document, as consecutive rows of L
    got = probe.load_rows(None, None, length)
    assert got.shape == (5 * 128 // length, length)
    np.testing.assert_array_equal(got.reshape(5, 128), docs[:, :128])
  assert probe.load_rows(None, None, 48).shape == (5 * 2, 48)  # 96 tokens: whole rows only
  long = probe.load_rows(None, None, 256, max_docs=3)  # longer rows: the first L tokens
  np.testing.assert_array_equal(long, docs[:3, :256])
  assert asked == [128, 128, 128, 96, 256]
