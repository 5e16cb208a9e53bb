"""Record the routing each MoE layer hands to its dispatch (ids, positions, margins), for the
capacity-rule checks of drop_check.py and benchmarks/ep_drops.py (compared with ep_rule.py);
and, per device, what the expert-parallel exchange counted (drop_check.py)."""
import jax
import jax.numpy as jnp
import numpy as np

from sparse_lm.moe import expert_parallel, latent_moe

RECORD = []  # one (ids [N, k], positions [N], margin [N, k]) numpy tuple per MoE layer call
DEVICE_STATS = []  # one (coordinates, [dropped, sent]) per device per expert-parallel call
_dispatch = latent_moe.dispatch_and_compute
_ep_body = expert_parallel._ep_body  # pylint: disable=protected-access


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


def install_device_stats(axes) -> list:
  """Record, on every device inside the expert-parallel shard_map, its coordinates on the mesh
  `axes` and the pairs it dropped and sent (as its stats row; before the traced step);
  returns DEVICE_STATS (clear it between calls)."""

  def body(*args, **kw):
    u, stats = _ep_body(*args, **kw)
    where = jnp.stack([jax.lax.axis_index(a) for a in axes])
    jax.debug.callback(lambda c, s: DEVICE_STATS.append(
        (tuple(int(v) for v in np.asarray(c)), np.asarray(s)[0, :2].round().astype(int))),
                       where, stats)
    return u, stats

  expert_parallel._ep_body = body  # pylint: disable=protected-access
  return DEVICE_STATS
