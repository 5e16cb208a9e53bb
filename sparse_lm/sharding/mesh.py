"""Mesh construction and layout checks: `MeshLayout` (per-axis ICI and DCN sizes),
`make_mesh` (single slice or a hybrid ICI x DCN multislice mesh), `validate_layout` (the model,
batch and sequence divide over the mesh) and `check_topology` (a TPU slice shape that exists).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType

from sparse_lm.sharding.rules import (_RULES, EXPERT_SHARDS, MESH_AXES, _as_tuple,
                                      _rule_target, logical_axis_rules)

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
      ValueError: more than one -1 per group, or sizes that do not multiply to the devices;
        fewer than one device or slice.
    """
    for name, n in (("num_devices", num_devices), ("num_slices", num_slices)):
      if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"mesh layout: {name}={n!r} must be an int >= 1")
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
                       f"sizes {({prefix + a: v for a, v in sizes.items() if v != -1})}: use "
                       f"sizes whose product divides {total} (e.g. mesh=fsdp=-1), or run on "
                       "more devices (on a CPU host, XLA_FLAGS="
                       "--xla_force_host_platform_device_count=8 before jax is imported)")
    out[rest[0]] = total // known
  elif known != total:
    if prefix != "dcn_":
      fix = "set one axis to -1"
    elif known == 1:  # no dcn_* size given
      raise ValueError(
          f"the layout has no dcn_* sizes, but there are {total} {what}: give it sizes over "
          f"the slices (e.g. dcn_data=-1, or dcn_data={total}: data parallel across slices), "
          "or set num_slices=1")
    else:
      fix = ("set num_slices (stage field; `--num-slices` of launch.aot_plan) to their "
             "product, or drop the dcn_* sizes for one slice")
    raise ValueError(f"the sizes {({prefix + a: v for a, v in sizes.items() if v != 1 or prefix != 'dcn_'})} "
                     f"multiply to {known}, but there are {total} {what}; {fix}")
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


# The largest single slice of each TPU generation (chip dims, sorted) and whether it is a 3D
# torus. Larger jobs are multislice (DCN between slices, the `dcn_*` mesh sizes).
# Sources: Google Cloud TPU docs, "TPU v5p" / "TPU v4" / "TPU v5e" / "TPU v6e" topologies.
# TPU7x (Ironwood): 9,216 chips per pod (Google Cloud's TPU7x page), taken here as 16x24x24
# with v5p's rules (3D, 4x4x4 cubes); each chip is two JAX devices (`DEVICES_PER_CHIP`; seen in
# jax.experimental.topologies: "tpu7x:2x2x1" has 8 devices).
MAX_SLICE = {"v5p": (16, 16, 24), "v4": (16, 16, 16), "v5e": (16, 16), "v6e": (16, 16),
             "tpu7x": (16, 24, 24)}
DEVICES_PER_CHIP = {"tpu7x": 2}


def topology_devices(topology: str, num_slices: int = 1) -> int:
  """JAX devices of `num_slices` slices of `topology` (checked by `check_topology`): chips x
  devices per chip (two for tpu7x) x slices."""
  chips = check_topology(topology, num_slices)
  return chips * DEVICES_PER_CHIP.get(topology.partition(":")[0], 1) * num_slices


def check_topology(topology: str, num_slices: int = 1) -> int:
  """Check that `topology` ("v5p:8x16x16") is a slice shape Google offers; returns its chips.

  Rules: v5p / v4 / tpu7x slices are 3D, at most 16x16x24 (6,144 chips) / 16x16x16 (4,096
  chips) / 16x24x24 (9,216 chips, tpu7x's pod; two JAX devices per chip, `topology_devices`);
  from 4x4x4 (64 chips) up every dimension is a multiple of 4 (the 4x4x4 cube is the unit of
  the optical switch), below it the dimensions are 1, 2 or 4 (2x2x1 ... 2x4x4). v5e / v6e
  slices are 2D, at most 16x16 (256 chips), dimensions powers of two. More chips than one slice
  holds means `num_slices` slices over DCN.

  Raises:
    ValueError: naming the topology, what is wrong and the largest slice of that chip.
  """
  chip, _, dims_text = topology.partition(":")
  if chip not in MAX_SLICE:
    raise ValueError(f"topology={topology!r}: unknown TPU generation {chip!r}; known: "
                     f"{sorted(MAX_SLICE)}")
  try:
    dims = tuple(int(d) for d in dims_text.split("x"))
  except ValueError:
    raise ValueError(f"topology={topology!r}: expected e.g. '{chip}:"
                     f"{'x'.join(map(str, MAX_SLICE[chip]))}'") from None
  biggest = MAX_SLICE[chip]
  where = (f"topology={topology!r}: the largest {chip} slice is {'x'.join(map(str, biggest))} "
           f"({math.prod(biggest):,} chips); use more slices (num_slices, dcn_* mesh sizes)")
  if len(dims) != len(biggest):
    raise ValueError(f"topology={topology!r}: {chip} slices have {len(biggest)} dimensions")
  if any(d > m for d, m in zip(sorted(dims), biggest)) or min(dims) < 1:
    raise ValueError(where)
  chips = math.prod(dims)
  if len(dims) == 3 and chips >= 64:
    if any(d % 4 for d in dims):
      raise ValueError(f"topology={topology!r}: slices of 64 or more {chip} chips have every "
                       "dimension a multiple of 4")
  elif any(d & (d - 1) for d in dims):
    raise ValueError(f"topology={topology!r}: small {chip} slices have dimensions 1, 2, 4, ...")
  if num_slices < 1:
    raise ValueError(f"num_slices={num_slices} must be >= 1")
  return chips
