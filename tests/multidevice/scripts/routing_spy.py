"""Record the routing each MoE layer hands to its dispatch (ids, positions, margins), for the
capacity-rule checks of drop_check.py and benchmarks/ep_drops.py (compared with ep_rule.py)."""
import jax
import numpy as np

from sparse_lm.moe import latent_moe

RECORD = []  # one (ids [N, k], positions [N], margin [N, k]) numpy tuple per MoE layer call
_dispatch = latent_moe.dispatch_and_compute


def _spy(z, ids, gates, params, **kw):
  """Record each MoE layer's routing as the layer passes it to the dispatch."""
  jax.debug.callback(lambda *a: RECORD.append(tuple(np.asarray(x) for x in a)), ids,
                     kw["positions"], kw["margin"])
  return _dispatch(z, ids, gates, params, **kw)


def install() -> list:
  """Route `latent_moe.dispatch_and_compute` through the recorder (before the step is traced);
  returns RECORD (clear it between steps)."""
  latent_moe.dispatch_and_compute = _spy
  return RECORD
