"""What a run reports while it trains: TensorBoard events, a JSONL log and a progress bar.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s of the devices, with the
model FLOPs per token from `sparse_lm.model.params.flops_per_token` (6·N_active plus attention,
forward + backward) and the peak from the table below (dense bf16). Unknown devices (CPU) have
no peak: MFU is reported as n/a unless a peak is given.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any, Mapping

import jax
import numpy as np

# Dense bf16 peak FLOP/s per device (vendor data sheets).
PEAK_FLOPS = {
    "h200": 989e12, "h100": 989e12, "a100": 312e12, "b200": 2250e12, "gb200": 2500e12,
    "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12, "tpu v5p": 459e12,
    "tpu v5": 459e12, "tpu v6 lite": 918e12, "tpu v6e": 918e12, "tpu7x": 2307e12,
}


def peak_flops_per_device(device: jax.Device | None = None) -> float | None:
  """Dense bf16 peak FLOP/s of `device` (default the first device), or None if unknown."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "").lower()
  for key in sorted(PEAK_FLOPS, key=len, reverse=True):
    if key in kind:
      return PEAK_FLOPS[key]
  return None


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int,
        peak_per_device: float | None) -> float | None:
  """Model FLOPs utilisation in [0, 1], or None without a known peak."""
  if not peak_per_device or not flops_per_token:
    return None
  return tokens_per_s * flops_per_token / (num_devices * peak_per_device)


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  out = {}
  for k, v in metrics.items():
    a = np.asarray(v)
    if a.size == 1:
      out[k] = float(a.reshape(()))
  return out


class MetricsWriter:
  """TensorBoard (tensorboardX) events plus a `metrics.jsonl` line per logged step."""

  def __init__(self, logdir: str | pathlib.Path, enabled: bool = True):
    self.logdir = pathlib.Path(logdir)
    self.enabled = enabled and jax.process_index() == 0
    self._tb = None
    self._jsonl = None
    if self.enabled:
      from tensorboardX import SummaryWriter
      self.logdir.mkdir(parents=True, exist_ok=True)
      self._tb = SummaryWriter(str(self.logdir))
      self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8")

  def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
    """Scalars go to TensorBoard and the JSONL; per-layer vectors as `name/layer_i` scalars
    (vectors longer than 64, e.g. per-expert loads, as histograms)."""
    if not self.enabled:
      return
    record = {"step": int(step)}
    for k, v in metrics.items():
      a = np.asarray(v, dtype=np.float64)
      name = prefix + k
      if a.size == 1:
        value = float(a.reshape(()))
        self._tb.add_scalar(name, value, step)
        record[name] = value if math.isfinite(value) else str(value)
      elif a.ndim == 1 and a.size <= 64:
        for i, x in enumerate(a):
          self._tb.add_scalar(f"{name}/layer_{i}", float(x), step)
      else:
        self._tb.add_histogram(name, a.reshape(-1), step)
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()

  def text(self, tag: str, text: str, step: int) -> None:
    if self.enabled:
      self._tb.add_text(tag, text, step)

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


class Progress:
  """A rich progress bar: step, loss, tokens/s, MFU, expert max-violation, ETA."""

  def __init__(self, total: int, start: int, description: str, enabled: bool = True):
    self.enabled = enabled and jax.process_index() == 0
    self._bar = None
    if self.enabled:
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                 TextColumn, TimeRemainingColumn)
      self._bar = RichProgress(
          TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
          TextColumn("{task.fields[stats]}"), TextColumn("ETA"), TimeRemainingColumn(),
          refresh_per_second=2)
      self._bar.start()
      self._task = self._bar.add_task(description, total=total, completed=start, stats="")

  def update(self, step: int, loss: float, tokens_per_s: float, mfu_value: float | None,
             max_violation: float | None) -> None:
    if not self.enabled:
      return
    stats = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  MFU "
    stats += f"{100 * mfu_value:.1f}%" if mfu_value is not None else "n/a"
    if max_violation is not None:
      stats += f"  max-viol {max_violation:.2f}"
    self._bar.update(self._task, completed=step, stats=stats)

  def print(self, *args) -> None:
    """Print above the bar (plain print when the bar is off; host 0 only)."""
    if self.enabled:
      self._bar.console.print(*args, markup=False, highlight=False)
    elif jax.process_index() == 0:
      print(*args, flush=True)

  def close(self) -> None:
    if self.enabled:
      self._bar.stop()


class Throughput:
  """Tokens/s over the steps since the last call (excludes the first, compiling, step)."""

  def __init__(self):
    self._t = None
    self._steps = 0

  def tick(self, steps: int = 1) -> None:
    if self._t is None:
      self._t = time.perf_counter()
      return
    self._steps += steps

  def rate(self, tokens_per_step: int) -> float:
    if self._t is None or not self._steps:
      return 0.0
    return self._steps * tokens_per_step / max(time.perf_counter() - self._t, 1e-9)
