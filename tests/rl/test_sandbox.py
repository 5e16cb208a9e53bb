"""Each escape attempt of issue 14 fails inside the sandbox and comes back as a failed call."""

import os
import signal
import socket
import time

import pytest

from sparse_lm.rl import sandbox
from sparse_lm.rl.sandbox import SandboxUnavailableError, run_python

pytestmark = pytest.mark.skipif(not sandbox.sandbox_support().isolated,
                                reason=f"host cannot isolate: {sandbox.sandbox_support()}")


def test_runs_code_and_returns_stdout():
  res = run_python("import fractions\nprint(fractions.Fraction(1, 3) * 3)")
  assert res.ok and res.output == "1\n" and res.error is None


def test_error_comes_back_as_failed_call():
  res = run_python("print('before')\nraise ValueError('boom')")
  assert not res.ok and res.output == "before\n" and "ValueError: boom" in res.error


def test_cannot_read_parent_readable_file(tmp_path):
  secret = tmp_path / "secret.txt"
  secret.write_text("top secret")
  os.chmod(secret, 0o644)
  for path in (secret, os.path.abspath(__file__), "/etc/hostname"):
    assert open(path).read()  # the parent can read it
    res = run_python(f"print(open({str(path)!r}).read())")
    assert not res.ok and "top secret" not in res.output, (path, res)
    assert "FileNotFoundError" in res.error, res.error


def test_cannot_write_outside(tmp_path):
  target = tmp_path / "written.txt"
  res = run_python(f"open({str(target)!r}, 'w').write('x')")
  assert not res.ok and not target.exists()
  res = run_python("open('/usr/pwned', 'w').write('x')")
  assert not res.ok and ("Read-only" in res.error or "Permission" in res.error), res.error
  assert not os.path.exists("/usr/pwned")
  assert run_python("open('scratch.txt', 'w').write('ok'); print(open('scratch.txt').read())"
                    ).output == "ok\n"  # its own directory is writable


def test_no_network_not_even_parent_localhost():
  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  port = listener.getsockname()[1]
  try:
    res = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert not res.ok and ("Connection refused" in res.error or "unreachable" in res.error
                           ), res.error
    listener.settimeout(0.0)
    with pytest.raises(BlockingIOError):
      listener.accept()  # nothing ever reached the parent's socket
    res = run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert not res.ok and "unreachable" in res.error, res.error
  finally:
    listener.close()


def test_fork_bomb_is_stopped():
  start = time.monotonic()
  res = run_python("import os\nwhile True:\n  os.fork()", timeout_s=2.0)
  assert not res.ok
  assert time.monotonic() - start < 6
  assert run_python("print('alive')").output == "alive\n"  # the run goes on


def test_memory_limit():
  res = run_python("x = bytearray(1 << 30)\nprint(len(x))", memory_mb=256)
  assert not res.ok and "MemoryError" in res.error, res.error


def test_infinite_loop_is_killed():
  start = time.monotonic()
  res = run_python("while True:\n  pass", timeout_s=1.0)
  assert not res.ok and ("timed out" in res.error or "SIGXCPU" in res.error), res.error
  assert time.monotonic() - start < 4


def test_parent_environment_is_invisible(monkeypatch):
  monkeypatch.setenv("SPARSE_LM_TEST_SECRET", "hunter2")
  res = run_python(f"import os\nprint(dict(os.environ))\n"
                   f"print(open('/proc/{os.getpid()}/environ').read())")
  assert "hunter2" not in res.output and "SPARSE_LM_TEST_SECRET" not in res.output
  assert not res.ok and "FileNotFoundError" in res.error, res.error


def test_cannot_signal_parent():
  received = []
  previous = signal.signal(signal.SIGUSR1, lambda *a: received.append(a))
  try:
    res = run_python(f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)")
    time.sleep(0.1)
    assert not res.ok and "ProcessLookupError" in res.error, res.error
    res = run_python(f"import os, signal\nos.killpg({os.getpgid(0)}, signal.SIGUSR1)")
    assert not res.ok
    time.sleep(0.1)
    assert not received
  finally:
    signal.signal(signal.SIGUSR1, previous)


def test_refuses_without_isolation_unless_unsafe(monkeypatch):
  fake = sandbox.SandboxSupport(False, ("user namespaces (test)",), 0.0)
  monkeypatch.setattr(sandbox, "sandbox_support", lambda: fake)
  with pytest.raises(SandboxUnavailableError, match="user namespaces"):
    run_python("print(1)")
  res = run_python("import os\nprint(len(os.environ) <= 1)", allow_unsafe=True)
  assert res.ok and res.output == "True\n"
  with pytest.raises(ValueError, match="timeout_s"):
    run_python("print(1)", timeout_s=0)
