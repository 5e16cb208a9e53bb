"""gcloud TPU pod launcher: create, set up, run, tail, delete (docs/launch.md).

    python -m launch.tpu create --name lm --tpu v5p-256 --num-slices 2 --zone us-east5-a \
        --project my-proj --spot
    python -m launch.tpu setup  --name lm --num-slices 2 --zone ... --project ...
    python -m launch.tpu run    --name lm --num-slices 2 --zone ... --project ... \
        --run-name s8k -- python -m experiments.stage_8k --preset full --workdir /gcs/b/runs
    python -m launch.tpu tail   --name lm --num-slices 2 --zone ... --project ... --run-name s8k
    python -m launch.tpu delete --name lm --zone ... --project ...

Every subcommand takes `--dry-run`, which prints the exact commands (one per line, shell-quoted)
instead of running them. Slices are the nodes of one queued resource: `--node-id NAME` for one
slice, `--node-count N --node-prefix NAME` (nodes NAME-0 .. NAME-{N-1}) for multislice.
`run` starts the command on every worker of every slice (`--worker=all`) in the background
under nohup, with its log kept on each worker in ~/sparse_lm/logs/<run-name>.log; the
experiment calls `sparse_lm.distributed.maybe_initialize()`, which finds the TPU pod itself
(within a slice) and, across slices, the MEGASCALE_* variables set here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import subprocess
import sys

RUNTIME_VERSIONS = {  # default TPU VM software per generation (override with --runtime-version)
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
    "tpu7x": "v2-alpha-tpu7x",
}
REMOTE_DIR = "~/sparse_lm"
ARCHIVE = "/tmp/sparse_lm_checkout.tar.gz"
MEGASCALE_PORT = 8080


@dataclasses.dataclass(frozen=True)
class Pod:
  name: str
  zone: str
  project: str | None = None
  tpu: str | None = None  # accelerator type, e.g. v5p-256, v6e-256
  tpu_type: str | None = None  # with --topology instead of --tpu, e.g. tpu7x
  topology: str | None = None
  num_slices: int = 1
  runtime_version: str | None = None
  provisioning: str = "on-demand"  # on-demand | spot | reserved | best-effort

  @property
  def nodes(self) -> list[str]:
    if self.num_slices == 1:
      return [self.name]
    return [f"{self.name}-{i}" for i in range(self.num_slices)]

  def scope(self) -> list[str]:
    out = [f"--zone={self.zone}"]
    if self.project:
      out.append(f"--project={self.project}")
    return out

  def generation(self) -> str:
    acc = self.tpu or self.tpu_type or ""
    return acc.split("-")[0]


def create_commands(pod: Pod) -> list[list[str]]:
  """One `queued-resources create` for all slices."""
  if not pod.tpu and not (pod.tpu_type and pod.topology):
    raise ValueError("create needs --tpu (e.g. v5p-256) or --type and --topology")
  runtime = pod.runtime_version or RUNTIME_VERSIONS.get(pod.generation())
  if runtime is None:
    raise ValueError(f"no default runtime for {pod.generation()!r}; pass --runtime-version")
  cmd = ["gcloud", "compute", "tpus", "queued-resources", "create", pod.name, *pod.scope()]
  if pod.tpu:
    cmd.append(f"--accelerator-type={pod.tpu}")
  else:
    cmd += [f"--type={pod.tpu_type}", f"--topology={pod.topology}"]
  cmd.append(f"--runtime-version={runtime}")
  if pod.num_slices == 1:
    cmd.append(f"--node-id={pod.name}")
  else:
    cmd += [f"--node-count={pod.num_slices}", f"--node-prefix={pod.name}"]
  if pod.provisioning != "on-demand":
    cmd.append(f"--{pod.provisioning}")
  return [cmd]


def ssh(pod: Pod, node: str, command: str, worker: str = "all") -> list[str]:
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node, *pod.scope(),
          f"--worker={worker}", f"--command={command}"]


# What `setup` keeps in REMOTE_DIR when it replaces the code there: the runs' logs
# (logs/<run-name>.log) and runs/ (the experiments' default --workdir, runs/<preset>, is
# relative to the checkout).
KEPT = ("logs", "runs")


def unpack_command(archive: str = "~/sparse_lm_checkout.tar.gz") -> str:
  """The worker's shell command that replaces the code in REMOTE_DIR with `archive`: every
  entry of REMOTE_DIR except KEPT is removed (an earlier setup's files that the new commit
  no longer has go too), then the archive is unpacked over it. (`rm -rf REMOTE_DIR` deleted
  the logs and any run under the checkout whenever setup was re-run to ship a fix.)"""
  keep = " ".join(f"! -name {k}" for k in KEPT)
  return (f"mkdir -p {REMOTE_DIR}/logs && "
          f"find {REMOTE_DIR} -mindepth 1 -maxdepth 1 {keep} -exec rm -rf {{}} + && "
          f"tar -xzf {archive} -C {REMOTE_DIR}")


def setup_commands(pod: Pod, requirements: str = "requirements.txt") -> list[list[str]]:
  """Archive the committed checkout, copy it to every worker, replace the code in REMOTE_DIR
  with it (keeping logs/ and runs/: `unpack_command`), install requirements."""
  cmds = [["git", "archive", "--format=tar.gz", f"--output={ARCHIVE}", "HEAD"]]
  remote = (f"{unpack_command()} && cd {REMOTE_DIR} && "
            f"python3 -m venv ~/venv && ~/venv/bin/pip install -q -U pip && "
            f"~/venv/bin/pip install -q -r {requirements}")
  for node in pod.nodes:
    cmds.append(["gcloud", "compute", "tpus", "tpu-vm", "scp", ARCHIVE,
                 f"{node}:~/sparse_lm_checkout.tar.gz", *pod.scope(), "--worker=all"])
    cmds.append(ssh(pod, node, remote))
  return cmds


def run_commands(pod: Pod, command: list[str], run_name: str,
                 env: dict[str, str] | None = None) -> list[list[str]]:
  """Start `command` on all workers of all slices, detached, log in logs/<run_name>.log."""
  if not command:
    raise ValueError("run needs a command after `--`")
  cmds = []
  env = dict(env or {})
  coord = None
  if pod.num_slices > 1:
    # MEGASCALE coordinator: worker 0 of slice 0 (its internal IP, resolved on this machine).
    describe = ["gcloud", "compute", "tpus", "tpu-vm", "describe", pod.nodes[0], *pod.scope(),
                "--format=value(networkEndpoints[0].ipAddress)"]
    cmds.append(describe)
    coord = "$COORDINATOR_IP"
  log = f"logs/{run_name}.log"
  for i, node in enumerate(pod.nodes):
    # The user's --env values reach the worker as written (quoted); only the coordinator
    # address is left for the worker's shell to expand ($COORDINATOR_IP).
    e = {k: shlex.quote(v) for k, v in env.items()}
    if coord is not None:
      e.update(MEGASCALE_COORDINATOR_ADDRESS=f"{coord}:{MEGASCALE_PORT}",
               MEGASCALE_NUM_SLICES=str(pod.num_slices), MEGASCALE_SLICE_ID=str(i),
               MEGASCALE_PORT=str(MEGASCALE_PORT))
    exports = " ".join(f"{k}={v}" for k, v in sorted(e.items()))
    # `python` / `python3` run the setup's venv (unquoted: ~ must expand on the worker)
    head = "~/venv/bin/python" if command[0] in ("python", "python3") else shlex.quote(command[0])
    py = " ".join([head] + [shlex.quote(c) for c in command[1:]])
    remote = (f"cd {REMOTE_DIR} && mkdir -p logs && "
              f"{'env ' + exports + ' ' if exports else ''}nohup {py} > {log} 2>&1 < /dev/null &")
    cmds.append(ssh(pod, node, remote))
  return cmds


def tail_commands(pod: Pod, run_name: str, worker: str = "0", lines: int = 100,
                  follow: bool = True, slice_id: int = 0) -> list[list[str]]:
  if not 0 <= slice_id < pod.num_slices:
    raise ValueError(f"--slice {slice_id}: the pod has slices 0..{pod.num_slices - 1} "
                     "(give --num-slices as for create)")
  flag = "-F" if follow else ""
  return [ssh(pod, pod.nodes[slice_id], f"tail -n {lines} {flag} {REMOTE_DIR}/logs/{run_name}.log"
              .replace("  ", " "), worker=worker)]


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_run_name(run_name: str) -> None:
  """The run name is a file name in the workers' shell commands (logs/<run-name>.log)."""
  if not RUN_NAME.fullmatch(run_name):
    raise ValueError(f"--run-name {run_name!r}: use letters, digits, '.', '_' and '-' (it names "
                     "the log file logs/<run-name>.log in the workers' shell commands)")


def delete_commands(pod: Pod) -> list[list[str]]:
  return [["gcloud", "compute", "tpus", "queued-resources", "delete", pod.name, *pod.scope(),
           "--force", "--quiet"]]


def render(cmds: list[list[str]], pod: Pod | None = None) -> str:
  """Shell text of the commands; the multislice coordinator lookup becomes a variable."""
  lines = []
  for c in cmds:
    if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "describe"]:
      # an empty answer (a node without network endpoints yet) would give every worker
      # MEGASCALE_COORDINATOR_ADDRESS=:8080; stop here instead, naming the node
      lines.append(f"COORDINATOR_IP=$({shlex.join(c)}) && test -n \"$COORDINATOR_IP\" || "
                   f"{{ echo {shlex.quote(f'launch.tpu: no internal IP for {c[5]} (is the queued resource ACTIVE? gcloud compute tpus queued-resources list)')} >&2; exit 1; }}")
    else:
      # $COORDINATOR_IP expands on this machine, all else reaches the worker as written (_quote)
      lines.append(" ".join(_quote(a) for a in c))
  return "\n".join(lines)


def _quote(arg: str) -> str:
  """shlex.quote, except that `$COORDINATOR_IP` stays a variable of this machine's shell.

  Only that token is expanded here: the rest is single-quoted, so a `$`, a backtick or a `\\`
  of the experiment's flags (`--set data.source=text:/gcs/$USER/*.txt`) reaches the worker
  as written (double-quoting the whole argument expanded them on this machine)."""
  parts = arg.split("$COORDINATOR_IP")
  return '"$COORDINATOR_IP"'.join(shlex.quote(p) if p else "" for p in parts)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.tpu", description=__doc__.split("\n\n")[0],
                              epilog="run: the command to start follows `--`")
  p.add_argument("action", choices=("create", "setup", "run", "tail", "delete"))
  p.add_argument("--name", required=True, help="queued resource / node (prefix) name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default=None)
  p.add_argument("--tpu", default=None, help="accelerator type, e.g. v5p-256, v6e-256")
  p.add_argument("--type", dest="tpu_type", default=None, help="with --topology, e.g. tpu7x")
  p.add_argument("--topology", default=None, help="e.g. 4x4x8")
  p.add_argument("--num-slices", type=int, default=1)
  p.add_argument("--runtime-version", default=None)
  g = p.add_mutually_exclusive_group()
  g.add_argument("--spot", action="store_const", dest="prov", const="spot")
  g.add_argument("--reserved", action="store_const", dest="prov", const="reserved")
  g.add_argument("--best-effort", action="store_const", dest="prov", const="best-effort")
  p.add_argument("--run-name", default="run")
  p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--worker", default="0", help="tail: which worker (of --slice)")
  p.add_argument("--slice", dest="slice_id", type=int, default=0,
                 help="tail: which slice (0..--num-slices - 1)")
  p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  argv = list(sys.argv[1:] if argv is None else argv)
  command = argv[argv.index("--") + 1:] if "--" in argv else []
  a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
  if a.num_slices < 1:
    p.error(f"--num-slices={a.num_slices} must be >= 1")
  if a.tpu and (a.tpu_type or a.topology):
    p.error("give --tpu (e.g. v5p-256) or --type with --topology (e.g. tpu7x, 2x2x2), not both")
  pod = Pod(name=a.name, zone=a.zone, project=a.project, tpu=a.tpu, tpu_type=a.tpu_type,
            topology=a.topology, num_slices=a.num_slices, runtime_version=a.runtime_version,
            provisioning=a.prov or "on-demand")
  try:
    if a.action in ("run", "tail"):
      check_run_name(a.run_name)
    if a.action == "create":
      cmds = create_commands(pod)
    elif a.action == "setup":
      cmds = setup_commands(pod)
    elif a.action == "run":
      bad = [kv for kv in a.env if "=" not in kv or not kv.split("=", 1)[0]]
      if bad:
        raise ValueError(f"--env {bad[0]!r}: expected KEY=VALUE (e.g. --env "
                         "XLA_FLAGS=--xla_dump_to=/tmp/dump)")
      env = dict(kv.split("=", 1) for kv in a.env)
      cmds = run_commands(pod, command, a.run_name, env)
    elif a.action == "tail":
      cmds = tail_commands(pod, a.run_name, worker=a.worker, slice_id=a.slice_id)
    else:
      cmds = delete_commands(pod)
  except ValueError as e:
    p.error(str(e))
  text = render(cmds, pod)
  if a.dry_run:
    print(text)
    return 0
  return subprocess.run(["bash", "-euo", "pipefail", "-c", text]).returncode


if __name__ == "__main__":
  sys.exit(main())
