"""Cluster blueprints, their node scripts, and the container image recipe.

- blueprints/gcp/hpc-slurm.yaml: structure (unique ids, every `use` and `$(...)` reference
  resolves, required vars present) and every module's settings keys checked against the input
  variables of that module at Cluster Toolkit v1.95.0 (tests/data copy of the reference list).
- blueprints/aws/config.yaml: filled by ./manage_cluster.sh and loaded with the schema of the
  aws-parallelcluster package itself, in its own virtual environment (.venv-pcluster, built by
  `make test`), offline.
- The node scripts run against a fake system root with fake package managers.
- shellcheck on every shell script; static checks of the Dockerfile.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import AWS_PLACEHOLDER_ENV, require_tool

REPO = Path(__file__).resolve().parents[1]
GCP_BLUEPRINT = REPO / "blueprints" / "gcp" / "hpc-slurm.yaml"
AWS_CONFIG = REPO / "blueprints" / "aws" / "config.yaml"
MODULE_VARIABLES = REPO / "tests" / "data" / "cluster-toolkit-v1.95.0-module-variables.json"
SHELL_SCRIPTS = [
    REPO / "manage_cluster.sh",
    REPO / "tests" / "system_deps.sh",
    REPO / ".ci" / "run",
    REPO / "blueprints" / "gcp" / "install-build-deps.sh",
    REPO / "blueprints" / "aws" / "on-head-node-configured.sh",
    REPO / "blueprints" / "aws" / "on-compute-node-start.sh",
    REPO / "pbs" / "run_llm.pbs",
    REPO / "pbs" / "local" / "start.sh",
    REPO / "pbs" / "local" / "stop.sh",
]


def pcluster_python() -> str:
    """Python of the separate aws-parallelcluster virtual environment; fail (never skip) without it."""
    python = os.environ.get("PCLUSTER_PYTHON") or str(REPO / ".venv-pcluster" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(
            f"{python} not found: the ParallelCluster checks need aws-parallelcluster in its own virtual "
            "environment. Build it with `make .venv-pcluster/.installed` (make test does it), or point "
            "PCLUSTER_PYTHON at a python that has aws-parallelcluster 3.x installed."
        )
    return python


# ------------------------------------------------------------------ Google Cloud


def load_module_variables() -> dict[str, set[str]]:
    data = json.loads(MODULE_VARIABLES.read_text())
    return {source: set(names) for source, names in data.items() if not source.startswith("_")}


# Inputs without a default that the toolkit fills itself (from vars, the module id, or `use`).
# The subnetwork comes from a `use` of the vpc module; the rest from blueprint `vars`.
FILLED_FROM_VARS = {"project_id", "region", "zone", "deployment_name"}
NEEDS_NETWORK = {
    "community/modules/compute/schedmd-slurm-gcp-v6-nodeset",
    "community/modules/scheduler/schedmd-slurm-gcp-v6-controller",
    "community/modules/scheduler/schedmd-slurm-gcp-v6-login",
    "modules/file-system/filestore",
    "modules/network/private-service-access",
}
REQUIRED_SETTINGS = {"community/modules/compute/schedmd-slurm-gcp-v6-partition": {"partition_name"}}
REFERENCE = re.compile(r"\$\(([^)]*\)?)\)")


def blueprint_problems(blueprint: dict, variables: dict[str, set[str]], base: Path) -> list[str]:
    """Everything wrong with a Cluster Toolkit blueprint that can be checked without the toolkit."""
    problems = []
    blueprint_vars = blueprint.get("vars") or {}
    for var in ("project_id", "deployment_name", "region", "zone"):
        if var not in blueprint_vars:
            problems.append(f"vars: missing {var}")
    if not blueprint.get("blueprint_name"):
        problems.append("blueprint_name missing")

    seen: dict[str, str] = {}
    for group in blueprint.get("deployment_groups") or []:
        for module in group.get("modules") or []:
            mid, source = module.get("id"), module.get("source")
            where = f"module {mid!r}"
            if not mid:
                problems.append(f"a module in group {group.get('group')!r} has no id")
                continue
            if mid in seen:
                problems.append(f"{where}: duplicate id")
            if source not in variables:
                problems.append(f"{where}: unknown source {source!r}")
                known = set()
            else:
                known = variables[source]
            for used in module.get("use") or []:
                if used not in seen:
                    problems.append(f"{where}: use {used!r} is not a module defined before it")
            settings = module.get("settings") or {}
            for key in settings:
                if key not in known:
                    problems.append(f"{where}: setting {key!r} is not an input variable of {source}")
            for key in REQUIRED_SETTINGS.get(source, ()):
                if key not in settings:
                    problems.append(f"{where}: required setting {key!r} missing")
            if source in NEEDS_NETWORK and not any(
                seen.get(u) == "modules/network/vpc" for u in module.get("use") or []
            ):
                problems.append(f"{where}: needs `use: [<vpc module>]` for its network")
            for key in FILLED_FROM_VARS & known:
                if key not in settings and key not in blueprint_vars:
                    problems.append(f"{where}: input {key!r} is neither set nor in vars")
            for expr in REFERENCE.findall(yaml.safe_dump(settings, width=10**6)):
                stage = re.fullmatch(r'ghpc_stage\("([^"]+)"\)', expr)
                if stage:
                    if not (base / stage.group(1)).is_file():
                        problems.append(f"{where}: ghpc_stage file {stage.group(1)!r} not found beside the blueprint")
                    continue
                head, _, attr = expr.partition(".")
                if head == "vars":
                    if attr not in blueprint_vars:
                        problems.append(f"{where}: $({expr}) refers to an undefined var")
                elif head not in seen:
                    problems.append(f"{where}: $({expr}) refers to module {head!r} not defined before it")
            seen[mid] = source
    return problems


@pytest.fixture(scope="module")
def gcp() -> dict:
    return yaml.safe_load(GCP_BLUEPRINT.read_text())


def modules_by_id(blueprint: dict) -> dict[str, dict]:
    return {m["id"]: m for g in blueprint["deployment_groups"] for m in g["modules"]}


def test_gcp_blueprint_is_structurally_valid_for_cluster_toolkit_v1_95(gcp):
    assert blueprint_problems(gcp, load_module_variables(), GCP_BLUEPRINT.parent) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda m: m["g2_nodeset"]["settings"].update(gpu_count=1), "setting 'gpu_count' is not an input variable"),
        (lambda m: m["homefs"]["settings"].update(mount_point="/home"), "setting 'mount_point' is not an input"),
        (lambda m: m["slurm_controller"]["use"].append("l4_partition"), "use 'l4_partition' is not a module"),
        (lambda m: m["g2_partition"]["settings"].pop("partition_name"), "required setting 'partition_name'"),
        (lambda m: m["a2_nodeset"].update(use=[]), "needs `use: [<vpc module>]`"),
        (lambda m: m["a2_nodeset"].update(id="g2_nodeset"), "duplicate id"),
        (
            lambda m: m["slurm_controller"]["settings"].update(compute_startup_script="$(setup.startup_script)"),
            "$(setup.startup_script) refers to module 'setup'",
        ),
        (
            lambda m: m["build_deps"]["settings"]["runners"][0].update(source='$(ghpc_stage("missing.sh"))'),
            "ghpc_stage file 'missing.sh' not found",
        ),
    ],
)
def test_gcp_blueprint_checker_catches_mistakes(gcp, mutate, expected):
    broken = copy.deepcopy(gcp)
    mutate(modules_by_id(broken))
    problems = blueprint_problems(broken, load_module_variables(), GCP_BLUEPRINT.parent)
    assert any(expected in p for p in problems), problems


def test_gcp_blueprint_checker_requires_vars(gcp):
    broken = copy.deepcopy(gcp)
    del broken["vars"]["zone"]
    assert "vars: missing zone" in blueprint_problems(broken, load_module_variables(), GCP_BLUEPRINT.parent)


def test_gcp_blueprint_cluster_shape(gcp):
    mods = modules_by_id(gcp)
    sources = {m["source"] for m in mods.values()}
    assert {
        "modules/network/vpc",
        "modules/file-system/filestore",
        "community/modules/compute/schedmd-slurm-gcp-v6-nodeset",
        "community/modules/compute/schedmd-slurm-gcp-v6-partition",
        "community/modules/scheduler/schedmd-slurm-gcp-v6-controller",
        "community/modules/scheduler/schedmd-slurm-gcp-v6-login",
    } <= sources
    homes = [m for m in mods.values() if m["source"] == "modules/file-system/filestore"]
    assert [m["settings"]["local_mount"] for m in homes] == ["/home"]

    partitions = {
        m["settings"]["partition_name"]: m
        for m in mods.values()
        if m["source"].endswith("schedmd-slurm-gcp-v6-partition")
    }
    assert set(partitions) == {"g2", "a2"}
    assert [name for name, m in partitions.items() if m["settings"].get("is_default")] == ["g2"]
    nodeset = {name: mods[m["use"][0]]["settings"] for name, m in partitions.items()}
    assert nodeset["g2"]["machine_type"] == "g2-standard-4"
    assert nodeset["g2"]["node_count_dynamic_max"] == 8
    assert nodeset["a2"]["machine_type"] == "a2-highgpu-1g"
    for settings in nodeset.values():
        assert settings.get("node_count_static", 0) == 0  # dynamic only: scale to zero
    assert "a2-highgpu-4g" in GCP_BLUEPRINT.read_text()  # the 4-GPU alternative is documented

    controller = [m for m in mods.values() if m["source"].endswith("schedmd-slurm-gcp-v6-controller")]
    assert len(controller) == 1
    uses = set(controller[0]["use"])
    assert {partitions["g2"]["id"], partitions["a2"]["id"], homes[0]["id"]} <= uses
    assert any(mods[u]["source"].endswith("schedmd-slurm-gcp-v6-login") for u in uses)


def test_gcp_nodes_get_the_build_deps_startup_script(gcp):
    mods = modules_by_id(gcp)
    controller = next(m for m in mods.values() if m["source"].endswith("schedmd-slurm-gcp-v6-controller"))
    for key in ("compute_startup_script", "login_startup_script"):
        ref = REFERENCE.fullmatch(controller["settings"][key])
        assert ref, key
        module_id, _, output = ref.group(1).partition(".")
        assert output == "startup_script"
        script = mods[module_id]
        assert script["source"] == "modules/scripts/startup-script"
        runners = script["settings"]["runners"]
        assert [r["type"] for r in runners] == ["shell"]
        assert runners[0]["source"] == '$(ghpc_stage("install-build-deps.sh"))'
    # Package installs take minutes: the scripts and node resumes get more than the 300 s defaults.
    assert controller["settings"]["compute_startup_scripts_timeout"] >= 600
    assert controller["settings"]["login_startup_scripts_timeout"] >= 600
    for m in mods.values():
        if m["source"].endswith("schedmd-slurm-gcp-v6-partition"):
            assert m["settings"]["resume_timeout"] >= 600, m["id"]


def write_fake_tools(bindir: Path, names: list[str], log: Path) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    for name in names:
        tool = bindir / name
        tool.write_text(f'#!/bin/bash\necho "{name} $*" >> "{log}"\n')
        tool.chmod(0o755)


PACKAGE_TOOLS = ["dnf", "apt-get", "python3.11", "scontrol", "sysctl"]


def run_script(script: Path, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run a node script with every package/admin tool faked (nothing real gets installed)."""
    log = tmp_path / "calls.log"
    write_fake_tools(tmp_path / "bin", PACKAGE_TOOLS, log)
    proc = subprocess.run(
        ["bash", str(script)],
        env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, (log.read_text().splitlines() if log.exists() else [])


def os_release(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_gcp_build_deps_on_rocky_linux(tmp_path):
    release = os_release(tmp_path / "os-release", 'NAME="Rocky Linux"\nID="rocky"\nID_LIKE="rhel centos fedora"\n')
    proc, calls = run_script(
        REPO / "blueprints/gcp/install-build-deps.sh",
        tmp_path,
        OS_RELEASE_FILE=str(release),
        PROFILE_D=str(tmp_path / "profile.d"),
    )
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == (
        "dnf install -y python3.11 python3.11-devel python3.11-pip gcc-toolset-12-gcc gcc-toolset-12-gcc-c++ make"
    )
    assert calls[1] == "dnf install -y --enablerepo=powertools ninja-build"
    profile = (tmp_path / "profile.d" / "llmft-build-env.sh").read_text()
    assert ". /opt/rh/gcc-toolset-12/enable" in profile and "export CUDA_HOME=/usr/local/cuda" in profile
    subprocess.run(["bash", "-n", str(tmp_path / "profile.d" / "llmft-build-env.sh")], check=True)


def test_gcp_build_deps_on_debian(tmp_path):
    release = os_release(tmp_path / "os-release", 'ID=debian\nVERSION_ID="12"\n')
    proc, calls = run_script(
        REPO / "blueprints/gcp/install-build-deps.sh",
        tmp_path,
        OS_RELEASE_FILE=str(release),
        PROFILE_D=str(tmp_path / "profile.d"),
    )
    assert proc.returncode == 0, proc.stderr
    assert calls[-1] == (
        "apt-get -o DPkg::Lock::Timeout=600 install -y python3-dev python3-venv python3-pip "
        "ninja-build build-essential"
    )
    assert (tmp_path / "profile.d" / "llmft-build-env.sh").exists()


def test_gcp_build_deps_refuses_unknown_os(tmp_path):
    release = os_release(tmp_path / "os-release", "ID=plan9\n")
    proc, calls = run_script(
        REPO / "blueprints/gcp/install-build-deps.sh",
        tmp_path,
        OS_RELEASE_FILE=str(release),
        PROFILE_D=str(tmp_path / "profile.d"),
    )
    assert proc.returncode == 1
    assert "unsupported OS 'plan9'" in proc.stderr
    assert calls == [] and not (tmp_path / "profile.d").exists()


# --------------------------------------------------------------------------- AWS


def fake_parallelcluster_root(root: Path) -> Path:
    for rel, text in [
        ("enroot/enroot.conf", "ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)\n"),
        ("spank/plugstack.conf", "include /opt/slurm/etc/plugstack.conf.d/*\n"),
        ("pyxis/pyxis.conf", "required /usr/local/lib/slurm/spank_pyxis.so\n"),
    ]:
        path = root / "opt/parallelcluster/examples" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_aws_head_node_script_enables_pyxis_and_enroot(tmp_path):
    root = fake_parallelcluster_root(tmp_path / "root")
    proc, calls = run_script(REPO / "blueprints/aws/on-head-node-configured.sh", tmp_path, SYSROOT=str(root))
    assert proc.returncode == 0, proc.stderr
    examples = root / "opt/parallelcluster/examples"
    assert (root / "opt/slurm/etc/plugstack.conf").read_text() == (examples / "spank/plugstack.conf").read_text()
    assert (root / "opt/slurm/etc/plugstack.conf.d/pyxis.conf").read_text() == (
        examples / "pyxis/pyxis.conf"
    ).read_text()
    assert (root / "etc/enroot/enroot.conf").read_text() == (examples / "enroot/enroot.conf").read_text()
    for d in ("var/enroot", "run/enroot", "run/pyxis"):
        assert oct((root / d).stat().st_mode & 0o7777) == "0o1777", d
    assert "python3-dev python3-venv python3-pip ninja-build build-essential" in calls[-2]
    assert calls[-1] == "scontrol reconfigure"  # slurmctld loads the plugstack


def test_aws_head_node_script_uses_parallelclusters_scontrol(tmp_path):
    root = fake_parallelcluster_root(tmp_path / "root")
    log = tmp_path / "slurm.log"
    write_fake_tools(root / "opt/slurm/bin", ["scontrol"], log)
    proc, calls = run_script(REPO / "blueprints/aws/on-head-node-configured.sh", tmp_path, SYSROOT=str(root))
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["scontrol reconfigure"]
    assert not any(c.startswith("scontrol") for c in calls)  # not the one on PATH


def test_aws_compute_node_script_prepares_enroot(tmp_path):
    root = fake_parallelcluster_root(tmp_path / "root")
    os_release(root / "etc/os-release", 'ID=ubuntu\nVERSION_ID="22.04"\n')
    proc, calls = run_script(REPO / "blueprints/aws/on-compute-node-start.sh", tmp_path, SYSROOT=str(root))
    assert proc.returncode == 0, proc.stderr
    assert (root / "etc/enroot/enroot.conf").exists()
    for d in ("var/enroot", "run/enroot", "run/pyxis"):
        assert oct((root / d).stat().st_mode & 0o7777) == "0o1777", d
    assert calls[-1].endswith("install -y python3-dev python3-venv ninja-build build-essential")
    assert not any(c.startswith("sysctl") for c in calls)  # only Ubuntu 24.04 needs the AppArmor change


def test_aws_compute_node_script_lifts_apparmor_userns_limit_on_ubuntu_2404(tmp_path):
    root = fake_parallelcluster_root(tmp_path / "root")
    os_release(root / "etc/os-release", 'ID=ubuntu\nVERSION_ID="24.04"\n')
    (root / "etc/sysctl.d").mkdir(parents=True)
    proc, calls = run_script(REPO / "blueprints/aws/on-compute-node-start.sh", tmp_path, SYSROOT=str(root))
    assert proc.returncode == 0, proc.stderr
    assert "sysctl --system" in calls
    assert (
        "apparmor_restrict_unprivileged_userns = 0" in (root / "etc/sysctl.d/99-llmft-enroot-userns.conf").read_text()
    )


@pytest.mark.parametrize("script", ["on-head-node-configured.sh", "on-compute-node-start.sh"])
def test_aws_node_scripts_refuse_amis_without_pyxis(tmp_path, script):
    proc, calls = run_script(REPO / "blueprints/aws" / script, tmp_path, SYSROOT=str(tmp_path / "empty-root"))
    assert proc.returncode == 1
    assert "ParallelCluster >= 3.11.1 AMI" in proc.stderr
    assert calls == []


# Runs in the aws-parallelcluster venv: load each config (JSON list on stdin) with the package's
# schema and validators, and report what the tests need as JSON.
PCLUSTER_CHECK = r"""
import json, os, sys
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
from marshmallow import ValidationError
from pcluster.schemas.cluster_schema import ClusterSchema
from pcluster.validators.cluster_validators import ClusterNameValidator, NameValidator

results = []
for name, cfg in json.load(sys.stdin):
    try:
        cluster = ClusterSchema(cluster_name=name).load(cfg)
    except ValidationError as e:
        results.append({"error": e.messages})
        continue
    failures = []
    for queue in cluster.scheduling.queues:
        failures += [f.message for f in NameValidator().execute(queue.name)]
        for cr in queue.compute_resources:
            failures += [f.message for f in NameValidator().execute(cr.name)]
    failures += [f.message for f in ClusterNameValidator().execute(name, cluster.scheduling)]
    results.append({
        "failures": failures,
        "os": cluster.image.os,
        "head_on_node_configured": cluster.head_node.custom_actions.on_node_configured.script,
        "queues": [{
            "name": q.name,
            "on_node_start": q.custom_actions.on_node_start.script,
            "subnets": q.networking.subnet_ids,
            "placement_group": bool(q.networking.placement_group and q.networking.placement_group.enabled),
            "resources": [{"type": cr.instance_types[0], "min": cr.min_count, "max": cr.max_count,
                           "efa": bool(cr.efa and cr.efa.enabled)} for cr in q.compute_resources],
        } for q in cluster.scheduling.queues],
        "storage": [(type(s).__name__, s.mount_dir) for s in cluster.shared_storage],
    })
print(json.dumps(results))
"""


def pcluster_check(*configs: tuple[str, dict]) -> list[dict]:
    proc = subprocess.run(
        [pcluster_python(), "-c", PCLUSTER_CHECK],
        input=json.dumps(list(configs)),
        capture_output=True,
        text=True,
        timeout=180,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/tmp"),
            "AWS_DEFAULT_REGION": "us-east-1",
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def aws_config() -> dict:
    """blueprints/aws/config.yaml filled by manage_cluster.sh from environment variables."""
    proc = subprocess.run(
        [str(REPO / "manage_cluster.sh"), "--provider", "aws", "config", "llmft-test"],
        env={"PATH": "/usr/bin:/bin", **AWS_PLACEHOLDER_ENV},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_aws_config_loads_with_parallelcluster_schema(aws_config):
    [result] = pcluster_check(("llmft-test", aws_config))
    assert "error" not in result, result
    assert result["failures"] == []
    queues = {q["name"]: q for q in result["queues"]}
    assert list(queues) == ["g6", "p4d"]  # the first queue is Slurm's default partition
    assert {r["type"] for r in queues["g6"]["resources"]} == {"g6.2xlarge", "g6.12xlarge"}
    assert [(r["type"], r["efa"]) for r in queues["p4d"]["resources"]] == [("p4d.24xlarge", True)]
    assert queues["p4d"]["placement_group"]
    for q in queues.values():
        assert q["subnets"] == ["subnet-0fedcba9876543210"]
        assert q["on_node_start"] == "s3://llmft-scripts-bucket/llmft/llmft-test/on-compute-node-start.sh"
        assert all(r["min"] == 0 for r in q["resources"])  # dynamic nodes: scale to zero
    assert result["head_on_node_configured"] == "s3://llmft-scripts-bucket/llmft/llmft-test/on-head-node-configured.sh"
    assert [(kind, mount) for kind, mount in result["storage"]] == [("SharedFsxLustre", "/fsx")]
    assert aws_config["HeadNode"]["Networking"]["SubnetId"] == "subnet-0123456789abcdef0"
    assert aws_config["HeadNode"]["Ssh"]["KeyName"] == "llmft-key"
    assert aws_config["Region"] == "us-east-1"


def test_parallelcluster_schema_rejects_broken_configs(aws_config):
    """The validation above can fail: broken variants of the same config are rejected."""
    unknown_key = copy.deepcopy(aws_config)
    unknown_key["Scheduling"]["SlurmQueues"][0]["GpuCount"] = 1
    bad_storage = copy.deepcopy(aws_config)
    bad_storage["SharedStorage"][0]["FsxLustreSettings"]["DeploymentType"] = "SCRATCH_9"
    bad_queue_name = copy.deepcopy(aws_config)
    bad_queue_name["Scheduling"]["SlurmQueues"][0]["Name"] = "G6_L4"
    results = pcluster_check(
        ("llmft-test", unknown_key),
        ("llmft-test", bad_storage),
        ("llmft-test", bad_queue_name),
        ("9-bad-cluster", aws_config),
    )
    assert "GpuCount" in json.dumps(results[0]["error"])
    assert "DeploymentType" in json.dumps(results[1]["error"])
    assert any("G6_L4" in f for f in results[2]["failures"])
    assert any("cluster name" in f for f in results[3]["failures"])


def test_aws_custom_action_scripts_exist_beside_the_config():
    text = AWS_CONFIG.read_text()
    for script in re.findall(r"/llmft/\$\{CLUSTER_NAME\}/([\w.-]+\.sh)", text):
        assert (AWS_CONFIG.parent / script).is_file(), script
    assert "OnNodeConfigured" in text and "OnNodeStart" in text


# ------------------------------------------------------------------- shell, image


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_are_shellcheck_clean_and_strict(script):
    text = script.read_text()
    assert text.startswith("#!"), "needs a shebang"
    assert "set -euo pipefail" in text
    assert os.access(script, os.X_OK), f"{script} is not executable"
    proc = subprocess.run(
        [require_tool("shellcheck"), "--severity=style", str(script)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


def test_dockerfile_installs_pinned_llmft_with_prebuilt_ops_for_every_catalogue_gpu():
    text = (REPO / "Dockerfile").read_text()
    instructions = re.sub(r"\\\n", " ", text)
    base = re.search(r"^FROM\s+(\S+)", instructions, re.M).group(1)
    arg = re.fullmatch(r"\$\{?(\w+)\}?", base)
    if arg:  # FROM ${BASE_IMAGE}: check the ARG's default
        base = re.search(rf"^ARG\s+{arg.group(1)}=(\S+)", instructions, re.M).group(1)
    assert re.match(r"(nvcr\.io/nvidia/pytorch:|pytorch/pytorch:.*cuda12)", base), base
    # The pinned versions: torch first, then llmft itself, both constrained by constraints.txt.
    pip_lines = [ln for ln in instructions.splitlines() if "pip install" in ln]
    assert any("-c constraints.txt" in ln and re.search(r"\btorch\b", ln) for ln in pip_lines), pip_lines
    assert any(
        "-c constraints.txt" in ln and "--no-build-isolation" in ln and re.search(r"\s'?\.(\[[\w,]+\])?'?(\s|$)", ln)
        for ln in pip_lines
    ), pip_lines  # llmft itself: `.` or with extras, `'.[gpu]'`
    assert re.search(r"^COPY\s+.*constraints\.txt", instructions, re.M)
    # CUDA archs: the prebuilt ops (no PTX) run on every GPU of llmft's node catalogue (A100, L4, H100).
    from llmft.planning.hardware import NODE_TYPES

    archs = re.search(r'TORCH_CUDA_ARCH_LIST="?([0-9.; +PTX]+)"?', instructions).group(1)
    catalogue = {"%d.%d" % node.gpu.compute_capability for node in NODE_TYPES.values()}
    assert catalogue <= set(re.split(r"[;\s]+", archs.replace("+PTX", "").strip())), (catalogue, archs)
    assert re.search(r"DS_BUILD_OPS=1|DS_BUILD_CPU_ADAM=1.*DS_BUILD_FUSED_ADAM=1", instructions)
    # No GPU during `docker build`: without DS_ACCELERATOR=cuda DeepSpeed builds CPU ops only.
    assert re.search(r"DS_ACCELERATOR=cuda\b.*DS_BUILD_", instructions)
    # The prebuilt ops are checked at build time, not discovered missing in a job.
    assert "ds_report" in instructions
    # EFA (NCCL_PROFILE=aws-efa): libfabric and the aws-ofi-nccl plugin from AWS's installer (user space only),
    # on NCCL's library path, and the build fails when either is missing.
    assert re.search(r"efa_installer\.sh\b.*--skip-kmod", instructions)
    assert re.search(r"libfabric\.so.*libnccl-net.*exit 1", instructions)
    assert re.search(r"^ENV LD_LIBRARY_PATH=.*ofi-nccl/lib.*/opt/amazon/efa/lib", instructions, re.M)
    ignore = (REPO / ".dockerignore").read_text().split()
    for path in (".venv", ".venv-pcluster", "deployments", "my_llm_checkpoint", ".git"):
        assert any(entry.strip("/") == path for entry in ignore), path
