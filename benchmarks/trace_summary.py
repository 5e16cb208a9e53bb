"""Where a profiled step's device time goes, by the model's named scopes.

  python benchmarks/trace_summary.py TRACE_DIR [--steps N] [--top 15]

Reads the newest `perfetto_trace.json.gz` under TRACE_DIR (written by
`jax.profiler.trace(dir, create_perfetto_trace=True)`, e.g. by `benchmarks/train_step.py
--profile DIR`) and sums the device-track kernel time by the scope each kernel's op belongs to:
the `jax.named_scope`s the model and the train step set (`kda`, `mla`, `moe`, `dense_ffn`,
`attnres`, `norm`, `embed`, `vision`, `lm_head_loss`, `optimizer`, `balancer_update`). A
kernel's scope is the innermost of those names in its HLO op name (the profiler's event
arguments carry it); kernels whose arguments name none of them are "other". Forward and
backward of a scope are summed together (the backward's op names keep the forward's scopes).

Kernels inside an XLA command buffer (CUDA graph) may lose their op names in the trace: run the
profiled program with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` (train_step.py --profile does)
to attribute every kernel.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

SCOPES = ("kda", "mla", "moe", "dense_ffn", "attnres", "norm", "embed", "vision",
          "lm_head_loss", "optimizer", "balancer_update")


def load_events(trace_dir: str) -> tuple[list[dict], dict[int, str]]:
  """(events, {pid: process name}) of the newest perfetto trace under trace_dir.

  Raises:
    FileNotFoundError: no perfetto_trace.json.gz under trace_dir.
  """
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}: trace with "
                            "jax.profiler.trace(dir, create_perfetto_trace=True)")
  with gzip.open(paths[-1]) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return events, names


_SCOPE_RE = re.compile(r"(?:^|[/(])(" + "|".join(SCOPES) + r")(?=[/)]|$)")


def scope_of(args: dict) -> str:
  """The innermost known scope named in a kernel event's arguments, or "other"."""
  best, best_pos = "other", -1
  for value in args.values():
    if not isinstance(value, str):
      continue
    for m in _SCOPE_RE.finditer(value):
      if m.start(1) > best_pos:
        best, best_pos = m.group(1), m.start(1)
  return best


_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = ')
_COMP = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)')


def op_names_from_hlo(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: an op_name} from a compiled module's text
  (`jit(f).lower(...).compile().as_text()`): the fallback when trace events lack op names. An
  instruction without its own metadata (a fusion or custom call whose metadata was dropped)
  gets the first op_name found in the computations it calls."""
  own, calls, inside, comp = {}, {}, collections.defaultdict(list), None
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m is None:
      c = _COMP.match(line)
      if c is not None:
        comp = c.group(1)
      continue
    name = m.group(1)
    op = _OP_NAME.search(line)
    if op is not None:
      own[name] = op.group(1)
      if comp is not None:
        inside[comp].append(op.group(1))
    calls[name] = _CALLS.findall(line)

  def from_calls(name: str) -> str:
    for comp_name in calls.get(name, ()):
      if inside.get(comp_name):
        return inside[comp_name][0]
    return ""

  return {name: own.get(name) or from_calls(name) for name in calls}


def device_kernels(events: list[dict], names: dict[int, str]) -> list[dict]:
  """Complete events on accelerator device tracks (not the host's)."""
  pids = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name}
  return [e for e in events if e.get("ph") == "X" and e.get("pid") in pids]


def summarize(trace_dir: str, steps: int = 1, top: int = 15,
              hlo_text: str | None = None) -> str:
  """A text table: device ms per step and kernel count per scope, then the top kernels.
  `hlo_text` (the compiled program's text) names the scope of kernels whose trace events
  carry only the HLO instruction name ("hlo_op" argument or the event name).

  Raises:
    FileNotFoundError: no perfetto trace under trace_dir.
  """
  events, names = load_events(trace_dir)
  kernels = device_kernels(events, names)
  if not kernels:
    return f"no device kernel events in the trace under {trace_dir}"
  by_scope, count = collections.Counter(), collections.Counter()
  by_name, name_count, name_scope = collections.Counter(), collections.Counter(), {}
  op_names = op_names_from_hlo(hlo_text) if hlo_text else {}
  for e in kernels:
    args = e.get("args", {})
    s = scope_of(args)
    if s == "other" and op_names:
      hlo_op = args.get("hlo_op") or e["name"]
      s = scope_of({"op_name": op_names.get(hlo_op, "")})
    by_scope[s] += e.get("dur", 0)
    count[s] += 1
    by_name[e["name"]] += e.get("dur", 0)
    name_count[e["name"]] += 1
    name_scope.setdefault(e["name"], s)
  total = sum(by_scope.values())
  first, last = min(e["ts"] for e in kernels), max(e["ts"] + e.get("dur", 0) for e in kernels)
  lines = [f"device kernel time {total / 1e3 / steps:.2f} ms per step over {steps} step(s), "
           f"{len(kernels) / steps:.0f} kernels per step; first-to-last kernel span "
           f"{(last - first) / 1e3 / steps:.2f} ms per step",
           "| scope | ms per step | share | kernels per step |", "|---|---|---|---|"]
  for s, us in by_scope.most_common():
    lines.append(f"| {s} | {us / 1e3 / steps:.2f} | {100 * us / total:.1f}% | "
                 f"{count[s] / steps:.0f} |")
  lines.append(f"top {top} kernels (ms per step, calls per step, scope):")
  for name, us in by_name.most_common(top):
    lines.append(f"  {us / 1e3 / steps:8.3f}  {name_count[name] / steps:6.0f}  "
                 f"{name_scope[name]:<14s} {name[:90]}")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("trace_dir")
  p.add_argument("--steps", type=int, default=1, help="steps in the trace (divides totals)")
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--show-args", action="store_true",
                 help="print the arguments of the first 3 kernel events (to check scopes)")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1 (steps in the trace), got {args.steps}")
  try:
    if args.show_args:
      events, names = load_events(args.trace_dir)
      for e in device_kernels(events, names)[:3]:
        print(e["name"][:80], json.dumps(e.get("args", {}))[:600])
    print(summarize(args.trace_dir, args.steps, args.top))
  except FileNotFoundError as e:
    p.error(str(e))


if __name__ == "__main__":
  main()
