"""Compile a stage's later programs on host threads while the device works (accelerators).

A stage runs four kinds of program: the train step, the eval step at the stage's length and at
twice it (the final held-out losses), and the sampler's prefill and decode (the end-of-stage
sample). Called in turn, each is traced and compiled when first needed, so the device idles
through every compile: on one H200 the README's tiny job spent 77 s of its 140 s compiling
(docs/benchmarks.md). XLA compiles on the host, so the compiles can overlap each other and the
device's work. `jax.jit(f).lower(*abstract).compile()` fills the same caches that a call of `f`
with arguments of those shapes and shardings reads, so the later call neither traces nor
compiles again (tests/train/test_precompile.py counts the compiles). Tracing and lowering (Python,
with libraries' global state) run one job at a time, in the order submitted (the train step,
the longest compile, first); the XLA compiles run side by side.

Numerics are untouched: the same programs run on the same inputs. A compile that fails here is
reported and left to the real call, which compiles (and raises) as it would have.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import traceback
from typing import Any, Callable

import jax

from sparse_lm.train.builder import batch_shapes
from sparse_lm.train.checkpoint import abstract_with_shardings


def abstract_batch(shapes: dict[str, tuple], shardings: dict) -> dict:
  """ShapeDtypeStructs of a batch: `shapes` {key: (shape, dtype name)} (see
  `builder.batch_shapes`), for the keys that have a sharding (the keys `loop._put` sends)."""
  return {k: jax.ShapeDtypeStruct(shapes[k][0], shapes[k][1], sharding=s)
          for k, s in shardings.items()}


class Precompiler:
  """Named jobs on host threads; `wait(name)` blocks until that job is done.

  `enabled=False` runs nothing (each program then compiles at its first call, as before).
  """

  def __init__(self, enabled: bool, label: str = ""):
    self.enabled = enabled
    self.label = label
    self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=4,
                                                        thread_name_prefix="precompile")
                  if enabled else None)
    self._jobs: dict[str, concurrent.futures.Future] = {}
    self._traced: threading.Event | None = None  # set when the last submitted job has traced

  def submit(self, name: str, trace: Callable[[], Any],
             then: Callable[[Any], Any] | None = None) -> None:
    """On a host thread: `trace()` once the previously submitted job's `trace` is done, then
    `then(trace's result)` beside the later jobs (nothing when disabled)."""
    if self._pool is None:
      return
    before, traced = self._traced, threading.Event()
    self._traced = traced

    def job():
      if before is not None:
        before.wait()
      try:
        out = trace()
      finally:
        traced.set()
      return then(out) if then is not None else out
    self._jobs[name] = self._pool.submit(job)

  def compile(self, name: str, jitted, *abstract_args) -> None:
    """Lower `jitted` for `abstract_args` (ShapeDtypeStructs), then compile it, on a host
    thread."""
    self.submit(name, lambda: jitted.lower(*abstract_args), lambda lowered: lowered.compile())

  def start(self, stage, parts, batch_shardings: dict, eval_rows: int,
            sample: Callable[[], Any] | None = None) -> None:
    """A stage's jobs, traced in this order: "train" (the train step for [global_batch,
    seq_len] batches), "eval" and "eval_2x" (the eval step for [eval_rows, seq_len] and
    [eval_rows, 2 * seq_len]; none when eval_rows is 0) and "sample" (`sample()`, when given;
    it traces as it runs, so it counts as tracing throughout). `parts`: `builder.Parts`."""
    if not self.enabled:
      return
    state = abstract_with_shardings(parts.abstract_state, parts.state_shardings)
    batch = lambda rows, seq_len: abstract_batch(batch_shapes(stage, rows, seq_len),
                                                 batch_shardings)
    self.compile("train", parts.train_step, state, batch(stage.global_batch, stage.seq_len))
    if eval_rows:
      self.compile("eval", parts.eval_step, state, batch(eval_rows, stage.seq_len))
      self.compile("eval_2x", parts.eval_step, state, batch(eval_rows, 2 * stage.seq_len))
    if sample is not None:
      self.submit("sample", sample)

  def wait(self, name: str) -> None:
    """Block until job `name` (if submitted) has finished; its error, if any, is printed."""
    job = self._jobs.pop(name, None)
    if job is None:
      return
    try:
      job.result()
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exception(e, file=sys.stderr)
      print(f"{self.label}precompile of {name} failed ({type(e).__name__}: {e}); it compiles "
            "at its first call instead", file=sys.stderr)

  def close(self) -> None:
    """Wait for the jobs still running (queued ones are dropped)."""
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None
