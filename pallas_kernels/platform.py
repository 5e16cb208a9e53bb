"""What the backends' "auto" choices read about a device, parsed once here."""

from __future__ import annotations


def compute_capability(device) -> float:
  """An NVIDIA GPU's compute capability as a number (9.0 = Hopper, 10.0 = Blackwell).

  Args: device: a `jax.Device` (or any object with `platform` and, on GPUs,
    `compute_capability`, e.g. "9.0").
  Returns: the capability; 0.0 for a device that is not a GPU, or whose capability is missing
    or not a number (such a device never gets a Hopper-only kernel). Raises nothing.
  """
  if getattr(device, "platform", None) != "gpu":
    return 0.0
  try:
    return float(getattr(device, "compute_capability", "0"))
  except (TypeError, ValueError):
    return 0.0
