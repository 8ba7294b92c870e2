"""Render launch recipes: XPK `workload create`, a JobSet manifest, a SLURM script.

Every recipe runs `python run_train.py <the user's flags>` once per host (TPU VM) or per
GPU (SLURM) with the multi-process flags run_train.py reads (parallel/distributed.py):
  xpk     TPU slices: `--distributed`; on Cloud TPU jax.distributed finds the coordinator,
          the process count and id itself (TPU metadata).
  jobset  one pod per TPU VM or GPU node, an indexed Job: `--coordinator_address` = pod 0
          of the JobSet (its headless-service DNS name), `--num_processes` = pods,
          `--process_id` = the pod's job-completion index (env JAX_COORDINATOR_ADDRESS,
          JAX_NUM_PROCESSES, JAX_PROCESS_ID, substituted by Kubernetes as $(VAR)).
  slurm   `srun` one task per GPU with `--distributed`: jax.distributed reads SLURM_JOB_ID
          (the coordinator port), SLURM_STEP_NODELIST (its host: the first node),
          SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID (the process's GPU).
Topologies are `hardware.topology` names (config/hardware.py): TPU slices 'v5p-64',
'v6e-16', ... (4 chips per VM; v5e / v6e slices of <= 8 chips are one VM), GPUs
'h100:2x8' (2 nodes of 8).

XPK: the tests check the command against the installed xpk's own argument parser when
xpk is importable; written for xpk 0.6 (`workload create` with --cluster,
--workload, --tpu-type, --num-slices, --docker-image, --command).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Sequence

import yaml

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.hardware import is_gpu_topology, parse_topology

XPK_VERSION = "0.6"
TARGETS = ("xpk", "jobset", "slurm")
COORDINATOR_PORT = 8476
OWN_FLAGS = ("--distributed", "--coordinator_address", "--num_processes", "--process_id")
# GKE node labels of each TPU chip (cloud.google.com/gke-tpu-accelerator).
_GKE_TPU = {"tpu_v4": "tpu-v4-podslice", "tpu_v5p": "tpu-v5p-slice",
            "tpu_v5e": "tpu-v5-lite-podslice", "tpu_v6e": "tpu-v6e-slice"}
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
# One shell / #SBATCH / YAML token: no whitespace, no control characters (a newline in an
# #SBATCH value or in the script's comment would start a line that bash runs).
_WORD = re.compile(r"[^\s\x00-\x1f\x7f]+")
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
_SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE")
_SLURM_PARTITION = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")


@dataclasses.dataclass(frozen=True)
class Slice:
  """What a topology means for launching: hosts (pods / VMs / nodes), devices per host."""

  topology: str
  gpu: bool
  chip: str
  shape: str          # TPU: the torus '4x4x2'; GPU: '1x<hosts>x<per host>'
  hosts: int
  per_host: int       # TPU chips or GPUs on each host

  @property
  def devices(self) -> int:
    return self.hosts * self.per_host


def describe(topology: str) -> Slice:
  """`topology` -> Slice; ConfigError (one line, `--topology`) for an unknown name."""
  try:
    chip, shape, chips = parse_topology(topology)
  except ConfigError as e:
    raise ConfigError(str(e).replace("config field `hardware.topology`", "--topology")) from None
  if is_gpu_topology(topology):
    _, hosts, per = (int(v) for v in shape.split("x"))
    return Slice(topology, True, chip, shape, hosts, per)
  single = 8 if chip in ("tpu_v5e", "tpu_v6e") else 4
  per = chips if chips <= single else 4
  if chips % per:   # e.g. 'v5p:3x3x3': 27 chips are no whole number of 4-chip VMs
    raise ConfigError(f"--topology={topology!r} is invalid: {chips} chips do not fill whole "
                      f"TPU VMs of {per} chips (a slice of more than {single} chips needs a "
                      "multiple of 4)")
  return Slice(topology, False, chip, shape.split(":")[1], chips // per, per)


@dataclasses.dataclass(frozen=True)
class Launch:
  """Everything a recipe needs. run_flags: run_train.py's flags, passed through verbatim."""

  target: str
  topology: str
  name: str
  image: str
  run_flags: tuple[str, ...]
  cluster: str = ""
  project: str = ""
  zone: str = ""
  num_slices: int = 1
  time: str = "24:00:00"     # SLURM wall time
  partition: str = ""

  def check(self) -> Slice:
    """Validates every field before rendering; ConfigError (one line naming the flag)."""
    if self.target not in TARGETS:
      raise ConfigError(f"--target={self.target!r} is invalid: allowed {'|'.join(TARGETS)}")
    if not _NAME.fullmatch(self.name):
      raise ConfigError(f"--name={self.name!r} is invalid: allowed 1-40 lower-case letters, "
                        "digits and '-', starting with a letter (a Kubernetes name)")
    s = describe(self.topology)
    own = [f for f in self.run_flags if _flag_name(f) in OWN_FLAGS]
    if own:
      raise ConfigError(f"run flag {own[0]!r} is set by the recipe: leave it out")
    for flag, value in (("--docker_image", self.image), ("--cluster", self.cluster),
                        ("--project", self.project), ("--zone", self.zone)):
      if value and not _WORD.fullmatch(value):
        raise ConfigError(f"{flag}={value!r} is invalid: allowed one word (no spaces, "
                          "newlines or control characters)")
    if self.target in ("xpk", "jobset") and not self.image:
      raise ConfigError(f"--docker_image is required with --target={self.target} (the "
                        "container image holding this repository)")
    if self.target == "xpk":   # xpk pastes --command into a YAML block: one line only
      multi = [f for f in self.run_flags if len(f"x{f}x".splitlines()) > 1]
      if multi:
        raise ConfigError(f"run flag {multi[0]!r} is invalid with --target=xpk: allowed "
                          "flags without line breaks (xpk writes the command into one YAML "
                          "block)")
    if self.target == "slurm":
      if not _SLURM_TIME.fullmatch(self.time):
        raise ConfigError(f"--time={self.time!r} is invalid: allowed a SLURM time limit "
                          "(minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED)")
      if self.partition and not _SLURM_PARTITION.fullmatch(self.partition):
        raise ConfigError(f"--partition={self.partition!r} is invalid: allowed SLURM "
                          "partition names (letters, digits, '_', '.', '-'), comma-separated")
    if self.target == "xpk":
      if s.gpu:
        raise ConfigError(f"--topology={self.topology!r}: the xpk recipe is for TPU slices; "
                          "use --target=jobset or --target=slurm for GPUs")
      if not self.cluster:
        raise ConfigError("--cluster is required with --target=xpk (the GKE cluster name)")
    if self.target == "slurm" and not s.gpu:
      raise ConfigError(f"--topology={self.topology!r}: the SLURM recipe is for GPU nodes "
                        "(e.g. 'h100:2x8'); use --target=xpk or jobset for TPU slices")
    if not 1 <= self.num_slices <= 64 or (self.num_slices > 1 and self.target != "xpk"):
      raise ConfigError(f"--num_slices={self.num_slices} is invalid: allowed [1, 64], and > 1 "
                        "only with --target=xpk")
    return s


def _flag_name(flag: str) -> str:
  """'-process_id=3', '--nodistributed' -> '--process_id', '--distributed': the name absl
  reads (one or two dashes; a 'no' prefix negates a boolean flag)."""
  name = "--" + flag.split("=")[0].lstrip("-")
  return "--" + name[4:] if name.startswith("--no") and "--" + name[4:] in OWN_FLAGS else name


def _train_argv(launch: Launch, extra: Sequence[str], *, kubernetes: bool = False
                ) -> list[str]:
  """python run_train.py <extra> <the run flags>. `kubernetes`: the argv goes into a pod's
  command, where Kubernetes expands $(VAR) and turns $$ into $: every $ of the run flags is
  written $$, so run_train.py gets them verbatim."""
  flags = [f.replace("$", "$$") for f in launch.run_flags] if kubernetes else launch.run_flags
  return ["python", "run_train.py", *extra, *flags]


def render_xpk(launch: Launch) -> str:
  """The `xpk workload create` command line (one shell line)."""
  s = launch.check()
  argv = ["xpk", "workload", "create", f"--cluster={launch.cluster}",
          f"--workload={launch.name}", f"--tpu-type={s.topology}",
          f"--num-slices={launch.num_slices}", f"--docker-image={launch.image}",
          f"--command={shlex.join(_train_argv(launch, ['--distributed'], kubernetes=True))}"]
  argv += [f"--project={launch.project}"] if launch.project else []
  argv += [f"--zone={launch.zone}"] if launch.zone else []
  return shlex.join(argv)


def jobset_manifest(launch: Launch) -> dict:
  """The JobSet (jobset.x-k8s.io/v1alpha2) as a dict: one indexed Job, a pod per host."""
  s = launch.check()
  rjob = "workers"
  coordinator = f"{launch.name}-{rjob}-0-0.{launch.name}:{COORDINATOR_PORT}"
  env = [{"name": "JAX_COORDINATOR_ADDRESS", "value": coordinator},
         {"name": "JAX_NUM_PROCESSES", "value": str(s.hosts)},
         {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {
             "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
  extra = ["--coordinator_address=$(JAX_COORDINATOR_ADDRESS)",
           "--num_processes=$(JAX_NUM_PROCESSES)", "--process_id=$(JAX_PROCESS_ID)"]
  resource = ("nvidia.com/gpu" if s.gpu else "google.com/tpu")
  container = {"name": "train", "image": launch.image,
               "command": _train_argv(launch, extra, kubernetes=True),
               "env": env, "ports": [{"containerPort": COORDINATOR_PORT}],
               "resources": {"limits": {resource: s.per_host}}}
  pod = {"restartPolicy": "Never", "containers": [container]}
  if s.gpu:
    pod["nodeSelector"] = {"nvidia.com/gpu.product": s.chip.upper()}
  else:
    pod["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": _GKE_TPU[s.chip],
                           "cloud.google.com/gke-tpu-topology": s.shape}
  job = {"parallelism": s.hosts, "completions": s.hosts, "completionMode": "Indexed",
         "backoffLimit": 0, "template": {"spec": pod}}
  return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": {"name": launch.name},
          "spec": {"failurePolicy": {"maxRestarts": 0},
                   "network": {"enableDNSHostnames": True},
                   "replicatedJobs": [{"name": rjob, "replicas": 1,
                                       "template": {"spec": job}}]}}


def render_jobset(launch: Launch) -> str:
  return (f"# JobSet for {launch.topology}: {describe(launch.topology).hosts} pods; apply with "
          "kubectl apply -f <this file>\n"
          + yaml.safe_dump(jobset_manifest(launch), sort_keys=False, default_flow_style=False))


def render_slurm(launch: Launch) -> str:
  """An sbatch script: one task per GPU, `srun` with the SLURM env jax.distributed reads."""
  s = launch.check()
  lines = ["#!/bin/bash",
           f"#SBATCH --job-name={launch.name}",
           f"#SBATCH --nodes={s.hosts}",
           f"#SBATCH --ntasks-per-node={s.per_host}",
           f"#SBATCH --gpus-per-node={s.per_host}",
           f"#SBATCH --time={launch.time}",
           "#SBATCH --output=%x-%j.out"]
  lines += [f"#SBATCH --partition={launch.partition}"] if launch.partition else []
  lines += [
      "set -euo pipefail",
      "# One process per GPU: jax.distributed reads SLURM_JOB_ID (coordinator port),",
      "# SLURM_STEP_NODELIST (coordinator host), SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID.",
      "# Runs in the submitting environment (this repository installed on every node)"
      + (f"; the image {launch.image} needs your site's srun container flags" if launch.image
         else "."),
      f"srun --ntasks={s.devices} --ntasks-per-node={s.per_host} "
      + shlex.join(_train_argv(launch, ["--distributed"])),
  ]
  return "\n".join(lines) + "\n"


RENDER = {"xpk": render_xpk, "jobset": render_jobset, "slurm": render_slurm}


def render(launch: Launch) -> str:
  out = RENDER[launch.check() and launch.target](launch)
  return out if out.endswith("\n") else out + "\n"
