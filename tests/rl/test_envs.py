"""The environments' checks: the code env's reward cannot be had by exiting, printing a marker or
an always-equal result (the harness of envs._HARNESS), and every env setting is checked when the
env is built (a bad override raises ValueError naming the field)."""

import numpy as np
import pytest

from sparse_lm.rl import envs, sandbox

needs_sandbox = pytest.mark.skipif(not sandbox.sandbox_support().isolated,
                                   reason=f"host cannot isolate: {sandbox.sandbox_support()}")


def _code_tasks():
  """[(task, k)]: one sampled task of each kind of envs._CODE_TASKS, in their order (sampling
  runs nothing)."""
  rng, by_kind = np.random.default_rng(0), {}
  while len(by_kind) < len(envs._CODE_TASKS):
    task = envs.CodeEnv().sample(rng)
    for i, (desc, *_) in enumerate(envs._CODE_TASKS):
      for k in range(2, 10):
        if task.prompt == "write " + desc.format(k=k):
          by_kind.setdefault(i, (task, k))
  return [by_kind[i] for i in range(len(envs._CODE_TASKS))]


# Each of these earned 1.0 from the old reward (stdout == "PASS" with the tests appended).
EXPLOITS = {
    "sys_exit": "import sys\nprint('PASS')\nsys.exit(0)",
    "raise_system_exit": "print('PASS')\nraise SystemExit",
    "os_exit": "import os, sys\nprint('PASS')\nsys.stdout.flush()\nos._exit(0)",
    "always_equal": ("class A:\n  def __eq__(self, other):\n    return True\n"
                     "  def __ne__(self, other):\n    return False\n"
                     "def f(x):\n  return A()"),
    "int_subclass": ("class I(int):\n  def __eq__(self, other):\n    return True\n"
                     "  __hash__ = int.__hash__\n"
                     "def f(x):\n  return I(0)"),
    "patched_builtins": ("class A:\n  def __eq__(self, other):\n    return True\n"
                         "  def __repr__(self):\n    return '0'\n"
                         "import builtins\nbuiltins.type = lambda o: int\n"
                         "builtins.repr = lambda o: '0'\n"
                         "def f(x):\n  return A()"),
}


@needs_sandbox
@pytest.mark.parametrize("exploit", sorted(EXPLOITS))
def test_code_reward_exploit_earns_nothing(exploit):
  task, _ = _code_tasks()[1]
  assert task.reward(EXPLOITS[exploit]) == 0.0
  assert task.reward(task.answer) == 1.0  # the same task still pays a correct solution


@needs_sandbox
def test_code_reward_pays_correct_solutions():
  tasks = _code_tasks()
  for task, _ in tasks:  # the reference solution of every kind of task
    assert task.reward(task.answer) == 1.0, task.prompt
  task, k = tasks[2]  # "the sum of the list x, plus k", written another way and chatty
  styled = (f"def f(x):\n  total = {k}\n  for v in x:\n    total += v\n  return total\n"
            "if __name__ == '__main__':\n  print('checking', f([1, 2]))")
  assert task.reward(styled) == 1.0
  assert task.reward(styled.replace(f"total = {k}", f"total = {k + 1}")) == 0.0
  assert task.reward("def f(x):\n  return float(sum(x) + %d)" % k) == 0.0  # a float, not int


@needs_sandbox
def test_harness_secret_is_not_reachable_from_the_answer(monkeypatch):
  """The answer's code scans every frame, namespace, constant and gc container it can reach and
  tries the harness's file: neither the nonce nor the secret line shows up."""
  nonce = "0123456789abcdef" * 2
  monkeypatch.setattr(envs, "_new_nonce", lambda: nonce)
  outputs = []
  real = envs.run_python

  def spy(code, **kw):
    res = real(code, **kw)
    outputs.append(res.output)
    return res

  monkeypatch.setattr(envs, "run_python", spy)
  scanner = r'''
import gc, os, sys
_probe = "ab" * 20  # a planted hex string: shows that the scan reaches namespaces
found, seen = [], set()
def add(v):
  if isinstance(v, (bytes, bytearray)):
    v = bytes(v).decode("latin-1")
  if isinstance(v, str) and len(v) >= 32 and set(v.strip("# \n")) <= set("0123456789abcdef"):
    found.append(v)
def consts(code):
  if id(code) in seen:
    return
  seen.add(id(code))
  for c in code.co_consts:
    add(c)
    if hasattr(c, "co_consts"):
      consts(c)
frame = sys._getframe()
while frame is not None:
  for ns in (frame.f_locals, frame.f_globals):
    for v in list(ns.values()):
      add(v)
      if hasattr(v, "__code__"):
        consts(v.__code__)
  consts(frame.f_code)
  frame = frame.f_back
for o in gc.get_objects():
  if o is not found:
    for v in (list(o.values()) if isinstance(o, dict) else list(o)
              if isinstance(o, (list, tuple)) else ()):
      add(v)
for path in ("/sandbox/main.py", sys.argv[0]):
  try:
    found.append(open(path).read())
  except OSError:
    pass
print("\n".join(found))
sys.stdout.flush()
os._exit(0)
'''
  task, _ = _code_tasks()[0]
  assert task.reward(scanner) == 0.0
  out = outputs[-1]
  assert "ab" * 20 in out  # the scan works
  assert nonce not in out and nonce.encode().hex() not in out
  assert task.reward(task.answer) == 1.0 and outputs[-1].endswith("\n" + nonce + "\n")


@needs_sandbox
def test_reference_solutions_earn_the_reward_in_every_env():
  rng = np.random.default_rng(2)
  for name in sorted(envs.ENVS):
    task = envs.make_env(name).sample(rng)
    calls, answer = task.solution
    assert all(task.tools.call(c).ok for c in calls), name
    assert task.reward(answer) == 1.0, name


# ----------------------------------------------------------------------------- settings checks
BAD_OVERRIDES = [
    ("arithmetic", {"max_value": -5}, r"ArithmeticEnv\.max_value=-5: must be an int"),
    ("arithmetic", {"max_value": 0}, r"ArithmeticEnv\.max_value=0"),
    ("arithmetic", {"max_value": "9"}, r"ArithmeticEnv\.max_value='9'.*got a str"),
    ("arithmetic", {"max_value": True}, r"ArithmeticEnv\.max_value=True.*got a bool"),
    ("arithmetic", {"max_value": 2**63}, r"ArithmeticEnv\.max_value="),
    ("arithmetic", {"num_operands": 0}, r"ArithmeticEnv\.num_operands=0"),
    ("arithmetic", {"num_operands": 2.0}, r"ArithmeticEnv\.num_operands=2\.0.*got a float"),
    ("arithmetic", {"num_operands": 300}, r"ArithmeticEnv\.num_operands=300"),
    ("arithmetic", {"num_operands": 220, "max_value": 9}, r"num_operands=220.*digits"),
    ("arithmetic", {"ops": ""}, r"ArithmeticEnv\.ops=''"),
    ("arithmetic", {"ops": "+/"}, r"ArithmeticEnv\.ops='\+/'"),
    ("arithmetic", {"ops": ["+"]}, r"ArithmeticEnv\.ops=\['\+'\]"),
    ("arithmetic", {"max_steps": 0}, r"ArithmeticEnv\.max_steps=0"),
    ("arithmetic", {"max_steps": 1}, r"ArithmeticEnv\.max_steps=1.*reference solution"),
    ("lookup", {"hops": 0}, r"LookupEnv\.hops=0"),
    ("lookup", {"num_keys": 0}, r"LookupEnv\.num_keys=0"),
    ("lookup", {"num_keys": "8"}, r"LookupEnv\.num_keys='8'"),
    ("lookup", {"num_keys": 1, "hops": 3}, r"LookupEnv\.hops=3: must be <= num_keys=1"),
    ("lookup", {"hops": 4}, r"LookupEnv\.max_steps=4.*>= 5"),
    ("lookup", {"max_steps": 0}, r"LookupEnv\.max_steps=0"),
    ("passkey", {"doc_chars": -1}, r"PasskeyEnv\.doc_chars=-1"),
    ("passkey", {"doc_chars": 0}, r"PasskeyEnv\.doc_chars=0"),
    ("passkey", {"doc_chars": 10**9}, r"PasskeyEnv\.doc_chars=1000000000: too long"),
    ("passkey", {"doc_chars": None}, r"PasskeyEnv\.doc_chars=None"),
    ("passkey", {"max_steps": -1}, r"PasskeyEnv\.max_steps=-1"),
    ("code", {"max_steps": 0}, r"CodeEnv\.max_steps=0"),
    ("code", {"max_steps": "3"}, r"CodeEnv\.max_steps='3'"),
]


@pytest.mark.parametrize("name, overrides, message", BAD_OVERRIDES,
                         ids=[f"{n}-{'-'.join(map(str, o.items()))}" for n, o, _ in BAD_OVERRIDES])
def test_bad_setting_is_refused_when_built(name, overrides, message):
  with pytest.raises(ValueError, match=message):
    envs.ENVS[name](**overrides)  # as RLConfig.env_instance builds it
  with pytest.raises(ValueError, match=message):
    envs.make_env(name, **overrides)


def test_make_env_names_unknown_setting_and_env():
  with pytest.raises(ValueError, match=r"has no setting 'bogus'.*max_steps, max_value, "
                     r"num_operands, ops"):
    envs.make_env("arithmetic", bogus=1)
  with pytest.raises(ValueError, match=r"LookupEnv.*'name'.*hops, max_steps, num_keys"):
    envs.make_env("lookup", name="x")
  with pytest.raises(ValueError, match=r"unknown env 'nope'.*'arithmetic'"):
    envs.make_env("nope")
  with pytest.raises(ValueError, match=r"LookupEnv\.name=''"):
    envs.LookupEnv(name="")


def test_good_settings_still_build():
  for name in envs.ENVS:
    assert envs.make_env(name) == envs.ENVS[name]()
  env = envs.make_env("lookup", num_keys=np.int64(8), hops=8, max_steps=9)
  assert type(env.num_keys) is int and env.num_keys == 8  # a numpy integer is stored as int
  task = env.sample(np.random.default_rng(0))
  assert task.prompt.startswith("follow 8 lookups")
  assert [task.tools.call(c).ok for c in task.solution[0]] == [True] * 8
  env = envs.make_env("arithmetic", num_operands=1, max_value=1, ops="*")
  assert env.sample(np.random.default_rng(0)).answer in ("0", "1")
  assert envs.make_env("passkey", doc_chars=65_536).doc_chars == 65_536  # the small preset's
