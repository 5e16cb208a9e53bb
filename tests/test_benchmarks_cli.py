"""The benchmark scripts' command lines on a CPU: a bad argument is refused by name (exit 2,
the valid values listed) before anything is compiled, a script that needs a GPU says so in one
line with exit 2 instead of failing inside a kernel's lowering, and the printed tables label
what they measure. Each case here stops before a compile (or compiles a few-ms program)."""

import os
import re
import subprocess
import sys

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(module, *argv, timeout=120):
  """Run `python -m benchmarks.<module> argv` on the CPU; (returncode, stdout, stderr)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *argv], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
  return out.returncode, out.stdout, out.stderr


def _refused(main, argv, capsys) -> str:
  """main(argv) exits with argparse's status 2; its error line."""
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2, e.value.code
  err = capsys.readouterr().err
  return err.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# benchmarks/kda.py


@pytest.mark.parametrize("argv, match", [
    # an unknown backend: the flag and every valid name (it printed "unknown backends ['foo']")
    (["--backends", "xla,foo"], r"--backends 'xla,foo': unknown foo; expected a comma list of "
                                r"xla, xla_safe, .*pallas_gpu.*, fla, sdpa"),
    (["--backends", ","], r"--backends ',': no backend given"),
    # an empty shape list (it ended in an IndexError after timing nothing)
    (["--backends", "xla", "--shapes", ";"], r"--shapes ';': no shape given"),
    (["--backends", "xla", "--shapes", ""], r"--shapes '': no shape given"),
    (["--backends", "xla", "--shapes", "1,2,256"], r"--shapes '1,2,256': expected four"),
    # no repeats: every cell read "error" (StatisticsError: no median for empty data)
    (["--backends", "xla", "--shapes", "1,2,64,16", "--repeats", "0"], r"--repeats 0"),
    (["--backends", "xla", "--shapes", "1,2,64,16", "--warmup", "-1"], r"--warmup -1"),
])
def test_kda_bad_arguments_are_refused_by_name(argv, match, capsys):
  from benchmarks import kda
  assert re.search(match, _refused(kda.main, argv, capsys))


@pytest.mark.skipif(ON_GPU, reason="the pallas_gpu backend runs on a GPU")
def test_kda_check_against_a_backend_that_cannot_run_here_is_refused(capsys):
  """--check-against pallas_gpu on a CPU: one line and exit 2 (it raised SkipBackend with a
  traceback)."""
  from benchmarks import kda
  line = _refused(kda.main, ["--backends", "xla", "--shapes", "1,2,64,16",
                             "--check-against", "pallas_gpu"], capsys)
  assert "--check-against pallas_gpu: cannot run here (needs a GPU)" in line


@pytest.mark.skipif(ON_GPU, reason="the pallas_gpu backend runs on a GPU")
def test_kda_profile_skips_a_backend_that_cannot_run_here(tmp_path, capsys):
  """--profile with a backend that cannot run here names it and goes on (it ended in a
  SkipBackend traceback); nothing is compiled for it."""
  from benchmarks import kda
  kda.main(["--backends", "pallas_gpu,fla", "--profile", str(tmp_path),
            "--profile-shape", "1,2,64,16"])
  err = capsys.readouterr().err
  assert "pallas_gpu: not profiled (skipped: needs a GPU)" in err
  assert "fla: not profiled (torch)" in err


def test_kda_table_labels_a_shape_with_another_head_dim():
  """Two shapes differing only in D: the title gives the first shape's K=V, so the other
  column says its own (both columns read "H=2 T=256" under "K=V=64" before)."""
  from benchmarks import kda
  shapes = [(1, 2, 256, 64), (1, 2, 256, 32), (2, 2, 1024, 64)]
  rows = {("xla", s): (1.0, 2.0) for s in shapes}
  table = kda._table(["xla"], shapes, rows, {})
  assert "B=1, K=V=64;" in table
  assert "| backend | pass | H=2 T=256 | H=2 T=256 K=V=32 | B=2 H=2 T=1K |" in table


def test_kda_out_file_is_the_printed_table(tmp_path):
  """A tiny CPU run: --out holds the markdown table the run printed, and each printed time is
  the stderr progress line's."""
  out = tmp_path / "kda.md"
  rc, stdout, stderr = _cli("kda", "--backends", "xla", "--shapes", "1,1,64,16", "--warmup",
                            "0", "--repeats", "1", "--out", str(out))
  assert rc == 0, stderr[-3000:]
  assert out.read_text() == stdout
  m = re.search(r"xla +B=1 H=1 T=64 D=16: ([0-9.]+), ([0-9.]+)", stderr)
  assert m, stderr
  assert f"| xla | fwd | {m.group(1)} |" in stdout
  assert f"| xla | fwd+bwd | {m.group(2)} |" in stdout


# ---------------------------------------------------------------------------------------------
# benchmarks/train_step.py


@pytest.mark.parametrize("argv, match", [
    # 0 meant "the default" for --batch and --seq-len (`args.batch or ...`): a run of another
    # shape than asked; --steps 0 divided by zero after the compile
    (["--batch", "0"], r"--batch 0: expected a positive integer"),
    (["--seq-len", "0"], r"--seq-len 0: expected a positive integer"),
    (["--steps", "0"], r"--steps 0: expected a positive integer"),
    (["--micro-batches", "0"], r"--micro-batches 0"),
    # the stage's own check, a traceback before
    (["--batch", "3", "--micro-batches", "2", "--seq-len", "64"],
     r"--batch 3 / --seq-len 64 / --micro-batches 2: .*does not divide into micro_batches=2"),
])
def test_train_step_bad_shapes_are_refused_before_the_build(argv, match, capsys):
  import importlib
  train_step = importlib.import_module("benchmarks.train_step")
  small = ["--batch", "2", "--seq-len", "64", "--steps", "1"]  # argparse: the last one wins
  assert re.search(match, _refused(train_step.main, ["--preset", "tiny"] + small + argv,
                                   capsys))


# ---------------------------------------------------------------------------------------------
# Scripts that need a GPU say so in one line, exit 2, before compiling


@pytest.mark.parametrize("module, argv, match", [
    # it failed inside the first kernel's Pallas lowering ("Only interpret mode is supported")
    ("decode_kernels", ["--repeats", "1"], r"error: needs a GPU: the fused decode kernels"),
    # it exited with status 1
    ("kda_intra", ["--shape", "1,2,128,32", "--configs", "4:16", "--repeats", "1"],
     r"error: needs a CUDA GPU \(the Triton kernels\), or --interpret"),
    ("gmm_configs", ["--preset", "tiny", "--quick"], r"error: tokamax's Mosaic GPU kernels need"),
])
def test_gpu_only_scripts_say_so_on_a_cpu(module, argv, match):
  rc, stdout, stderr = _cli(module, *argv)
  assert rc == 2, (rc, stderr[-3000:])
  assert "Traceback" not in stderr, stderr[-3000:]
  assert re.search(match, stderr.strip().splitlines()[-1]), stderr
  assert not stdout.strip(), stdout


# ---------------------------------------------------------------------------------------------
# The other scripts' arguments


def test_attnres_scripts_refuse_bad_arguments_before_compiling(capsys):
  from benchmarks import attnres, attnres_group
  # an unknown variant was found after the earlier variants had compiled and run
  line = _refused(attnres_group.main, ["--variants", "repo,foo", "--batch", "1", "--length",
                                       "16", "--repeats", "1"], capsys)
  assert "--variants 'repo,foo': expected a comma list of repo, traced_push, no_fence" in line
  small = ["--batch", "1", "--length", "16", "--width", "16"]
  assert "--sources 2: must be >= 3" in _refused(attnres.main, ["--sources", "2"] + small,
                                                 capsys)
  assert "--repeats 0" in _refused(attnres.main, ["--repeats", "0"] + small, capsys)


def test_gmm_cpu_refuses_rows_that_do_not_split_into_equal_groups(capsys):
  """--m 100 --groups 8 timed 96 rows (8 groups of 12) and printed M=100."""
  from benchmarks import gmm_cpu
  line = _refused(gmm_cpu.main, ["--m", "100", "--groups", "8"], capsys)
  assert "--m 100 must be a multiple of --groups 8" in line


@pytest.mark.parametrize("argv, match", [
    (["--preset", "foo"], r"--preset 'foo': expected one of .*tiny"),  # KeyError before
    (["--stage", "nope"], r"--stage 'nope': no module experiments.nope"),
    (["--stage", "base"], r"--stage 'base': experiments.base is not a pretraining stage"),
    (["--caps", "1.0,x"], r"--caps '1.0,x': expected a comma list of numbers"),
    (["--set", "foo=1"], r"unknown --set key 'foo'"),
    (["--steps", "0"], r"--steps 0"),
    # a cap <= 0 trained and printed a drop rate above 100%
    (["--caps", "-1.0"], r"--caps '-1.0': each cap must be a number > 0"),
    (["--caps", "1.0,0"], r"--caps '1.0,0': each cap must be a number > 0"),
    (["--caps", "nan"], r"--caps 'nan': each cap must be a number > 0"),
    (["--train-cap", "-2"], r"--train-cap -2.0: expected a number > 0"),
    (["--deadline-s", "-5"], r"--deadline-s -5.0: expected a number of seconds > 0"),
    (["--virtual-devices", "0"], r"--virtual-devices 0: expected an integer >= 1"),
    # parsed after the training steps: a ValueError traceback after the run
    (["--windows", "a"], r"--windows 'a': expected a comma list of step numbers"),
    (["--windows", "20,5"], r"--windows '20,5': expected increasing step numbers >= 1"),
    (["--windows", "0"], r"--windows '0': expected increasing step numbers >= 1"),
])
def test_ep_drops_bad_arguments_are_refused_by_name(argv, match, capsys):
  from benchmarks import ep_drops
  # a mesh that fits one device, so that each case stops at its own argument
  assert re.search(match, _refused(ep_drops.main, ["--mesh", "fsdp=1", "--steps", "1"] + argv,
                                   capsys))


def test_ep_drops_default_mesh_on_one_device_says_what_to_set():
  """The default --mesh fsdp=2,expert=4 on one CPU device: the flag, the device count and the
  XLA flag that gives 8 CPU devices (a ValueError traceback from make_mesh before)."""
  if "device_count" in os.environ.get("XLA_FLAGS", ""):
    pytest.skip("XLA_FLAGS sets the CPU device count")
  rc, _, stderr = _cli("ep_drops", "--steps", "1")
  assert rc == 2, stderr[-3000:]
  line = stderr.strip().splitlines()[-1]
  assert "--mesh fsdp=2,expert=4 does not fit the 1 device(s) here" in line, line
  assert "--xla_force_host_platform_device_count=8" in line and "--virtual-mesh" in line


def test_loop_gc_refuses_an_unknown_preset_before_starting_a_child(capsys):
  from benchmarks import loop_gc
  line = _refused(loop_gc.main, ["--preset", "foo", "--steps", "2", "--gc-every", "0"], capsys)
  assert "--preset 'foo': expected one of" in line


@pytest.mark.parametrize("argv, match", [
    # each failed in the first child, a traceback of the child's apply_overrides
    (["--set", "foo=1"], r"unknown --set key 'foo'"),
    (["--set", "seed=x"], r"seed"),
    (["--set", "seed"], r"--set expects key=value, got 'seed'"),
])
def test_loop_gc_checks_set_keys_before_starting_a_child(argv, match, capsys, monkeypatch):
  from benchmarks import loop_gc

  def no_child(*a, **k):
    raise AssertionError(f"a child was started: {a}")

  monkeypatch.setattr(loop_gc.subprocess, "run", no_child)
  line = _refused(loop_gc.main, ["--steps", "2", "--gc-every", "0"] + argv, capsys)
  assert re.search(match, line), line


@pytest.mark.parametrize("argv, match", [
    # --size_gb <= 0 wrote the floor of 8 experts (0.74 GB) without a word
    (["--size_gb", "-1"], r"--size_gb -1: expected a size in GB > 0"),
    (["--size_gb", "0"], r"--size_gb 0: expected a size in GB > 0"),
    (["--size_gb", "nan"], r"--size_gb nan: expected a size in GB > 0"),
    (["--shard_mb", "0"], r"--shard_mb 0: expected a shard size in MB >= 1"),
    (["--shard_mb", "-4"], r"--shard_mb -4: expected a shard size in MB >= 1"),
])
def test_interop_import_rss_refuses_bad_sizes_before_writing(argv, match, tmp_path, capsys):
  from benchmarks import interop_import_rss
  out = tmp_path / "ckpt"
  line = _refused(interop_import_rss.main, argv + ["--small", "--dir", str(out)], capsys)
  assert re.search(match, line), line
  assert not out.exists()


def test_interop_import_rss_refuses_a_dir_it_cannot_create(tmp_path, capsys):
  """A --dir under a file: usage error (a FileNotFoundError traceback from the writer before,
  after the abstract model was built)."""
  from benchmarks import interop_import_rss
  (tmp_path / "file").write_text("")
  bad = str(tmp_path / "file" / "ckpt")
  line = _refused(interop_import_rss.main, ["--small", "--size_gb", "0.05", "--dir", bad],
                  capsys)
  assert f"--dir {bad!r}: cannot create it" in line, line


def test_interop_import_rss_says_when_the_size_is_below_the_floor(tmp_path, capsys,
                                                                  monkeypatch):
  """A --size_gb below the layout's 8 experts says what size it writes instead (it wrote the
  floor silently); stopped here at the writer."""
  from benchmarks import interop_import_rss
  from sparse_lm.interop import safetensors_io

  class Stop(Exception):
    pass

  def writer(*a, **k):
    raise Stop

  monkeypatch.setattr(safetensors_io, "ShardWriter", writer)
  with pytest.raises(Stop):
    interop_import_rss.write(tmp_path / "ckpt", 0.001, small=True, shard_mb=16)
  err = capsys.readouterr().err
  assert re.search(r"--size_gb 0.001 is below the smallest checkpoint of this layout \(8 "
                   r"experts, --small\): writing about [0-9.]+ GB", err), err


def test_triton_resources_checks_the_triton_python_before_lowering(tmp_path, capsys):
  """A --triton-python that is not there (or not executable): usage error before the kernels
  are lowered and their IR written (a FileNotFoundError after writing before)."""
  from benchmarks import triton_resources
  out = tmp_path / "ttir"
  for py in (tmp_path / "nope" / "python", tmp_path / "not_executable"):
    if py.name == "not_executable":
      py.write_text("#!/bin/sh\n")
    line = _refused(triton_resources.main, ["--triton-python", str(py), "--out", str(out)],
                    capsys)
    assert f"--triton-python {str(py)!r}: no such executable" in line, line
    assert not out.exists()


@pytest.mark.parametrize("variants, match", [
    # raise SystemExit(msg): exit status 1, no usage line
    ("foo=1", r"--moe-variants: 'foo=1': keys are \['block_f', 'num_stages', 'num_warps', "
              r"'use_dot'\]"),
    ("block_f=x", r"--moe-variants: block_f='x' must be an integer"),
    ("block_f=16;use_dot=2", r"--moe-variants: use_dot='2' must be 0/1 or true/false"),
])
def test_decode_moe_variants_errors_are_usage_errors(variants, match, capsys):
  from benchmarks import decode
  with pytest.raises(SystemExit) as e:
    decode.main(["--preset", "tiny", "--moe-variants", variants])
  assert e.value.code == 2, e.value.code
  err = capsys.readouterr().err
  assert err.startswith("usage:"), err
  assert re.search(match, err.strip().splitlines()[-1]), err


@pytest.mark.parametrize("module", ["attnres", "attnres_group", "gmm_configs", "kda_intra",
                                    "tpu_compile_probe"])
def test_help_description_is_the_docstrings_first_paragraph(module, capsys):
  """--help gave the docstring's first line, cut mid-sentence."""
  import importlib
  mod = importlib.import_module(f"benchmarks.{module}")
  with pytest.raises(SystemExit) as e:
    mod.main(["--help"])
  assert e.value.code == 0
  words = lambda text: " ".join(text.split())
  first = words(mod.__doc__.split("\n\n")[0])
  assert first.endswith((".", ")", ":")), first
  assert first in words(capsys.readouterr().out)


def test_layer_step_parses_set_values_to_the_field_types(capsys):
  """`--set capacity_factor=none` is None (it was the string 'none'); a bad value names the
  field and the type; --repeats 0 is refused (it printed a nan median)."""
  from benchmarks import layer_step
  from benchmarks.cli_args import parse_model_sets
  assert parse_model_sets(["capacity_factor=none", "scan_layers=false",
                           "ragged_buffer_factor=2"]) == {
                               "capacity_factor": None, "scan_layers": False,
                               "ragged_buffer_factor": 2.0}
  small = ["--preset", "tiny", "--batch", "1", "--seq-len", "16", "--residuals"]
  line = _refused(layer_step.main, small + ["--set", "capacity_factor=x"], capsys)
  assert line.endswith("--set capacity_factor='x': expected a float"), line
  assert "--repeats 0" in _refused(layer_step.main, small + ["--repeats", "0"], capsys)
