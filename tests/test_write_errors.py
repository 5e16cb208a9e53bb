"""A full disk or a read-only directory ends the stage and interop CLIs with one line naming
the path, not a traceback (found by a newcomer's run with a tmpfs workdir, 2026-12-07).

Nothing is compiled: the failing writes are stand-ins raising what the filesystem raised."""

import errno

import numpy as np
import pytest


def test_stage_cli_reports_a_read_only_or_full_workdir(tmp_path, monkeypatch, capsys):
  from experiments import base, stage_8k
  from sparse_lm.train import loop

  monkeypatch.setattr(base, "enable_compilation_cache", lambda directory: None)
  for code, filename in ((errno.EROFS, str(tmp_path / "stage_8k")), (errno.ENOSPC, None)):
    def fail(*args, **kwargs):
      raise OSError(code, "simulated", filename)
    monkeypatch.setattr(loop, "run", fail)
    status = base.main(stage_8k.STAGES, ["--preset=tiny", "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1, err
    assert "error: cannot write" in err and errno.errorcode[code] in err, err
    assert (filename or f"a file under {tmp_path}") in err, err


def test_stage_cli_still_raises_other_os_errors(tmp_path, monkeypatch):
  from experiments import base, stage_8k
  from sparse_lm.train import loop

  monkeypatch.setattr(base, "enable_compilation_cache", lambda directory: None)
  def fail(*args, **kwargs):
    raise OSError(errno.EIO, "simulated")
  monkeypatch.setattr(loop, "run", fail)
  with pytest.raises(OSError):
    base.main(stage_8k.STAGES, ["--preset=tiny", "--workdir", str(tmp_path)])


def test_interop_cli_reports_write_failures_with_status_2(tmp_path, monkeypatch, capsys):
  from sparse_lm.interop import hf

  def fail(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "o"))
  monkeypatch.setattr(hf, "export_from_workdir", fail)
  monkeypatch.setattr(hf, "import_to_workdir", fail)
  for argv in (["export", "--workdir", str(tmp_path), "--out", str(tmp_path / "o")],
               ["import", "--hf_dir", str(tmp_path), "--workdir", str(tmp_path / "o")]):
    with pytest.raises(SystemExit) as e:
      hf.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert f"cannot write {tmp_path / 'o'}: Read-only file system" in err, err


def test_shard_writer_turns_a_failed_safetensors_write_into_os_error(tmp_path, monkeypatch):
  """safetensors reports ENOSPC as SafetensorError("... (os error 28)"); the writer raises it
  as OSError(ENOSPC) and removes its temporary shard."""
  from safetensors import SafetensorError

  from sparse_lm.interop import safetensors_io

  def fail(tensors, path, metadata=None):
    with open(path, "wb") as f:
      f.write(b"partial")
    raise SafetensorError("Error while serializing: I/O error: No space left on device "
                          "(os error 28)")
  monkeypatch.setattr(safetensors_io, "save_file", fail)
  w = safetensors_io.ShardWriter(tmp_path)
  w.add("a", np.zeros((4,), np.float32))
  with pytest.raises(OSError) as e:
    w.close()
  assert e.value.errno == errno.ENOSPC
  assert not list(tmp_path.glob("*.tmp"))


def test_stage_cli_ctrl_c_before_the_step_loop_is_one_line(tmp_path, monkeypatch, capsys):
  """Ctrl-C while the state is initialised (before the step loop holds signals) raised a
  KeyboardInterrupt traceback from inside optax/jax; now one line and status 130."""
  from experiments import base, stage_8k
  from sparse_lm.train import loop

  monkeypatch.setattr(base, "enable_compilation_cache", lambda directory: None)
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(loop, "run", interrupted)
  status = base.main(stage_8k.STAGES, ["--preset=tiny", "--workdir", str(tmp_path)])
  err = capsys.readouterr().err
  assert status == 130, err
  assert "interrupted (SIGINT)" in err and "run the same command again" in err, err
