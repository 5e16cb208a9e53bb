"""Mesh axes and the one table of logical-axis rules (ARCHITECTURE.md §9).

Every parameter is created with logical axis names (`embed`, `heads`, `exp`, ...) and every
large activation is constrained with `constrain(x, names)`. This file is the only place those
names meet mesh axes. Without an active mesh (`use_mesh`), `constrain` is the identity, so the
model runs unchanged on one CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", "context"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_exp", "expert"),
    ("activation_vocab", "tensor"),
    # parameters
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("latent", None),
    ("expert_mlp", "tensor"),
    ("layers", None),
    ("conv", None),
    ("norm", None),
)

_MESH: contextvars.ContextVar[jax.sharding.Mesh | None] = contextvars.ContextVar(
    "sparse_lm_mesh", default=None)
_RULES: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "sparse_lm_rules", default=LOGICAL_AXIS_RULES)


def logical_to_spec(names: Sequence[str | None], rules=None, mesh=None) -> P:
  """PartitionSpec for logical axis names; mesh axes of size 1 or absent are dropped.

  A mesh axis is used at most once per spec (the first logical axis that claims it wins).
  """
  rules = dict(_RULES.get() if rules is None else rules)
  mesh = _MESH.get() if mesh is None else mesh
  used: set[str] = set()
  out = []
  for name in names:
    target = rules.get(name) if name is not None else None
    if target is None:
      out.append(None)
      continue
    axes = (target,) if isinstance(target, str) else tuple(target)
    if mesh is not None:
      axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
    axes = tuple(a for a in axes if a not in used)
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules=None):
  """Activate `mesh` (and optionally other rules) for `constrain` and parameter shardings."""
  tok_m = _MESH.set(mesh)
  tok_r = _RULES.set(LOGICAL_AXIS_RULES if rules is None else tuple(rules))
  try:
    yield mesh
  finally:
    _MESH.reset(tok_m)
    _RULES.reset(tok_r)


def current_mesh() -> jax.sharding.Mesh | None:
  return _MESH.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names; identity when no mesh is active."""
  mesh = _MESH.get()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names)))
