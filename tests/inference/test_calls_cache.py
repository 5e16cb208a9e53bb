"""`calls.mesh_calls`' cache of mesh programs: a repeated engine configuration gets the same
calls (nothing rebuilt, nothing recompiled), and the cache holds at most MESH_CALLS_MAXSIZE
configurations, the least recently used dropped first. Nothing is compiled here (jax.jit is
lazy): the cache layer alone, on a one-device mesh with the real graph definition and weight
shardings of the tiny preset."""

import collections

import jax
from flax import nnx

from sparse_lm import sharding as shd
from sparse_lm.config import get_preset
from sparse_lm.inference import calls as calls_lib
from sparse_lm.inference.forward import DecoderStack
from sparse_lm.model import Transformer


def test_mesh_calls_cache_hits_and_stays_bounded(monkeypatch):
  monkeypatch.setattr(calls_lib, "_MESH_CALLS", collections.OrderedDict())
  monkeypatch.setattr(calls_lib, "MESH_CALLS_MAXSIZE", 3)
  cfg = get_preset("tiny")
  mesh = shd.make_mesh(shd.MeshLayout(), devices=jax.devices()[:1])

  def split():
    return nnx.split(nnx.eval_shape(lambda: DecoderStack(Transformer(cfg, rngs=nnx.Rngs(0)))))

  graphdef, state = split()
  w_sh = calls_lib.weight_shardings(state, mesh)

  def get(batch, graphdef=graphdef):
    return calls_lib.mesh_calls(graphdef, mesh, w_sh, cfg, batch=batch, cache_length=64,
                                kv_block=16, num_steps=4)

  first = {b: get(b) for b in (1, 2, 3)}
  assert len({id(c) for c in first.values()}) == 3
  # A repeated configuration hits, also through a graph definition built anew (as a second
  # Engine of the same model makes): the same calls, so their compiled programs are reused.
  assert get(1) is first[1]
  assert get(1, graphdef=split()[0]) is first[1]
  # Batch 1 is now the most recently used: a fourth configuration drops batch 2, the least.
  fourth = get(4)
  assert list(calls_lib._MESH_CALLS) == [
      (graphdef, mesh, b, 64, 16, 4) for b in (3, 1, 4)]
  assert get(3) is first[3] and get(1) is first[1] and get(4) is fourth
  rebuilt = get(2)  # evicted before: built anew (drops batch 3, now the least recent)
  assert rebuilt is not first[2] and get(2) is rebuilt
  for b in range(5, 15):  # an RL loop / notebook making engines of changing shapes
    get(b)
  assert len(calls_lib._MESH_CALLS) == 3
  assert [k[2] for k in calls_lib._MESH_CALLS] == [12, 13, 14]
