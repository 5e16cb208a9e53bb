"""benchmarks/trace_summary.py: a kernel's scope is the innermost named scope of its op, read
from the compiled program's HLO when the trace event does not carry it."""

import jax
import jax.numpy as jnp

from benchmarks import trace_summary


def test_scopes_from_compiled_hlo_forward_and_backward():
  def f(x, w):
    with jax.named_scope("kda"):
      y = jnp.sin(x) * 2.0
    with jax.named_scope("moe"):
      return jnp.sum(jnp.tanh(y @ w))

  x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
  w = jnp.linspace(0.5, -0.5, 64).reshape(8, 8)
  hlo = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w).compile().as_text()
  ops = trace_summary.op_names_from_hlo(hlo)
  scopes = {trace_summary.scope_of({"op_name": v}) for v in ops.values()}
  assert {"kda", "moe"} <= scopes
  # the backward keeps the forward's scope; the innermost known scope wins
  assert trace_summary.scope_of({"a": "jit(step)/transpose(jvp(kda))/mul"}) == "kda"
  assert trace_summary.scope_of({"a": "jit(step)/moe/while/body/kda/dot_general"}) == "kda"
  assert trace_summary.scope_of({"a": "jit(step)/moe_extra/norms"}) == "other"
