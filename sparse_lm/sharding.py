"""Mesh axes, the one table of logical-axis rules, meshes and state shardings (ARCHITECTURE §9).

Every parameter is created with logical axis names (`embed`, `heads`, `exp`, ...) and every
large activation is constrained with `constrain(x, names)`. This file is the only place those
names meet mesh axes. Without an active mesh (`use_mesh`), `constrain` is the identity, so the
model runs unchanged on one CPU.

Typical use (a train script):

    layout = MeshLayout.parse("fsdp=-1,expert=8,context=2")
    mesh = make_mesh(layout)
    validate_layout(cfg, layout, mesh, global_batch=256, seq_len=8192)
    with use_mesh(mesh, layout.rules):
      abstract = nnx.eval_shape(lambda: make_state(cfg))
      shardings = state_shardings(nnx.state(abstract), mesh)
      ...jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)), ...)

Mesh axes, outermost (slowest network) first:
  data    - pure data parallel (replicated params); across slices (DCN) usually.
  fsdp    - data parallel with parameters / optimizer state sharded (ZeRO-3).
  expert  - routed experts sharded; tokens exchanged by all-to-all (moe/expert_parallel.py).
            Outside the routed experts it is a batch axis (`expert_shards="batch"`, the
            default) or a second sequence axis (`expert_shards="context"`, for 1M-token
            stages whose few sequences per step cannot feed a large expert-parallel degree).
  tensor  - Megatron-style head / hidden sharding.
  context - sequence sharding for the 256K and 1M stages (model/context_parallel.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

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


# ------------------------------------------------------------------------------ layout


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """Per-axis device counts. ICI sizes within a slice (one may be -1 = "the rest"); DCN sizes
  across slices (multislice; their product is the number of slices, -1 allowed likewise).

  The mesh axis `a` has ici_a * dcn_a devices in total.
  """

  data: int = 1
  fsdp: int = -1
  expert: int = 1
  tensor: int = 1
  context: int = 1
  dcn_data: int = 1
  dcn_fsdp: int = 1
  dcn_expert: int = 1
  dcn_tensor: int = 1
  dcn_context: int = 1
  # What `expert` shards outside the routed experts: "batch" or "context" (see
  # `logical_axis_rules`).
  expert_shards: str = "batch"

  def __post_init__(self):
    if self.expert_shards not in EXPERT_SHARDS:
      raise ValueError(f"MeshLayout.expert_shards={self.expert_shards!r}: choose one of "
                       f"{EXPERT_SHARDS} ('context' shards the sequence over expert x context)")

  @property
  def rules(self) -> tuple:
    """The logical-axis rules of this layout: pass to `use_mesh(mesh, layout.rules)`."""
    return logical_axis_rules(self.expert_shards)

  @property
  def ici(self) -> dict[str, int]:
    return {a: getattr(self, a) for a in MESH_AXES}

  @property
  def dcn(self) -> dict[str, int]:
    return {a: getattr(self, "dcn_" + a) for a in MESH_AXES}

  @classmethod
  def parse(cls, text: str) -> "MeshLayout":
    """From "fsdp=-1,expert=8,dcn_data=2" (empty string = all devices on fsdp); the
    non-size field too: "fsdp=8,expert=128,context=8,expert_shards=context".

    Raises:
      ValueError: unknown axis name, a non-integer size or an unknown expert_shards.
    """
    kwargs = {}
    fields = {f.name for f in dataclasses.fields(cls)}
    for item in filter(None, (s.strip() for s in text.split(","))):
      key, _, val = item.partition("=")
      key = key.strip()
      if key not in fields:
        raise ValueError(f"mesh layout {text!r}: unknown axis {key!r}; valid: {sorted(fields)}")
      if key == "expert_shards":
        kwargs[key] = val.strip()
        continue
      try:
        kwargs[key] = int(val)
      except ValueError:
        raise ValueError(f"mesh layout {text!r}: size of {key!r} must be an int, got {val!r}")
    # fsdp keeps its default "-1 = the rest" only when no other axis claims the rest.
    if "fsdp" not in kwargs and -1 in [kwargs.get(a) for a in MESH_AXES]:
      kwargs["fsdp"] = 1
    return cls(**kwargs)

  def resolve(self, num_devices: int, num_slices: int = 1) -> tuple[dict, dict]:
    """Concrete (ici, dcn) sizes: replaces the -1s.

    Raises:
      ValueError: more than one -1 per group, or sizes that do not multiply to the devices.
    """
    if num_devices % num_slices:
      raise ValueError(f"{num_devices} devices do not split into {num_slices} slices")
    dcn = _fill(self.dcn, num_slices, "dcn_", "slices")
    ici = _fill(self.ici, num_devices // num_slices, "", "devices per slice")
    return ici, dcn

  def __str__(self) -> str:
    parts = [f"{a}={v}" for a, v in self.ici.items() if v != 1]
    parts += [f"dcn_{a}={v}" for a, v in self.dcn.items() if v != 1]
    if self.expert_shards != "batch":
      parts.append(f"expert_shards={self.expert_shards}")
    return ",".join(parts) or "single-device"


def _fill(sizes: dict[str, int], total: int, prefix: str, what: str) -> dict[str, int]:
  rest = [a for a, v in sizes.items() if v == -1]
  if len(rest) > 1:
    raise ValueError(f"only one axis may be -1 ('the rest'); got {[prefix + a for a in rest]}")
  for a, v in sizes.items():
    if v == 0 or v < -1:
      raise ValueError(f"{prefix}{a}={v}: sizes must be positive or -1")
  known = math.prod(v for v in sizes.values() if v != -1)
  out = dict(sizes)
  if rest:
    if total % known:
      raise ValueError(f"{total} {what} are not divisible by the product {known} of the fixed "
                       f"sizes {({prefix + a: v for a, v in sizes.items() if v != -1})}")
    out[rest[0]] = total // known
  elif known != total:
    raise ValueError(f"the sizes {({prefix + a: v for a, v in sizes.items()})} multiply to "
                     f"{known}, but there are {total} {what}; set one axis to -1")
  return out


def _num_slices(devices) -> int:
  ids = {getattr(d, "slice_index", 0) for d in devices}
  return max(len(ids), 1)


def make_mesh(layout: MeshLayout, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """A `Mesh` over MESH_AXES with Auto axis types (GSPMD propagates shardings).

  Multislice (any dcn size > 1): a hybrid mesh, each axis = (dcn part) x (ici part), so the
  DCN-crossing collectives are only those of the dcn axes (usually `data`).

  Args:
    layout: per-axis sizes.
    devices: default `jax.devices()`; may be AOT topology devices
      (`jax.experimental.topologies.get_topology_desc(...).devices`).
  Raises:
    ValueError: the layout does not match the device count.
  """
  from jax.experimental import mesh_utils

  devices = list(jax.devices() if devices is None else devices)
  num_slices = _num_slices(devices)
  if num_slices == 1 and -1 not in layout.dcn.values():
    # Devices without slice ids (CPU, GPU, tests): the dcn sizes say how to split them.
    num_slices = math.prod(layout.dcn.values())
  ici, dcn = layout.resolve(len(devices), num_slices)
  ici_shape = [ici[a] for a in MESH_AXES]
  dcn_shape = [dcn[a] for a in MESH_AXES]
  if num_slices > 1:
    if _num_slices(devices) == num_slices:
      arr = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices,
                                                 allow_split_physical_axes=True)
    else:  # devices without slice_index (CPU, tests): slices = consecutive device blocks
      arr = _manual_hybrid(ici_shape, dcn_shape, devices)
  else:
    try:
      arr = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
      arr = np.asarray(devices, dtype=object).reshape(ici_shape)
  return jax.sharding.Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _manual_hybrid(ici_shape, dcn_shape, devices) -> np.ndarray:
  n = len(ici_shape)
  per = math.prod(ici_shape)
  blocks = np.asarray(devices, dtype=object).reshape([math.prod(dcn_shape), per])
  arr = blocks.reshape(list(dcn_shape) + list(ici_shape))
  # interleave: axis a = (dcn_a, ici_a)
  arr = arr.transpose([j for i in range(n) for j in (i, n + i)])
  return arr.reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


def mesh_sizes(mesh: jax.sharding.Mesh | Mapping[str, int] | MeshLayout) -> dict[str, int]:
  """{axis: size} for a Mesh, a dict, or a fully resolved MeshLayout (ici * dcn)."""
  if isinstance(mesh, jax.sharding.Mesh):
    return {a: int(mesh.shape.get(a, 1)) for a in MESH_AXES}
  if isinstance(mesh, MeshLayout):
    if -1 in mesh.ici.values() or -1 in mesh.dcn.values():
      raise ValueError(f"layout {mesh} has -1 sizes; pass the mesh made from it")
    return {a: mesh.ici[a] * mesh.dcn[a] for a in MESH_AXES}
  return {a: int(mesh.get(a, 1)) for a in MESH_AXES}


def validate_layout(model_cfg, layout: MeshLayout | None = None,
                    mesh: jax.sharding.Mesh | Mapping[str, int] | None = None, *,
                    global_batch: int, seq_len: int, num_microbatches: int = 1,
                    rules=None) -> None:
  """Check at start-up that the model, batch and sequence divide over the mesh.

  Args:
    model_cfg: a `sparse_lm.config.ModelConfig`.
    layout: the requested layout (named in messages, and its rules are the default `rules`;
      may be None).
    mesh: the mesh (or {axis: size}); default the mesh made from `layout` on all devices.
    global_batch: sequences per optimizer step (all micro-batches).
    seq_len: tokens per sequence.
    num_microbatches: gradient-accumulation steps per optimizer step.
    rules: the logical-axis rules; default `layout.rules` when a layout is given, else the
      active rules. They say which mesh axes split the batch and the sequence.
  Raises:
    ValueError: listing every violated constraint, each naming the field and a fix.
  """
  if mesh is None:
    if layout is None:
      raise ValueError("validate_layout needs a layout or a mesh")
    mesh = make_mesh(layout)
  s = mesh_sizes(mesh)
  c = model_cfg
  errs: list[str] = []
  if rules is None:
    rules = layout.rules if layout is not None else _RULES.get()
  rules = dict(rules)
  batch_axes = tuple(a for a in _as_tuple(_rule_target(rules, "activation_batch")) if a in s)
  seq_axes = tuple(a for a in _as_tuple(_rule_target(rules, "activation_length")) if a in s)

  def need(value: int, field: str, axes: tuple[str, ...], what: str):
    n = math.prod(s[a] for a in axes)
    if n > 1 and value % n:
      ax = "*".join(f"{a}={s[a]}" for a in axes)
      errs.append(f"{field}={value} is not divisible by {ax}{' (= ' + str(n) + ')' if len(axes) > 1 else ''}"
                  f" ({what}); change {field} or the {'/'.join(axes)} mesh size")

  need(c.kda_num_heads, "kda_num_heads", ("tensor",), "KDA heads are sharded over tensor")
  need(c.mla_num_heads, "mla_num_heads", ("tensor",), "MLA heads are sharded over tensor")
  need(c.vocab_size, "vocab_size", ("tensor",), "the LM head is sharded over tensor")
  need(c.expert_hidden, "expert_hidden", ("tensor",), "expert FFN hidden is sharded over tensor")
  need(c.dense_hidden, "dense_hidden", ("tensor",), "dense FFN hidden is sharded over tensor")
  need(c.num_experts, "num_experts", ("expert",), "routed experts are sharded over expert")
  need(c.d_model, "d_model", ("fsdp",), "parameters are sharded over fsdp along d_model")
  need(c.moe_latent_dim, "moe_latent_dim", ("fsdp",), "expert weights are sharded over fsdp "
       "along the latent width")
  if num_microbatches < 1 or global_batch % num_microbatches:
    errs.append(f"global_batch={global_batch} is not divisible by num_microbatches="
                f"{num_microbatches}")
  else:
    need(global_batch // num_microbatches, "global_batch/num_microbatches" if
         num_microbatches > 1 else "global_batch", batch_axes,
         f"each micro-batch is split over {'*'.join(batch_axes)}"
         + ("; with few long sequences, MeshLayout(expert_shards='context') splits the "
            "sequence over expert instead" if "expert" in batch_axes and s["expert"] > 1
            else ""))
  n_seq = math.prod(s[a] for a in seq_axes)
  if n_seq > 1:
    need(seq_len, "seq_len", seq_axes, f"the sequence is sharded over {'*'.join(seq_axes)}")
    if seq_len % n_seq == 0 and (seq_len // n_seq) < c.kda_conv_size - 1:
      errs.append(f"seq_len={seq_len} over {'*'.join(seq_axes)}={n_seq} leaves fewer than "
                  f"{c.kda_conv_size - 1} tokens per shard (the short-conv halo)")
  if s["expert"] > 1 and c.num_experts < s["expert"]:
    errs.append(f"num_experts={c.num_experts} < expert={s['expert']}: every expert rank needs "
                "at least one expert")
  if errs:
    where = f" on mesh {s}" + (f" (layout {layout})" if layout is not None else "")
    raise ValueError(f"ModelConfig({c.name}){where}:\n  " + "\n  ".join(errs))


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
  return NamedSharding(mesh, P())


def shard_pytree(tree, shardings):
  """`jax.device_put` each leaf onto its sharding (trees of Variables are unwrapped)."""
  return jax.device_put(tree, shardings)


# ------------------------------------------------------------------------------ host feeding


def process_rows(sharding: jax.sharding.Sharding, global_shape: Sequence[int], *,
                 process_index: int | None = None) -> tuple[int, int]:
  """Which rows of a [B, T, ...] global batch this process must load: (shard, num_shards).

  The rows of B are split into `num_shards` equal groups; this process loads group `shard`
  (B / num_shards rows, every T) and passes them to
  `jax.make_array_from_process_local_data(sharding, rows, global_shape)`, which takes the
  T-slices its devices hold. Processes whose devices hold the same rows (a sequence split over
  several hosts, e.g. `context` or `expert_shards="context"` wider than the chips of a host)
  get the same shard and must load identical rows (the data pipeline is deterministic per
  shard); processes with disjoint rows get disjoint shards. One process: (0, 1).

  Args:
    sharding: the batch's sharding (e.g. `batch_sharding(mesh)`), over all processes' devices.
    global_shape: (B, T, ...).
    process_index: default `jax.process_index()`.
  Raises:
    ValueError: the processes' row sets overlap without being equal, or differ in size (a
      mesh whose hosts do not tile the batch rows; reorder the mesh axes or change sizes).
  """
  index_map = sharding.devices_indices_map(tuple(global_shape))
  me = jax.process_index() if process_index is None else process_index
  return row_groups({d: idx[0] for d, idx in index_map.items()},
                    {d: d.process_index for d in index_map}, int(global_shape[0]), me)


def row_groups(rows_of_device: Mapping[Any, slice], process_of_device: Mapping[Any, int],
               num_rows: int, process: int) -> tuple[int, int]:
  """The pure part of `process_rows`: from each device's row slice and process,
  (`process`'s group, number of groups); see `process_rows`."""
  sets: dict[int, set] = {}
  for d, rows in rows_of_device.items():
    start, stop, _ = rows.indices(num_rows)
    sets.setdefault(process_of_device[d], set()).add((start, stop))
  if process not in sets:
    raise ValueError(f"process {process} holds none of the batch's devices")
  groups = sorted({tuple(sorted(v)) for v in sets.values()})
  sizes = {sum(b - a for a, b in g) for g in groups}
  covered = sorted(r for g in groups for r in g)
  overlap = any(a[1] > b[0] for a, b in zip(covered, covered[1:]))
  if len(sizes) != 1 or overlap or sum(b - a for a, b in covered) != num_rows:
    raise ValueError(
        f"the processes' batch rows do not split the {num_rows} rows into equal disjoint "
        f"groups (row sets {groups[:4]}{'...' if len(groups) > 4 else ''}); reorder or resize "
        "the mesh axes so that each host's devices hold whole row groups")
  return groups.index(tuple(sorted(sets[process]))), len(groups)
