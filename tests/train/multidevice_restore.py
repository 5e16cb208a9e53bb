"""Run as a script (8 CPU devices): a checkpoint written on 1 device restores onto an 8-device
mesh and back with equal held-out loss; a layout whose heads do not divide the mesh is refused.

  python tests/train/multidevice_restore.py WORKDIR   (WORKDIR holds tokenizer.json)
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import dataclasses  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import base, stage_8k  # noqa: E402
from sparse_lm import data as data_lib  # noqa: E402
from sparse_lm import sharding as shd  # noqa: E402
from sparse_lm.train import loop  # noqa: E402
from sparse_lm.train.checkpoint import Checkpointer  # noqa: E402
from tests.train.conftest import SMALL_SETS, small_stage  # noqa: E402


def eval_loss(stage, mesh, state, batches):
  parts = loop.build(stage, mesh)
  sh = {k: shd.batch_sharding(mesh) for k in loop.BATCH_KEYS}
  with shd.use_mesh(mesh):
    return loop._evaluate(parts.eval_step, state, batches, sh)  # pylint: disable=protected-access


def restore(stage, mesh, directory):
  parts = loop.build(stage, mesh)
  target = shd.with_shardings(parts.abstract_state, parts.state_shardings)
  ck = Checkpointer(directory)
  state, _, _ = ck.restore_latest(target)
  ck.close()
  return state


def main(workdir: pathlib.Path):
  assert jax.device_count() == 8
  tok = data_lib.load_or_train_tokenizer(data_lib.DataConfig(), str(workdir), 512)
  one = dataclasses.replace(small_stage(), mesh=shd.MeshLayout())
  eight = dataclasses.replace(one, mesh=shd.MeshLayout(data=2, fsdp=2, expert=2))
  mesh1 = shd.make_mesh(one.mesh, jax.devices()[:1])
  mesh8 = shd.make_mesh(eight.mesh)
  batches = data_lib.make_eval_batches(one.data, tok, seq_len=one.seq_len, batch_size=8,
                                       num_batches=1)

  state1 = loop.build(one, mesh1).init()
  loss1 = eval_loss(one, mesh1, state1, batches)
  ck = Checkpointer(workdir / "one")
  ck.save(state1, data_state={}, meta={})
  ck.close()

  state8 = restore(eight, mesh8, workdir / "one")
  w = state8.params["embed"]["embedding"][...]
  assert len(w.sharding.device_set) == 8, w.sharding
  loss8 = eval_loss(eight, mesh8, state8, batches)
  ck = Checkpointer(workdir / "eight")
  ck.save(state8, data_state={}, meta={})
  ck.close()

  back = restore(one, mesh1, workdir / "eight")
  loss_back = eval_loss(one, mesh1, back, batches)
  same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                      back, state1)
  assert all(jax.tree.leaves(same)), "params changed through the 8-device round trip"
  print(f"losses: 1 device {loss1:.7f}, 8 devices {loss8:.7f}, back {loss_back:.7f}")
  assert loss_back == loss1
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)

  # A layout whose heads do not divide the tensor axis is refused before anything compiles.
  argv = ["--preset=tiny", f"--workdir={workdir}", "--no-progress", "--set",
          "mesh=fsdp=-1,tensor=4", "--set", "model.kda_num_heads=3"]
  for s in SMALL_SETS:
    argv += ["--set", s]
  assert base.main(stage_8k.STAGES, argv) == 1
  print("OK")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
