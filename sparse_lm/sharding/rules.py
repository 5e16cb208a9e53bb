"""The one table of logical-axis rules and what is derived from it (ARCHITECTURE §9).

Logical axis names -> mesh axes (`LOGICAL_AXIS_RULES`, `logical_axis_rules`), the active mesh
and rules (`use_mesh`, `current_mesh`, `constrain`), and the shardings of the train state and
the batch (`state_shardings`, `batch_sharding`). See the package docstring for the axes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Mapping, Sequence

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
    # parameters: ZeRO-3 over every axis that replicates them otherwise. `context` ranks (and,
    # for the non-expert weights, `expert` ranks: a batch or sequence axis there) hold the same
    # parameters, so d_model is split over fsdp x context x expert (axes that do not divide
    # are dropped).
    ("embed", ("fsdp", "context", "expert")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    # The expert weights [exp, latent, expert_mlp] hold 98% of the full model's parameters:
    # their latent dim is sharded over fsdp as well, or they would be replicated over it.
    ("latent", ("fsdp", "context")),
    ("expert_mlp", "tensor"),
    ("layers", None),
    ("conv", None),
    ("norm", None),
    # the vision encoder (vision/encoder.py): its width and merged width are ZeRO-sharded like
    # `embed`, its MLP / projector hidden over tensor like `mlp`; patch pixels stay whole.
    ("vision_embed", ("fsdp", "context", "expert")),
    ("vision_merged", ("fsdp", "context", "expert")),
    ("vision_mlp", "tensor"),
    ("vision_patch", None),
)

# What the `expert` mesh axis shards outside the routed experts (MeshLayout.expert_shards).
EXPERT_SHARDS = ("batch", "context")


def logical_axis_rules(expert_shards: str = "batch") -> tuple:
  """The rules table for a layout: LOGICAL_AXIS_RULES, or with `expert_shards="context"` the
  same table with `expert` moved from the batch of every activation to the front of its
  sequence axis (activation_batch -> data, fsdp; activation_length -> expert, context).

  With "context" the expert-parallel degree no longer has to divide the sequences per
  micro-batch: the full 1M stage has 8 sequences per micro-batch but needs EP 128 so that
  each chip holds 7 of the 896 experts instead of 56. Tokens of different sequence shards are
  independent tokens for the MoE, so the expert exchange is unchanged; the context-parallel
  layers run over the sequence axes (expert, context) as one axis, expert-major (shard
  r = expert_index * context + context_index holds tokens [r T/P, (r+1) T/P)). This is
  MaxText's `expert_shard_attention_option="context"` (its "fsdp" is our "batch"), except
  for the order: MaxText maps the sequence to (context, expert), here it is (expert, context),
  so that the flattened [B, T] tokens stay sharded over data, fsdp, expert, context in both
  modes (moe/expert_parallel.TOKEN_AXES).

  Raises:
    ValueError: expert_shards not in EXPERT_SHARDS.
  """
  if expert_shards not in EXPERT_SHARDS:
    raise ValueError(f"expert_shards={expert_shards!r}: choose one of {EXPERT_SHARDS}")
  if expert_shards == "batch":
    return LOGICAL_AXIS_RULES
  moved = {"activation_batch": ("data", "fsdp"), "activation_length": ("expert", "context")}
  return tuple((name, moved.get(name, target)) for name, target in LOGICAL_AXIS_RULES)


_MESH: contextvars.ContextVar[jax.sharding.Mesh | None] = contextvars.ContextVar(
    "sparse_lm_mesh", default=None)
_RULES: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "sparse_lm_rules", default=LOGICAL_AXIS_RULES)


# ------------------------------------------------------------------------------ rules


def logical_to_spec(names: Sequence[str | None] | P, rules=None, mesh=None,
                    shape: Sequence[int] | None = None) -> P:
  """PartitionSpec for logical axis names.

  Mesh axes of size 1 or absent from the mesh are dropped. A mesh axis is used at most once
  per spec (the first logical axis that claims it wins). A name that is itself a mesh axis
  (e.g. "fsdp") maps to itself. With `shape`, a mesh axis that does not divide its dimension
  is dropped (that dimension is replicated over it) so small presets run on any mesh;
  `validate_layout` is where divisibility is enforced for the dimensions that matter.
  """
  rules = dict(_RULES.get() if rules is None else rules)
  mesh = _MESH.get() if mesh is None else mesh
  used: set[str] = set()
  out = []
  for i, name in enumerate(names):
    if name is None:
      out.append(None)
      continue
    if isinstance(name, (tuple, list)):  # already a tuple of names
      target = tuple(a for n in name for a in _as_tuple(_rule_target(rules, n)))
    else:
      target = _rule_target(rules, name)
    axes = _as_tuple(target)
    if mesh is not None:
      axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
    axes = tuple(a for a in axes if a not in used)
    if shape is not None and mesh is not None:
      kept, size = [], 1
      for a in axes:
        if shape[i] % (size * mesh.shape[a]) == 0:
          kept.append(a)
          size *= mesh.shape[a]
      axes = tuple(kept)
    used.update(axes)
    out.append(spec_entry(axes))
  return P(*out)


def mesh_axes(name: str, mesh: jax.sharding.Mesh | None = None, rules=None) -> tuple[str, ...]:
  """The mesh axes (of size > 1 in `mesh`, default the active one) that logical axis `name`
  maps to under `rules` (default the active rules), in order; () without a mesh.

  E.g. `mesh_axes("activation_length")` is ("context",) by default and ("expert", "context")
  with `expert_shards="context"`: the axes the context-parallel layers run over.
  """
  rules = dict(_RULES.get() if rules is None else rules)
  mesh = _MESH.get() if mesh is None else mesh
  if mesh is None:
    return ()
  return tuple(a for a in _as_tuple(_rule_target(rules, name))
               if a in mesh.shape and mesh.shape[a] > 1)


def _rule_target(rules: Mapping, name: str):
  """The mesh axis / axes the rules give logical axis `name` (a mesh axis name maps to
  itself; an unknown name to None)."""
  return rules.get(name, name if name in MESH_AXES else None)


def spec_entry(axes: Sequence[str]) -> str | tuple[str, ...] | None:
  """One PartitionSpec entry from a sequence of mesh axes: None, the name, or the tuple."""
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _as_tuple(target) -> tuple[str, ...]:
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh | None, rules=None):
  """Activate `mesh` (and optionally other rules) for `constrain` and parameter shardings.

  `use_mesh(None)` deactivates: used inside `shard_map` bodies, where the axes are manual and
  sharding constraints must not be emitted.
  """
  tok_m = _MESH.set(mesh)
  tok_r = _RULES.set(LOGICAL_AXIS_RULES if rules is None else tuple(rules))
  try:
    yield mesh
  finally:
    _MESH.reset(tok_m)
    _RULES.reset(tok_r)


def current_mesh() -> jax.sharding.Mesh | None:
  """The mesh set by the innermost `use_mesh`, or None outside one."""
  return _MESH.get()


def axis_size(name: str, mesh: jax.sharding.Mesh | None = None) -> int:
  """Size of mesh axis `name` in `mesh` (default: the active mesh); 1 without a mesh."""
  mesh = _MESH.get() if mesh is None else mesh
  if mesh is None:
    return 1
  return int(mesh.shape.get(name, 1))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names; identity when no mesh is active.

  Axes that do not divide the corresponding dimension are dropped (see `logical_to_spec`).
  """
  mesh = _MESH.get()
  if mesh is None:
    return x
  if len(names) != x.ndim:
    raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank "
                     f"{x.ndim} {x.shape}")
  spec = logical_to_spec(names, mesh=mesh, shape=x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ------------------------------------------------------------------------------ shardings


def _logical_names(var) -> tuple | None:
  meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = meta.get(key)
    if names:
      if isinstance(names, NamedSharding):
        names = tuple(names.spec)
      return tuple(names)
  return None


def spec_for(var_or_array, mesh: jax.sharding.Mesh, rules=None) -> P:
  """PartitionSpec of one nnx Variable (from its logical names) or array (replicated)."""
  from flax import nnx

  if isinstance(var_or_array, nnx.Variable):
    names = _logical_names(var_or_array)
    value = var_or_array.get_value() if hasattr(var_or_array, "get_value") else var_or_array
    shape = getattr(value, "shape", None)
    if names is None or shape is None:
      return P()
    if len(names) != len(shape):
      raise ValueError(f"variable of shape {shape} has {len(names)} logical names {names}")
    spec = logical_to_spec(names, rules=rules, mesh=mesh, shape=shape)
    return _place_dropped_axes(spec, names, shape, mesh, rules)
  return P()


ZERO_MIN_SIZE = 1 << 20  # elements; smaller variables (norm scales, biases) stay as the rules say


def _place_dropped_axes(spec: P, names, shape, mesh: jax.sharding.Mesh, rules=None) -> P:
  """Put the mesh axes the rules meant for this variable, but which did not divide the
  dimension they were meant for, on another dimension that they do divide (largest first).

  Variables of at least ZERO_MIN_SIZE elements also get the ZeRO axes (those of `embed`:
  fsdp, context, expert) even when none of their logical axes asks for them, e.g. the MLA
  up-projections [q_lora, heads, kv], whose logical axes map only to `tensor`.

  Storage sharding only (parameters and optimizer state, ZeRO-3 style): where the variable is
  used, GSPMD gathers it as the computation needs. Example: d_model = 7168 over fsdp x context
  x expert = 4 x 4 x 128 does not divide (7168 / 2048 = 3.5), so `embed` keeps fsdp x context
  and `expert` moves to the [.., 12288] heads dimension instead of replicating the weight (and
  its two Adam moments) 128 times.
  """
  if mesh is None:
    return spec
  rules = dict(_RULES.get() if rules is None else rules)
  used = {a for entry in spec for a in _as_tuple(entry)}
  wanted = []
  extra = ("embed",) if math.prod(shape) >= ZERO_MIN_SIZE else ()
  for name in tuple(names) + extra:
    if name is None:
      continue
    for a in _as_tuple(_rule_target(rules, name)):
      if a in mesh.shape and mesh.shape[a] > 1 and a not in used and a not in wanted:
        wanted.append(a)
  if not wanted:
    return spec
  entries = [list(_as_tuple(e)) for e in spec] + [[] for _ in range(len(shape) - len(spec))]
  for a in wanted:
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
      size = math.prod(mesh.shape[b] for b in entries[i]) * mesh.shape[a]
      if shape[i] % size == 0:
        entries[i].append(a)
        break
  return P(*[spec_entry(e) for e in entries])


def state_shardings(tree, mesh: jax.sharding.Mesh, rules=None):
  """NamedShardings for a (possibly abstract) nnx state / graph / pytree of Variables.

  Each `nnx.Variable` leaf maps its logical names (the `out_sharding` metadata set by
  `nnx.Param(..., out_sharding=names)` / `nnx.with_partitioning`, which `nnx.Optimizer` copies
  onto the Adam moments, and which scanned layers extend with "layers") through the rules table;
  other array leaves (step counters, RNG keys) are replicated. The result has the tree's
  structure with each Variable's value replaced by a NamedSharding, ready for `jax.jit`
  in/out_shardings or `jax.device_put`.
  """
  from flax import nnx

  def one(x):
    if isinstance(x, nnx.Variable):
      if not hasattr(x.get_value(), "shape"):  # optax's MaskedNode (Muon/AdamW partition)
        return x
      return x.replace(NamedSharding(mesh, spec_for(x, mesh, rules)))
    if hasattr(x, "shape"):
      return NamedSharding(mesh, P())
    return x

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def with_shardings(abstract_tree, shardings):
  """Attach shardings to an abstract tree: ShapeDtypeStruct leaves with `.sharding` set."""
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)


def batch_spec(mesh: jax.sharding.Mesh | None = None, ndim: int = 2) -> P:
  """Spec of a [B, T, ...] batch under the active rules: B over data*fsdp*expert, T over
  context (with `expert_shards="context"`: B over data*fsdp, T over expert*context)."""
  mesh = _MESH.get() if mesh is None else mesh
  return logical_to_spec(("activation_batch", "activation_length") + (None,) * (ndim - 2),
                         mesh=mesh)


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int = 2) -> NamedSharding:
  """NamedSharding of a [B, T(, ...)] batch (see `batch_spec`; call under `use_mesh(mesh,
  rules)` so that the layout's rules apply)."""
  return NamedSharding(mesh, batch_spec(mesh, ndim))


def batch_shardings(batch, mesh: jax.sharding.Mesh):
  """A pytree of batch shardings: rank >= 2 leaves as [B, T, ...], rank 1 over B, scalars
  replicated."""
  def one(x):
    nd = getattr(x, "ndim", len(getattr(x, "shape", ())))
    if nd >= 2:
      return batch_sharding(mesh, nd)
    if nd == 1:
      return NamedSharding(mesh, logical_to_spec(("activation_batch",), mesh=mesh))
    return NamedSharding(mesh, P())
  return jax.tree.map(one, batch)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  """A sharding that puts the whole array on every device of `mesh`."""
  return NamedSharding(mesh, P())


def shard_pytree(tree, shardings):
  """`jax.device_put` each leaf onto its sharding (trees of Variables are unwrapped)."""
  return jax.device_put(tree, shardings)
