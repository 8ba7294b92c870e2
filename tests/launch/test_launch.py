"""The three launch recipes, parsed back: the XPK command by xpk's own argument parser (when
xpk is installed), the JobSet as YAML with its required fields and the coordinator /
process-id environment, the SLURM script by bash and its #SBATCH lines; each carries the run
flags verbatim. Bad arguments: one line each."""

import argparse
import shlex
import subprocess
import sys

import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.launch import recipes
from tests.conftest import ROOT

FLAGS = ("--config=configs/tiny.py", "--workdir=gs://bucket/run one",
         "--config.train.steps=100")


def _launch(target, topology, **kw):
  kw = {"name": "hm-run", "image": "us-docker.pkg.dev/p/r/hm:1", "cluster": "c1",
        "run_flags": FLAGS, **kw}
  return recipes.Launch(target=target, topology=topology, **kw)


def test_slice_sizes():
  s = recipes.describe("v5p-64")  # 64 TensorCores = 32 chips, 4 per VM
  assert (s.gpu, s.chip, s.shape, s.hosts, s.per_host) == (False, "tpu_v5p", "2x4x4", 8, 4)
  assert recipes.describe("v6e-8").hosts == 1 and recipes.describe("v6e-16").hosts == 4
  s = recipes.describe("h100:2x8")
  assert (s.gpu, s.hosts, s.per_host, s.devices) == (True, 2, 8, 16)


def test_xpk_command_parses_with_xpk():
  cmd = recipes.render(_launch("xpk", "v5p-64", project="p", zone="us-east5-a"))
  argv = shlex.split(cmd)
  assert argv[:3] == ["xpk", "workload", "create"] and "--tpu-type=v5p-64" in argv
  run = shlex.split(next(a for a in argv if a.startswith("--command="))[len("--command="):])
  assert run == ["python", "run_train.py", "--distributed", *FLAGS]
  pytest.importorskip("xpk", reason="xpk not installed: its parser check is skipped "
                      f"(the command targets xpk {recipes.XPK_VERSION})")
  from xpk.parser.core import set_parser  # pylint: disable=g-import-not-at-top

  def xpk_parser_check(command: str):  # xpk's own argparse parser; SystemExit if it refuses
    parser = argparse.ArgumentParser(prog="xpk")
    set_parser(parser)
    return parser.parse_args(shlex.split(command)[1:])

  ns = xpk_parser_check(cmd)
  assert (ns.cluster, ns.workload, ns.tpu_type, ns.num_slices) == ("c1", "hm-run", "v5p-64", 1)
  assert shlex.split(ns.command)[3:] == list(FLAGS)
  with pytest.raises(SystemExit):  # the check has teeth: xpk refuses an unknown flag
    xpk_parser_check(cmd + " --no-such-xpk-flag")


@pytest.mark.parametrize("topology,resource,per,hosts", [
    ("v5p-64", "google.com/tpu", 4, 8), ("h100:2x8", "nvidia.com/gpu", 8, 2)])
def test_jobset_yaml(topology, resource, per, hosts):
  yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse the manifest back")
  text = recipes.render(_launch("jobset", topology))
  doc = yaml.safe_load(text)
  assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
  assert doc["metadata"]["name"] == "hm-run" and doc["spec"]["network"]["enableDNSHostnames"]
  (rjob,) = doc["spec"]["replicatedJobs"]
  job = rjob["template"]["spec"]
  assert job["parallelism"] == job["completions"] == hosts
  assert job["completionMode"] == "Indexed"
  (c,) = job["template"]["spec"]["containers"]
  assert c["resources"]["limits"] == {resource: per}
  env = {e["name"]: e for e in c["env"]}
  assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "hm-run-workers-0-0.hm-run:8476"
  assert env["JAX_NUM_PROCESSES"]["value"] == str(hosts)
  assert "job-completion-index" in env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
  assert c["command"] == ["python", "run_train.py",
                          "--coordinator_address=$(JAX_COORDINATOR_ADDRESS)",
                          "--num_processes=$(JAX_NUM_PROCESSES)",
                          "--process_id=$(JAX_PROCESS_ID)", *FLAGS]


def test_slurm_script():
  text = recipes.render(_launch("slurm", "h100:4x8", time="02:00:00", partition="gpu"))
  assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # syntax
  sbatch = dict(l[len("#SBATCH --"):].split("=", 1) for l in text.splitlines()
                if l.startswith("#SBATCH"))
  assert sbatch == {"job-name": "hm-run", "nodes": "4", "ntasks-per-node": "8",
                    "gpus-per-node": "8", "time": "02:00:00", "output": "%x-%j.out",
                    "partition": "gpu"}
  (srun,) = [shlex.split(l) for l in text.splitlines() if l.startswith("srun ")]
  assert srun[:3] == ["srun", "--ntasks=32", "--ntasks-per-node=8"]
  assert srun[3:] == ["python", "run_train.py", "--distributed", *FLAGS]


@pytest.mark.parametrize("kw,match", [
    (dict(target="xpk", topology="h100:2x8"), "xpk recipe is for TPU slices"),
    (dict(target="slurm", topology="v5p-64"), "SLURM recipe is for GPU nodes"),
    (dict(target="jobset", topology="v5p-63"), "--topology = 'v5p-63' is invalid"),
    (dict(target="xpk", topology="v5p-64", cluster=""), "--cluster is required"),
    (dict(target="jobset", topology="v5p-64", name="Bad_Name"), "--name='Bad_Name'"),
    (dict(target="jobset", topology="v5p-64", run_flags=("--process_id=3",)),
     "'--process_id=3' is set by the recipe"),
    # absl reads one dash and a 'no' prefix too: both passed the recipe's check
    (dict(target="jobset", topology="v5p-64", run_flags=("-process_id=3",)),
     "'-process_id=3' is set by the recipe"),
    (dict(target="slurm", topology="h100:2x8", run_flags=("--nodistributed",)),
     "'--nodistributed' is set by the recipe"),
    (dict(target="jobset", topology="v5p-64", num_slices=2), "--num_slices=2 is invalid"),
])
def test_bad_arguments_one_line(kw, match):
  target, topology = kw.pop("target"), kw.pop("topology")
  with pytest.raises(ConfigError, match=match) as e:
    recipes.render(_launch(target, topology, **kw))
  assert "\n" not in str(e.value)


def test_cli():
  out = subprocess.run([sys.executable, "-m", "hybridmoe_jax.launch", "--target=slurm",
                        "--topology=h200:1x8", "--", "--config=configs/tiny.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0 and "srun --ntasks=8" in out.stdout
  bad = subprocess.run([sys.executable, "-m", "hybridmoe_jax.launch", "--target=slurm",
                        "--topology=h200:1x8"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
  assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "after `--`" in bad.stderr


def test_tpu_chips_that_fill_no_whole_vm_are_refused():
  """A TPU shape of more than one VM must be whole 4-chip VMs: 'v5p:3x3x3' (27 chips) was
  described as 6 hosts x 4 = 24 devices, a manifest for the wrong slice."""
  for topology in ("v5p:3x3x3", "v5e:3x5"):
    with pytest.raises(ConfigError, match="do not fill whole TPU VMs") as e:
      recipes.describe(topology)
    assert "\n" not in str(e.value)
  s = recipes.describe("v5p:1x1x3")   # one VM of 3 chips stays allowed
  assert (s.hosts, s.per_host) == (1, 3)


@pytest.mark.parametrize("kw,match", [
    (dict(time="1:00:00\necho pwned"), "--time="),
    (dict(partition="gpu\necho pwned"), "--partition="),
    (dict(image="img\necho pwned"), "--docker_image="),
])
def test_slurm_values_cannot_start_a_script_line(kw, match):
  """A newline in a value written into the sbatch script started a line bash runs."""
  with pytest.raises(ConfigError, match=match) as e:
    recipes.render(_launch("slurm", "h100:1x8", **kw))
  assert "\n" not in str(e.value)
  ok = recipes.render(_launch("slurm", "h100:1x8", time="1-12", partition="a,b"))
  assert "#SBATCH --time=1-12" in ok and "#SBATCH --partition=a,b" in ok


def test_kubernetes_recipes_keep_dollars_and_need_an_image():
  """Kubernetes expands $(VAR) and turns $$ into $ in a pod's command: the run flags are
  written with $$ so run_train.py gets them verbatim; an image is required; xpk writes its
  --command into a YAML block, so a run flag with a line break is refused."""
  yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse the manifest back")
  flags = ("--workdir=/runs/$(JAX_PROCESS_ID)", "--config.data.jsonl_field=a$$b")
  doc = yaml.safe_load(recipes.render(_launch("jobset", "v5p-8", run_flags=flags)))
  (c,) = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
  assert c["command"][-2:] == ["--workdir=/runs/$$(JAX_PROCESS_ID)",
                               "--config.data.jsonl_field=a$$$$b"]
  cmd = shlex.split(recipes.render(_launch("xpk", "v5p-8", run_flags=flags)))
  run = shlex.split(next(a for a in cmd if a.startswith("--command="))[len("--command="):])
  assert run[-2:] == c["command"][-2:]
  for target in ("jobset", "xpk"):
    with pytest.raises(ConfigError, match="--docker_image is required"):
      recipes.render(_launch(target, "v5p-8", image=""))
  with pytest.raises(ConfigError, match="line breaks"):
    recipes.render(_launch("xpk", "v5p-8", run_flags=("--config.x=a\nb",)))
  with pytest.raises(ConfigError, match="--cluster="):
    recipes.render(_launch("xpk", "v5p-8", cluster="c1\nrm"))
