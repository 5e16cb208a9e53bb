"""What a run reports while it trains: TensorBoard events, a JSONL log and a progress bar.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s of the devices, with the
model FLOPs per token from `sparse_lm.model.params.flops_per_token` (6·N_active plus attention,
forward + backward) and the peak from the table below (dense bf16). Unknown devices (CPU) have
no peak: MFU is reported as n/a unless a peak is given.

Routing health (`routing_summary`), for every balancer: the worst MoE layer's max/mean expert
load and fraction of dead experts (no token routed to them in the step), and the expert-parallel
drop rate when the step reports one (`moe/drop_rate`: the fraction of routed token-expert pairs
dropped by a receive cap). They are in every progress line and every `metrics.jsonl` record;
`Alerts` sets the values past which the run warns.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np
from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                           TimeRemainingColumn)


def _import_tensorboardx():
  """tensorboardX's SummaryWriter and summary builders, without importing PyTorch.

  tensorboardX's writer imports torch when it is installed, only so that it can accept torch
  tensors; this module logs Python floats and NumPy arrays. On an image with PyTorch that
  import took 5.0 of the 7.1 s of `import experiments.stage_8k` (H200, 2026-12-01,
  `python -X importtime`). So `torch` is hidden while tensorboardX loads, unless it is already
  imported (then nothing is hidden and nothing is saved).
  """
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import summary_pb2  # pylint: disable=g-import-not-at-top
  finally:
    if hide and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter, summary, summary_pb2


SummaryWriter, _tb_summary, _summary_pb2 = _import_tensorboardx()

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


def drop_lines_after(path: pathlib.Path, step: int) -> int:
  """Rewrite the JSONL file `path` (atomically: a temporary file, then os.replace) without the
  lines whose "step" is > step; lines without a step are kept. Returns how many were dropped
  (0, and nothing written, when the file is missing or has none)."""
  if not path.exists():
    return 0
  keep, dropped = [], 0
  for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
    try:
      later = int(json.loads(line).get("step", -1)) > step
    except (ValueError, AttributeError, TypeError):
      later = False
    if later:
      dropped += 1
    else:
      keep.append(line)
  if dropped:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
  return dropped


class MetricsWriter:
  """TensorBoard (tensorboardX) events plus a `metrics.jsonl` line per logged step
  (`<stage_dir>/tb/metrics.jsonl`: one JSON object per line, "step" and every scalar, e.g.
  "train/loss", "train/moe/max_mean_load", "eval/loss").

  after_step: a run resumed from the checkpoint of that step. The lines a killed run wrote
  past it are dropped from metrics.jsonl (rewritten atomically), and TensorBoard is told to
  purge its events past it, so the steps the resumed run repeats are not logged twice.
  """

  def __init__(self, logdir: str | pathlib.Path, enabled: bool = True,
               after_step: int | None = None):
    self.logdir = pathlib.Path(logdir)
    self.enabled = enabled and jax.process_index() == 0
    self._tb = None
    self._jsonl = None
    if self.enabled:
      self.logdir.mkdir(parents=True, exist_ok=True)
      purge = None
      if after_step is not None:
        drop_lines_after(self.logdir / "metrics.jsonl", after_step)
        purge = after_step + 1
      self._tb = SummaryWriter(str(self.logdir), purge_step=purge)
      self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8")

  def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
    """Scalars go to TensorBoard and the JSONL; per-layer vectors as `name/layer_i` scalars
    (vectors longer than 64, e.g. per-expert loads, as histograms)."""
    if not self.enabled:
      return
    record = {"step": int(step)}
    values = []  # every scalar of the step in one event (one per add_scalar cost 0.3 ms each)
    for k, v in metrics.items():
      if isinstance(v, str):
        record[prefix + k] = v
        continue
      a = np.asarray(v, dtype=np.float64)
      name = prefix + k
      if a.size == 1:
        value = float(a.reshape(()))
        values.extend(_tb_summary.scalar(name, value).value)
        record[name] = value if math.isfinite(value) else str(value)
      elif a.ndim == 1 and a.size <= 64:
        for i, x in enumerate(a):
          values.extend(_tb_summary.scalar(f"{name}/layer_{i}", float(x)).value)
      else:
        self._tb.add_histogram(name, a.reshape(-1), step)
    if values:
      self._tb._get_file_writer().add_summary(  # pylint: disable=protected-access
          _summary_pb2.Summary(value=values), step)
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()

  def text(self, tag: str, text: str, step: int) -> None:
    if self.enabled:
      self._tb.add_text(tag, text, step)

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


@dataclasses.dataclass(frozen=True)
class Alerts:
  """Thresholds past which a run warns (at most once per eval interval each).

  max_mean_load: the worst layer's max/mean expert load (1 = perfectly balanced; a collapsed
    router reaches E/k). dead_frac: the worst layer's fraction of experts that got no token.
    drop_rate: the expert-parallel drop rate (total over layers; default 1%).
  """

  max_mean_load: float = 2.0
  dead_frac: float = 0.25
  drop_rate: float = 0.01


def _per_layer(metrics: Mapping[str, Any], name: str) -> dict[str, float]:
  """{layer name: value} of the per-layer entries of `name`: an array `name` [layers] (MoE
  layers in order), `name_per_layer`, or scalars `name/<layer>`."""
  out = {}
  for key, value in metrics.items():
    a = np.asarray(value, np.float64)
    if key in (name, f"{name}_per_layer") and a.ndim == 1 and a.size > 0:
      out.update({f"MoE layer {i}": float(x) for i, x in enumerate(a)})
    elif key.startswith(name + "/") and a.size == 1:
      out[key[len(name) + 1:]] = float(a.reshape(()))
  return out


def routing_summary(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """The routing health of one step from its metrics (host numpy values).

  Returns (keys present only when the step reports MoE metrics):
    "moe/max_mean_load", "moe/max_mean_load_layer": the worst layer's max/mean expert load
      (from `moe/load` [layers, E], else `moe/max_violation` [layers]) and its name;
    "moe/dead_frac_max", "moe/dead_frac_layer": the worst layer's dead-expert fraction;
    "moe/drop_rate_total", "moe/drop_rate_layer", "moe/drop_rate_worst": the expert-parallel
      drop rate (`moe/drop_rate` as a scalar total, else the mean of its per-layer values; every
      layer routes the same token-expert pairs) and the layer that drops most, when the step
      has a drop rate.
  """
  out: dict[str, Any] = {}
  load = metrics.get("moe/load")
  if load is not None and np.size(load):
    load = np.asarray(load, np.float64)
    load = load.reshape(-1, load.shape[-1])
    mean = load.mean(-1)
    ratio = np.where(mean > 0, load.max(-1) / np.where(mean > 0, mean, 1.0), 0.0)
    dead = (load == 0).mean(-1)
    worst = int(np.argmax(ratio))
    out["moe/max_mean_load"], out["moe/max_mean_load_layer"] = float(ratio[worst]), \
        f"MoE layer {worst}"
    worst = int(np.argmax(dead))
    out["moe/dead_frac_max"], out["moe/dead_frac_layer"] = float(dead[worst]), \
        f"MoE layer {worst}"
  else:
    for key, name in (("moe/max_violation", "moe/max_mean_load"),
                      ("moe/dead_frac", "moe/dead_frac_max")):
      layers = _per_layer(metrics, key)
      if layers:
        worst = max(layers, key=layers.get)
        out[name] = layers[worst]
        out[name.replace("_max", "") + "_layer"] = worst
  drop = metrics.get("moe/drop_rate")
  layers = _per_layer(metrics, "moe/drop_rate")
  if drop is not None and np.size(drop) == 1:
    out["moe/drop_rate_total"] = float(np.asarray(drop).reshape(()))
  elif layers:
    out["moe/drop_rate_total"] = float(np.mean(list(layers.values())))
  if layers:
    worst = max(layers, key=layers.get)
    out["moe/drop_rate_layer"], out["moe/drop_rate_worst"] = worst, layers[worst]
  return out


def routing_warnings(summary: Mapping[str, Any], alerts: Alerts) -> list[tuple[str, str]]:
  """[(kind, message)] for each value of `routing_summary` past its `alerts` threshold."""
  out = []
  if summary.get("moe/max_mean_load", 0.0) > alerts.max_mean_load:
    out.append(("load", f"routing imbalance: max/mean expert load "
                f"{summary['moe/max_mean_load']:.2f} > {alerts.max_mean_load:g} in "
                f"{summary['moe/max_mean_load_layer']} (check the balancer)"))
  if summary.get("moe/dead_frac_max", 0.0) > alerts.dead_frac:
    out.append(("dead", f"dead experts: {100 * summary['moe/dead_frac_max']:.1f}% of the "
                f"experts of {summary['moe/dead_frac_layer']} got no token "
                f"(> {100 * alerts.dead_frac:g}%)"))
  if summary.get("moe/drop_rate_total", 0.0) > alerts.drop_rate:
    where = (f"; most in {summary['moe/drop_rate_layer']} "
             f"({100 * summary['moe/drop_rate_worst']:.2f}%)"
             if "moe/drop_rate_layer" in summary else "")
    out.append(("drop", f"expert-parallel drop rate {100 * summary['moe/drop_rate_total']:.2f}%"
                f" > {100 * alerts.drop_rate:g}%{where}: raise model.ragged_buffer_factor "
                "(None = dropless)"))
  return out


def _clock(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def stats_text(loss: float, tokens_per_s: float, mfu_value: float | None,
               routing: Mapping[str, Any]) -> str:
  """`loss 4.1234  12,345 tok/s  MFU n/a  drop 0.00%  max/mean load 1.31  dead 0.0%`; before
  any timed step (`tokens_per_s` 0: the first step of a run compiles) `tok/s n/a`."""
  speed = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s > 0 else "tok/s n/a"
  text = f"loss {loss:.4f}  {speed}  MFU "
  text += f"{100 * mfu_value:.1f}%" if mfu_value is not None else "n/a"
  if "moe/drop_rate_total" in routing:
    text += f"  drop {100 * routing['moe/drop_rate_total']:.2f}%"
  if "moe/max_mean_load" in routing:
    text += f"  max/mean load {routing['moe/max_mean_load']:.2f}"
  if "moe/dead_frac_max" in routing:
    text += f"  dead {100 * routing['moe/dead_frac_max']:.1f}%"
  return text


class Progress:
  """Feedback while training: a rich progress bar on a terminal; otherwise (Slurm, pods,
  `> log`, or `bar=False`) a plain line every `every` steps:
  `[stage] step 120/500  loss ...  tok/s  MFU  drop  max/mean load  dead  ETA 0:03:12`."""

  def __init__(self, total: int, start: int, description: str, enabled: bool = True, *,
               every: int = 50, stream=None):
    self.primary = jax.process_index() == 0
    self.enabled = enabled and self.primary and (stream or sys.stdout).isatty()
    self.total, self.every, self.description = total, max(1, every), description
    self._stream = stream
    self._bar = None
    self._t0: tuple[float, int] | None = None
    if self.enabled:
      self._bar = RichProgress(
          TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
          TextColumn("{task.fields[stats]}"), TextColumn("ETA"), TimeRemainingColumn(),
          refresh_per_second=2)
      self._bar.start()
      self._task = self._bar.add_task(description, total=total, completed=start, stats="")

  def eta(self, step: int) -> float | None:
    """Seconds left at the mean pace since the first update (None before two updates)."""
    now = time.perf_counter()
    if self._t0 is None:
      self._t0 = (now, step)
      return None
    t0, s0 = self._t0
    if step <= s0:
      return None
    return (now - t0) / (step - s0) * (self.total - step)

  def update(self, step: int, loss: float, tokens_per_s: float, mfu_value: float | None,
             routing: Mapping[str, Any] | None = None) -> None:
    """`step` steps done; prints a plain line when the bar is off and `step` is a multiple
    of `every` (or the last)."""
    eta = self.eta(step)
    stats = stats_text(loss, tokens_per_s, mfu_value, routing or {})
    if self.enabled:
      self._bar.update(self._task, completed=step, stats=stats)
    elif self.primary and (step % self.every == 0 or step == self.total):
      self.print(f"[{self.description}] step {step}/{self.total}  {stats}  ETA "
                 + (_clock(eta) if eta is not None else "?"))

  def print(self, *args) -> None:
    """Print above the bar (plain print when the bar is off; host 0 only)."""
    if self.enabled:
      self._bar.console.print(*args, markup=False, highlight=False)
    elif self.primary:
      print(*args, flush=True, file=self._stream or sys.stdout)

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
