"""The sampler against the truncated, tempered softmax written out in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_lm.inference.sampling import SamplingParams, sample

SEED = 3


def _expected(logits, temperature, top_k, top_p):
  """The distribution SamplingParams promises: softmax(l / T) over the top_k most likely ids,
  then the smallest prefix (by probability) whose mass reaches top_p, renormalised."""
  order = np.argsort(-logits, kind="stable")
  keep = np.zeros(len(logits), bool)
  keep[order[:top_k or len(logits)]] = True
  p = np.where(keep, np.exp((logits - logits.max()) / temperature), 0.0)
  p /= p.sum()
  mass, chosen = 0.0, np.zeros_like(keep)
  for i in order:
    if keep[i] and mass < top_p:
      chosen[i] = True
      mass += p[i]
  p = np.where(chosen, p, 0.0)
  return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0),
                                                     (1.5, 0, 0.8), (1.2, 4, 0.6)])
def test_sample_frequencies_match_the_truncated_softmax(temperature, top_k, top_p):
  print(f"seed {SEED}")
  rng = np.random.default_rng(SEED)
  logits = rng.normal(0, 1.5, 7).astype(np.float32)
  n = 40_000
  sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  keys = jax.random.split(jax.random.PRNGKey(SEED), n)
  tok, logp = jax.jit(sample)(jnp.broadcast_to(logits, (n, 7)), keys, mode=sp.mode,
                              temperature=temperature, top_k=top_k, top_p=top_p)
  freq = np.bincount(np.asarray(tok), minlength=7) / n
  np.testing.assert_allclose(freq, _expected(logits.astype(np.float64), temperature, top_k,
                                             top_p), atol=0.012)
  # The log-prob is the model's, not the sampling distribution's.
  ref = logits - np.log(np.sum(np.exp(logits)))
  np.testing.assert_allclose(np.asarray(logp), ref[np.asarray(tok)], atol=1e-5)


def test_greedy_mode_is_argmax():
  logits = jnp.asarray(np.random.default_rng(SEED).normal(size=(5, 11)), jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  tok, _ = sample(logits, keys, mode=0, temperature=1.0, top_k=0, top_p=1.0)
  np.testing.assert_array_equal(tok, np.argmax(logits, -1))


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-6])
def test_a_vanishing_temperature_is_greedy(temperature):
  """temperature=1e-40 is a float32 subnormal (flushed to zero on the CPU: logits / T was
  inf / NaN) and 1e-38 overflows logits / T: plain sampling returned token 0, not the argmax.
  Below GREEDY_BELOW the mode is greedy; just above it sampling still picks the argmax."""
  logits = jnp.asarray(np.random.default_rng(SEED).normal(size=(6, 11)), jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  for t in (temperature, 2e-5):
    sp = SamplingParams(temperature=t)
    assert sp.mode == (0 if t < 1e-5 else 1)
    tok, _ = jax.jit(sample)(logits, keys, mode=sp.mode, temperature=t, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(tok, np.argmax(logits, -1), err_msg=str(t))


def test_sampling_params_refuse_what_they_would_coerce_or_crash_on():
  """A string temperature (a TypeError from `>=`), an infinite one (uniform sampling), a
  non-integer stop id (1.7 silently became 1) and a bare string are refused by name; one int
  as stop_tokens is one stop id (it was `'int' object is not iterable`)."""
  for kwargs, field in ((dict(temperature="0.5"), "temperature"),
                        (dict(temperature=float("inf")), "temperature"),
                        (dict(top_p="0.9"), "top_p"), (dict(stop_tokens=[1.7]), "stop_tokens"),
                        (dict(stop_tokens="5"), "stop_tokens"),
                        (dict(stop_tokens=[True]), "stop_tokens")):
    with pytest.raises(ValueError, match=f"SamplingParams: {field}="):
      SamplingParams(**kwargs)
  assert SamplingParams(stop_tokens=5).stop_tokens == (5,)
  assert SamplingParams(stop_tokens=np.array([3, 4])).stop_tokens == (3, 4)
