"""The import floors of the house (docs/architecture.md): nothing imports upward, no cycles.

Walks every `import` / `from ... import` statement (module level and inside functions) of the
project's packages with `ast`, without importing anything. A module may import its own floor
or lower ones. Floors, bottom to top:

  0  sparse_lm.config, sparse_lm.fs, sparse_lm.nn, sparse_lm.sharding, sparse_lm.distributed, sparse_lm.data
  1  pallas_kernels (never imports sparse_lm)
  2  sparse_lm.moe
  3  sparse_lm.vision (the image encoder the decoder composes, like its embedding table)
  4  sparse_lm.model
  5  sparse_lm.train, sparse_lm.inference, sparse_lm.interop
  6  sparse_lm.rl
  7  experiments, launch, benchmarks, notebooks, sparse_lm.generate (the generation CLI)

On top of the floors: the module graph and the package graph (sparse_lm.model, launch, ...)
have no cycles, so two packages of one floor never import each other both ways.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("sparse_lm", "pallas_kernels", "experiments", "launch", "benchmarks",
                "notebooks")

FLOORS = {
    "sparse_lm.config": 0, "sparse_lm.fs": 0, "sparse_lm.nn": 0, "sparse_lm.sharding": 0,
    "sparse_lm.distributed": 0, "sparse_lm.data": 0,
    "pallas_kernels": 1,
    "sparse_lm.moe": 2,
    "sparse_lm.vision": 3,
    "sparse_lm.model": 4,
    "sparse_lm.train": 5, "sparse_lm.inference": 5, "sparse_lm.interop": 5,
    "sparse_lm.rl": 6,
    "experiments": 7, "launch": 7, "benchmarks": 7, "notebooks": 7,
    "sparse_lm.generate": 7,  # the generation CLI
}


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for top in TOP_PACKAGES:
    for path in sorted((ROOT / top).rglob("*.py")):
      out[_module_name(path)] = path
  return out


MODULES = _modules()


def _unit(module: str) -> str:
  """The floor unit a module belongs to: the longest FLOORS key that is a prefix of it."""
  best = None
  for key in FLOORS:
    if module == key or module.startswith(key + "."):
      if best is None or len(key) > len(best):
        best = key
  if best is None:
    if module == "sparse_lm":
      return "sparse_lm.config"  # the empty package __init__
    raise AssertionError(f"{module} has no floor: add its package to FLOORS in "
                         "tests/test_import_floors.py (and to docs/architecture.md)")
  return best


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
  """(imported project module, line) for every import statement of the file."""
  tree = ast.parse(path.read_text(), str(path))
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      # `from pkg import name`: the submodule pkg.name when it exists, else pkg itself
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                 for a in node.names]
    else:
      continue
    for t in targets:
      if t.split(".")[0] in TOP_PACKAGES:
        while t and t not in MODULES:  # `import a.b.c` of a name inside a module
          t = t.rpartition(".")[0]
        if t:
          out.append((t, node.lineno))
  return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_floor():
  for m in MODULES:
    _unit(m)


def test_nothing_imports_upward():
  bad = []
  for m, imports in GRAPH.items():
    here = FLOORS[_unit(m)]
    for t, line in imports:
      if FLOORS[_unit(t)] > here:
        bad.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {t} "
                   f"(floor {FLOORS[_unit(t)]} > {here})")
  assert not bad, "upward imports:\n" + "\n".join(bad)


def test_pallas_kernels_never_import_sparse_lm():
  bad = [f"{m}: {t}" for m, imports in GRAPH.items() if m.startswith("pallas_kernels")
         for t, _ in imports if t.startswith("sparse_lm")]
  assert not bad, bad


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
  """One cycle of the directed graph (as a path a -> ... -> a), or None."""
  state, stack = {}, []

  def visit(n):
    state[n] = 1
    stack.append(n)
    for m in sorted(edges.get(n, ())):
      if state.get(m) == 1:
        return stack[stack.index(m):] + [m]
      if m not in state:
        found = visit(m)
        if found:
          return found
    stack.pop()
    state[n] = 2
    return None

  for n in sorted(edges):
    if n not in state:
      found = visit(n)
      if found:
        return found
  return None


def _package(module: str) -> str:
  """A module's package: its top package and, inside sparse_lm / pallas_kernels, the next
  level (sparse_lm.model, pallas_kernels.kda); the bottom-floor modules are one unit."""
  parts = module.split(".")
  if parts[0] in ("sparse_lm", "pallas_kernels") and len(parts) > 1:
    return ".".join(parts[:2])
  return parts[0]


def test_no_module_cycles():
  # A package's __init__ re-exporting its modules is not a cycle with those modules.
  edges = {m: {t for t, _ in imports if t != m and not m.startswith(t + ".")}
           for m, imports in GRAPH.items()}
  cycle = _cycle(edges)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_cycles():
  edges = {}
  for m, imports in GRAPH.items():
    for t, _ in imports:
      a, b = _package(m), _package(t)
      if a != b:
        edges.setdefault(a, set()).add(b)
  cycle = _cycle(edges)
  assert cycle is None, "packages import each other: " + " -> ".join(cycle)


@pytest.mark.parametrize("source, expected", [
    ("from sparse_lm.model import transformer\n", "imports sparse_lm.model.transformer"),
    ("import experiments.base\n", "imports experiments.base"),
])
def test_an_upward_import_is_reported(source, expected, tmp_path, monkeypatch):
  # The walker itself: a bottom-floor file importing the model or an experiment is caught.
  fake = ROOT / "sparse_lm" / "nn.py"
  monkeypatch.setitem(GRAPH, "sparse_lm.nn", _imports_of_source("sparse_lm.nn", fake, source,
                                                                  tmp_path))
  with pytest.raises(AssertionError, match=expected):
    test_nothing_imports_upward()


def _imports_of_source(module, path, source, tmp_path):
  f = tmp_path / path.name
  f.write_text(source)
  return _imports(module, f)
