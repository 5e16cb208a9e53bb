"""What a jaxpr runs once its dead code is gone: for tests of remat policies (which ops the
backward pass recomputes)."""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.extend


def kernel_name(eqn) -> str | None:
  """A pallas_call's kernel name; None for any other equation."""
  return str(eqn.params["name"]) if eqn.primitive.name == "pallas_call" else None


def tile_calls(names, family: str) -> list[str]:
  """The names of a kernel that runs as one call per 16-row tile (pallas_gpu_wy names them
  <family>_t0, <family>_t1, ...) among `names`, in tile order; raises AssertionError unless
  they are _t0 ... _t{n-1}, n >= 1 (n = chunk size / 16)."""
  tiles = sorted({x for x in names if re.fullmatch(re.escape(family) + r"_t\d+", x)},
                 key=lambda x: int(x.rsplit("_t", 1)[1]))
  assert tiles and tiles == [f"{family}_t{i}" for i in range(len(tiles))], tiles
  return tiles


def primitive_named(*names: str) -> Callable:
  """A label function: the primitive's name when it is one of `names`, else None."""
  return lambda eqn: eqn.primitive.name if eqn.primitive.name in names else None


def live_calls(closed_jaxpr, label: Callable) -> list[str]:
  """label(eqn) of every equation whose results are read, once per call site, sub-jaxprs
  included; equations labelled None are left out.

  Walks backwards from the jaxpr's outputs, as XLA's dead-code pass does: XLA removes a
  Triton / Mosaic custom call whose results nobody reads (they are not marked
  side-effecting), while jax keeps every pallas_call in a jaxpr, so a count of the jaxpr's
  equations would include recomputations that never run. jit and remat bodies map their
  inputs and outputs one to one and are followed, and a scan's body once (the kernels of one
  iteration; its carries to a fixed point); any other equation with a sub-jaxpr (while,
  custom rules, a kernel body) counts as reading all its inputs, and all its sub-jaxprs'
  equations count.
  """

  def subs(eqn):
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield sub.jaxpr
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield sub

  def every(jaxpr):
    out = []
    for eqn in jaxpr.eqns:
      name = label(eqn)
      out += [name] if name is not None else []
      for sub in subs(eqn):
        out += every(sub)
    return out

  def live(jaxpr, used_outputs):
    need = {v for v, u in zip(jaxpr.outvars, used_outputs)
            if u and isinstance(v, jax.extend.core.Var)}
    out = []
    for eqn in reversed(jaxpr.eqns):
      used = [v in need for v in eqn.outvars]
      if not any(used) and not (eqn.effects and eqn.primitive.name != "pallas_call"):
        continue
      body = eqn.params.get("jaxpr")
      body = getattr(body, "jaxpr", body)
      if eqn.primitive.name in ("jit", "pjit", "remat2", "checkpoint") and body is not None:
        names, used_in = live(body, used)
        out += names
      elif eqn.primitive.name == "scan" and body is not None:
        names, used_in = live_scan(eqn, body, used)
        out += names
      else:
        name = label(eqn)
        out += [name] if name is not None else []
        for sub in subs(eqn):
          out += every(sub)
        used_in = [True] * len(eqn.invars)
      need |= {v for v, u in zip(eqn.invars, used_in)
               if u and isinstance(v, jax.extend.core.Var)}
    return out, [v in need for v in jaxpr.invars]

  def scan_counts(eqn):
    # jax <= 0.10 names the counts (num_consts, num_carry); jax 0.11 gives flat trees instead:
    # ft_in = (consts, carry, xs), ft_out = (carry, ys), one leaf per operand or result.
    if "num_consts" in eqn.params:
      return eqn.params["num_consts"], eqn.params["num_carry"]
    def group_sizes(ft):
      for attr in ("trees", "elts"):  # a tuple of flat trees (FTTuple)
        if hasattr(ft, attr):
          return [len(g) for g in getattr(ft, attr)]
      tree = getattr(ft, "treedef", None) or ft.tree  # one flat pytree (its PyTreeDef)
      return [c.num_leaves for c in tree.children()]
    ins, outs = group_sizes(eqn.params["ft_in"]), group_sizes(eqn.params["ft_out"])
    if len(ins) != 3 or sum(ins) != len(eqn.invars) or len(outs) != 2 or outs[0] != ins[1]:
      raise ValueError(f"scan's ft_in {ins} / ft_out {outs} (group sizes) do not read as "
                       f"(consts, carry, xs) / (carry, ys) for {len(eqn.invars)} operands: "
                       "teach tests/jaxpr_testlib.scan_counts this jax's scan")
    return ins[0], ins[1]

  def live_scan(eqn, body, used):
    # body: (consts, carry, xs) -> (carry, ys). A carry output is needed if the scan's result
    # is read or the next iteration reads that carry: iterate to a fixed point.
    n_consts, n_carry = scan_counts(eqn)
    carry_used = list(used[:n_carry])
    while True:
      names, used_in = live(body, carry_used + list(used[n_carry:]))
      more = [a or b for a, b in zip(carry_used, used_in[n_consts:n_consts + n_carry])]
      if more == carry_used:
        return names, used_in
      carry_used = more

  return live(closed_jaxpr.jaxpr, [True] * len(closed_jaxpr.jaxpr.outvars))[0]
