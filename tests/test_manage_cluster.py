"""./manage_cluster.sh: the exact cloud command lines it runs, and the bad input it refuses.

Cloud CLIs can't run here, so each test puts fake `gcluster`, `ghpc`, `gcloud`, `pcluster` and
`aws` executables first on PATH. They record their argv (one line per call, tab-separated) and
print canned responses. The script runs from a copy of the repository files it needs in
tmp_path, so deployment directories never land in the real checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import AWS_PLACEHOLDER_ENV
from test_clusters import pcluster_python

REPO = Path(__file__).resolve().parents[1]
CLOUD_TOOLS = ("gcluster", "ghpc", "gcloud", "pcluster", "aws")
# The only system programs the script (and the fakes) may use: a real cloud CLI installed on the
# machine (this one has gcloud in /usr/bin) can never be reached, and "not installed" is real.
SYSTEM_TOOLS = ("bash", "env", "dirname", "mkdir", "cat", "sleep", "head", "tail", "mv", "rm", "sed", "tr")

FAKE_TOOL = r"""#!/bin/bash
# Fake cloud CLI for tests: record argv, print the next canned response ("EXIT n text" fails).
set -euo pipefail
tool=${0##*/}
{ printf '%s' "$tool"; for a in "$@"; do printf '\t%s' "$a"; done; printf '\n'; } >> "$FAKE_DIR/calls.log"
responses="$FAKE_DIR/$tool.responses"
if [[ -s $responses ]]; then
    line=$(head -n 1 "$responses")
    tail -n +2 "$responses" > "$responses.rest"
    mv "$responses.rest" "$responses"
    code=0
    if [[ $line =~ ^EXIT\ ([0-9]+)\ (.*)$ ]]; then
        code=${BASH_REMATCH[1]}
        line=${BASH_REMATCH[2]}
    fi
    printf '%b\n' "$line"
    exit "$code"
fi
"""

GCP_ENV = {"PROJECT_ID": "my-proj-123"}
AWS_ENV = {**AWS_PLACEHOLDER_ENV, "POLL_SECONDS": "0"}


class Cli:
    """A throw-away copy of the repo's cluster files plus a directory of fake cloud tools."""

    def __init__(self, tmp_path: Path, tools=CLOUD_TOOLS):
        self.system = tmp_path / "sysbin"
        self.system.mkdir()
        for tool in SYSTEM_TOOLS:
            found = shutil.which(tool, path="/usr/bin:/bin")
            assert found, f"{tool} not found"
            (self.system / tool).symlink_to(found)
        self.repo = tmp_path / "repo"
        self.repo.mkdir()
        shutil.copy2(REPO / "manage_cluster.sh", self.repo / "manage_cluster.sh")
        shutil.copytree(REPO / "blueprints", self.repo / "blueprints")
        self.fake = tmp_path / "fakebin"
        self.fake.mkdir()
        for tool in tools:
            self.add_tool(tool)

    def add_tool(self, tool: str) -> None:
        path = self.fake / tool
        path.write_text(FAKE_TOOL)
        path.chmod(0o755)

    def respond(self, tool: str, *lines: str) -> None:
        (self.fake / f"{tool}.responses").write_text("".join(f"{line}\n" for line in lines))

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        full_env = {"PATH": f"{self.fake}:{self.system}", "HOME": str(self.repo.parent), "FAKE_DIR": str(self.fake)}
        full_env.update(env)
        return subprocess.run(
            [str(self.repo / "manage_cluster.sh"), *args],
            cwd=self.repo.parent,  # the script must not depend on the caller's directory
            env=full_env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def calls(self) -> list[list[str]]:
        log = self.fake / "calls.log"
        if not log.exists():
            return []
        return [line.split("\t") for line in log.read_text().splitlines()]


@pytest.fixture
def cli(tmp_path) -> Cli:
    return Cli(tmp_path)


def test_only_fake_cloud_tools_are_reachable(tmp_path):
    cli = Cli(tmp_path, tools=("gcluster",))
    path = f"{cli.fake}:{cli.system}"
    assert shutil.which("gcluster", path=path) == str(cli.fake / "gcluster")
    for tool in ("ghpc", "gcloud", "pcluster", "aws"):
        assert shutil.which(tool, path=path) is None, tool


# ------------------------------------------------------------------ Google Cloud


def test_gcp_create_runs_gcluster_create_then_deploy(cli):
    proc = cli.run("create", "llmft-test", **GCP_ENV)
    assert proc.returncode == 0, proc.stderr
    create = [
        "gcluster",
        "create",
        "blueprints/gcp/hpc-slurm.yaml",
        "-o",
        "deployments",
        "--vars",
        "project_id=my-proj-123,deployment_name=llmft-test,region=us-central1,zone=us-central1-a",
    ]
    deploy = ["gcluster", "deploy", "deployments/llmft-test", "--auto-approve"]
    assert cli.calls() == [create, deploy]
    # Each command is printed before it runs.
    assert "+ " + " ".join(create) in proc.stdout
    assert "+ " + " ".join(deploy) in proc.stdout


def test_gcp_create_uses_default_name_region_zone_overrides(cli):
    proc = cli.run(
        "--provider", "gcp", "create", PROJECT_ID="other-proj-9", REGION="europe-west4", ZONE="europe-west4-b"
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        cli.calls()[0][-1]
        == "project_id=other-proj-9,deployment_name=llmft-cluster,region=europe-west4,zone=europe-west4-b"
    )
    assert cli.calls()[1] == ["gcluster", "deploy", "deployments/llmft-cluster", "--auto-approve"]


def test_gcp_falls_back_to_ghpc(tmp_path):
    cli = Cli(tmp_path, tools=("ghpc", "gcloud"))
    proc = cli.run("create", "llmft-test", **GCP_ENV)
    assert proc.returncode == 0, proc.stderr
    assert [c[:2] for c in cli.calls()] == [["ghpc", "create"], ["ghpc", "deploy"]]


def test_gcp_refuses_existing_deployment_dir_without_force(cli):
    (cli.repo / "deployments" / "llmft-test").mkdir(parents=True)
    proc = cli.run("create", "llmft-test", **GCP_ENV)
    assert proc.returncode != 0
    assert "deployments/llmft-test already exists" in proc.stderr and "--force" in proc.stderr
    assert cli.calls() == []

    proc = cli.run("--force", "create", "llmft-test", **GCP_ENV)
    assert proc.returncode == 0, proc.stderr
    assert cli.calls()[0][-1] == "-w"  # gcluster create --overwrite-deployment
    assert cli.calls()[1] == ["gcluster", "deploy", "deployments/llmft-test", "--auto-approve"]


def test_gcp_destroy(cli):
    (cli.repo / "deployments" / "llmft-test").mkdir(parents=True)
    proc = cli.run("destroy", "llmft-test")
    assert proc.returncode == 0, proc.stderr
    assert cli.calls() == [["gcluster", "destroy", "deployments/llmft-test", "--auto-approve"]]
    assert "+ gcluster destroy deployments/llmft-test --auto-approve" in proc.stdout


def test_gcp_destroy_without_deployment_dir_is_refused(cli):
    proc = cli.run("destroy", "llmft-test")
    assert proc.returncode != 0
    assert "no deployment directory deployments/llmft-test" in proc.stderr
    assert cli.calls() == []


def test_gcp_status_lists_the_deployment_vms(cli):
    proc = cli.run("status", "llmft-test", **GCP_ENV)
    assert proc.returncode == 0, proc.stderr
    assert cli.calls() == [
        [
            "gcloud",
            "compute",
            "instances",
            "list",
            "--project",
            "my-proj-123",
            "--filter",
            "labels.ghpc_deployment=llmft-test",
            "--format",
            "table(name,zone.basename(),status,labels.slurm_instance_role)",
        ]
    ]


def test_gcp_ssh_finds_the_login_node_and_connects_through_iap(cli):
    cli.respond("gcloud", r"llmfttest-slurmlogin-001\tus-central1-a")
    proc = cli.run("ssh", "llmft-test", **GCP_ENV)
    assert proc.returncode == 0, proc.stderr
    assert cli.calls() == [
        [
            "gcloud",
            "compute",
            "instances",
            "list",
            "--project",
            "my-proj-123",
            "--filter",
            "labels.ghpc_deployment=llmft-test AND labels.slurm_instance_role=login",
            "--format",
            "value(name,zone.basename())",
            "--limit",
            "1",
        ],
        [
            "gcloud",
            "compute",
            "ssh",
            "llmfttest-slurmlogin-001",
            "--zone",
            "us-central1-a",
            "--project",
            "my-proj-123",
            "--tunnel-through-iap",
        ],
    ]


def test_gcp_ssh_without_login_node_fails_clearly(cli):
    proc = cli.run("ssh", "llmft-test", **GCP_ENV)  # the lookup prints nothing
    assert proc.returncode != 0
    assert "no login node found" in proc.stderr
    assert [c[:3] for c in cli.calls()] == [["gcloud", "compute", "instances"]]


def test_gcp_dry_run_prints_and_runs_nothing(cli):
    proc = cli.run("--dry-run", "create", "llmft-test", **GCP_ENV)
    assert proc.returncode == 0, proc.stderr
    assert cli.calls() == []
    assert not (cli.repo / "deployments").exists()
    assert proc.stdout.splitlines() == [
        "+ gcluster create blueprints/gcp/hpc-slurm.yaml -o deployments --vars "
        "project_id=my-proj-123,deployment_name=llmft-test,region=us-central1,zone=us-central1-a",
        "+ gcluster deploy deployments/llmft-test --auto-approve",
    ]


def test_gcp_missing_gcluster_is_refused_with_install_hint(tmp_path):
    cli = Cli(tmp_path, tools=("gcloud", "pcluster", "aws"))
    proc = cli.run("create", "llmft-test", **GCP_ENV)
    assert proc.returncode != 0
    assert "'gcluster' (or its older name 'ghpc') is not installed" in proc.stderr
    assert "github.com/GoogleCloudPlatform/cluster-toolkit" in proc.stderr
    assert cli.calls() == []


def test_gcp_status_and_ssh_need_gcloud(tmp_path):
    cli = Cli(tmp_path, tools=("gcluster",))
    for command in ("status", "ssh"):
        proc = cli.run(command, "llmft-test", **GCP_ENV)
        assert proc.returncode != 0
        assert "'gcloud' is not installed" in proc.stderr and "cloud.google.com/sdk" in proc.stderr
    assert cli.calls() == []


def test_gcp_missing_project_id_is_refused(cli):
    proc = cli.run("create", "llmft-test")
    assert proc.returncode != 0
    assert "PROJECT_ID is not set: export PROJECT_ID=" in proc.stderr
    assert cli.calls() == []


@pytest.mark.parametrize(
    "env",
    [
        {"PROJECT_ID": "My Project"},
        {"PROJECT_ID": "proj,deployment_name=evil"},  # would inject into --vars
        {"PROJECT_ID": "my-proj-123", "REGION": "us-central1,zone=x"},
        {"PROJECT_ID": "my-proj-123", "REGION": "us-central1", "ZONE": "europe-west4-a"},
    ],
)
def test_gcp_malformed_project_region_zone_are_refused(cli, env):
    proc = cli.run("create", "llmft-test", **env)
    assert proc.returncode != 0
    assert "manage_cluster.sh: error:" in proc.stderr
    assert cli.calls() == []


def test_gcp_missing_blueprint_is_refused(cli):
    (cli.repo / "blueprints" / "gcp" / "hpc-slurm.yaml").unlink()
    proc = cli.run("create", "llmft-test", **GCP_ENV)
    assert proc.returncode != 0
    assert "blueprint blueprints/gcp/hpc-slurm.yaml not found" in proc.stderr
    assert cli.calls() == []


BAD_NAMES = ["a;rm -rf /", "$(id)", "UPPER", "`id`", "under_score", "9lives", "trail-", "x", "", "a b", "ünï"]


@pytest.mark.parametrize("provider", ["gcp", "aws"])
@pytest.mark.parametrize("command", ["create", "destroy", "status", "ssh"])
@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused_before_any_cloud_command(cli, provider, command, name):
    (cli.repo / "deployments").mkdir()
    proc = cli.run("--provider", provider, command, name, **GCP_ENV, **AWS_ENV)
    assert proc.returncode == 2
    assert "invalid cluster name" in proc.stderr
    assert "lowercase letters, digits and hyphens" in proc.stderr
    assert cli.calls() == []
    assert list((cli.repo / "deployments").iterdir()) == []


def test_name_length_limits_per_cloud(cli):
    assert cli.run("--dry-run", "create", "a" * 30, **GCP_ENV).returncode == 0
    too_long = cli.run("--dry-run", "create", "a" * 31, **GCP_ENV)
    assert too_long.returncode == 2 and "2 to 30 characters on Google Cloud" in too_long.stderr
    assert cli.run("--provider", "aws", "--dry-run", "create", "a" * 60, **AWS_ENV).returncode == 0
    too_long = cli.run("--provider", "aws", "--dry-run", "create", "a" * 61, **AWS_ENV)
    assert too_long.returncode == 2 and "2 to 60 characters on AWS" in too_long.stderr
    assert cli.calls() == []


def test_help_and_usage_errors(cli):
    proc = cli.run("--help")
    assert proc.returncode == 0
    for word in ("create", "destroy", "status", "ssh", "--provider gcp|aws", "--dry-run", "--force"):
        assert word in proc.stdout
    for args, message in [
        ((), "no command given"),
        (("deploy",), "unknown command 'deploy'"),
        (("--provider", "azure", "create"), "unknown provider 'azure'"),
        (("--bogus", "create"), "unknown option '--bogus'"),
        (("create", "one", "two"), "too many arguments"),
    ]:
        proc = cli.run(*args, **GCP_ENV)
        assert proc.returncode == 2, args
        assert message in proc.stderr, (args, proc.stderr)
    assert cli.calls() == []


# --------------------------------------------------------------------------- AWS


def test_aws_create_fills_config_uploads_scripts_creates_and_waits(cli):
    cli.respond("pcluster", "{}", '"CREATE_IN_PROGRESS"', '"CREATE_IN_PROGRESS"', '"CREATE_COMPLETE"')
    proc = cli.run("--provider", "aws", "create", "llmft-test", **AWS_ENV)
    assert proc.returncode == 0, proc.stderr
    describe = [
        "pcluster",
        "describe-cluster",
        "--cluster-name",
        "llmft-test",
        "--region",
        "us-east-1",
        "--query",
        "clusterStatus",
    ]
    assert cli.calls() == [
        [
            "aws",
            "s3",
            "cp",
            "blueprints/aws/on-head-node-configured.sh",
            "s3://llmft-scripts-bucket/llmft/llmft-test/on-head-node-configured.sh",
            "--region",
            "us-east-1",
        ],
        [
            "aws",
            "s3",
            "cp",
            "blueprints/aws/on-compute-node-start.sh",
            "s3://llmft-scripts-bucket/llmft/llmft-test/on-compute-node-start.sh",
            "--region",
            "us-east-1",
        ],
        [
            "pcluster",
            "create-cluster",
            "--cluster-name",
            "llmft-test",
            "--cluster-configuration",
            "deployments/llmft-test/cluster-config.yaml",
            "--region",
            "us-east-1",
        ],
        describe,
        describe,
        describe,
    ]
    assert "cluster llmft-test: CREATE_COMPLETE" in proc.stdout
    written = (cli.repo / "deployments" / "llmft-test" / "cluster-config.yaml").read_text()
    assert "${" not in written.split("\nRegion:")[1]  # every placeholder below the header comment filled
    for value in (
        "subnet-0123456789abcdef0",
        "subnet-0fedcba9876543210",
        "llmft-key",
        "s3://llmft-scripts-bucket/llmft/llmft-test/on-head-node-configured.sh",
    ):
        assert value in written
    # `config` prints exactly what create wrote.
    assert cli.run("--provider", "aws", "config", "llmft-test", **AWS_ENV).stdout == written


def test_aws_create_failure_points_at_stack_events(cli):
    cli.respond("pcluster", "{}", '"CREATE_IN_PROGRESS"', '"CREATE_FAILED"')
    proc = cli.run("--provider", "aws", "create", "llmft-test", **AWS_ENV)
    assert proc.returncode != 0
    assert "CREATE_FAILED" in proc.stderr
    assert "pcluster get-cluster-stack-events --cluster-name llmft-test --region us-east-1" in proc.stderr


def test_aws_create_wait_times_out(cli):
    cli.respond("pcluster", "{}", '"CREATE_IN_PROGRESS"', '"CREATE_IN_PROGRESS"')
    proc = cli.run("--provider", "aws", "create", "llmft-test", WAIT_TIMEOUT_SECONDS="0", **AWS_ENV)
    assert proc.returncode != 0
    assert "still CREATE_IN_PROGRESS after 0s" in proc.stderr


def test_aws_destroy_deletes_and_waits_until_gone(cli):
    cli.respond(
        "pcluster",
        "{}",
        '"DELETE_IN_PROGRESS"',
        'EXIT 1 {"message": "Cluster \'llmft-test\' does not exist or belongs to an incompatible '
        'ParallelCluster major version."}',
    )
    proc = cli.run("--provider", "aws", "destroy", "llmft-test", **AWS_ENV)
    assert proc.returncode == 0, proc.stderr
    describe = [
        "pcluster",
        "describe-cluster",
        "--cluster-name",
        "llmft-test",
        "--region",
        "us-east-1",
        "--query",
        "clusterStatus",
    ]
    assert cli.calls() == [
        ["pcluster", "delete-cluster", "--cluster-name", "llmft-test", "--region", "us-east-1"],
        describe,
        describe,
    ]
    assert "cluster llmft-test: DELETED" in proc.stdout


def test_aws_status_and_ssh(cli, tmp_path):
    assert cli.run("--provider", "aws", "status", "llmft-test", **AWS_ENV).returncode == 0
    key = tmp_path / "llmft-key.pem"
    key.write_text("not a real key\n")
    assert cli.run("--provider", "aws", "ssh", "llmft-test", SSH_KEY_FILE=str(key), **AWS_ENV).returncode == 0
    assert (
        cli.run("--provider=aws", "ssh", "llmft-test", AWS_DEFAULT_REGION="eu-west-1", POLL_SECONDS="0").returncode
        == 0
    )
    assert cli.calls() == [
        ["pcluster", "describe-cluster", "--cluster-name", "llmft-test", "--region", "us-east-1"],
        ["pcluster", "ssh", "--cluster-name", "llmft-test", "--region", "us-east-1", "-i", str(key)],
        ["pcluster", "ssh", "--cluster-name", "llmft-test", "--region", "eu-west-1"],
    ]


def test_aws_dry_run_writes_and_runs_nothing(cli):
    proc = cli.run("--provider", "aws", "--dry-run", "create", "llmft-test", **AWS_ENV)
    assert proc.returncode == 0, proc.stderr
    assert cli.calls() == []
    assert not (cli.repo / "deployments").exists()
    assert (
        "+ pcluster create-cluster --cluster-name llmft-test --cluster-configuration "
        "deployments/llmft-test/cluster-config.yaml --region us-east-1" in proc.stdout
    )


def test_aws_refuses_existing_deployment_dir_without_force(cli):
    (cli.repo / "deployments" / "llmft-test").mkdir(parents=True)
    proc = cli.run("--provider", "aws", "create", "llmft-test", **AWS_ENV)
    assert proc.returncode != 0 and "already exists" in proc.stderr and "--force" in proc.stderr
    assert cli.calls() == []


def test_aws_missing_pcluster_is_refused_with_install_hint(tmp_path):
    cli = Cli(tmp_path, tools=("gcluster", "gcloud", "aws"))
    for command in ("create", "destroy", "status", "ssh"):
        proc = cli.run("--provider", "aws", command, "llmft-test", **AWS_ENV)
        assert proc.returncode != 0
        assert "'pcluster' is not installed" in proc.stderr and "pip install aws-parallelcluster" in proc.stderr
    assert cli.calls() == []


def test_aws_missing_aws_cli_is_refused_on_create(tmp_path):
    cli = Cli(tmp_path, tools=("pcluster",))
    proc = cli.run("--provider", "aws", "create", "llmft-test", **AWS_ENV)
    assert proc.returncode != 0 and "'aws' is not installed" in proc.stderr
    assert cli.calls() == []


def test_aws_missing_region_is_refused(cli):
    env = {k: v for k, v in AWS_ENV.items() if k != "AWS_REGION"}
    proc = cli.run("--provider", "aws", "status", "llmft-test", **env)
    assert proc.returncode == 2 and "AWS_REGION is not set" in proc.stderr
    assert cli.calls() == []


def test_aws_missing_variables_are_listed_together(cli):
    proc = cli.run("--provider", "aws", "create", "llmft-test", AWS_REGION="us-east-1", KEY_NAME="k")
    assert proc.returncode == 2
    assert "missing environment variables: HEAD_SUBNET_ID COMPUTE_SUBNET_ID S3_BUCKET" in proc.stderr
    assert cli.calls() == []


@pytest.mark.parametrize(
    "override",
    [
        {"HEAD_SUBNET_ID": "subnet-xyz; rm -rf /"},
        {"COMPUTE_SUBNET_ID": "vpc-0123456789abcdef0"},
        {"KEY_NAME": "key\nRegion: evil"},  # would inject YAML
        {"S3_BUCKET": "My_Bucket"},
        {"AWS_REGION": "$(id)"},
    ],
)
def test_aws_malformed_variables_are_refused(cli, override):
    proc = cli.run("--provider", "aws", "create", "llmft-test", **{**AWS_ENV, **override})
    assert proc.returncode == 2
    assert "is not a valid" in proc.stderr
    assert "\n" not in proc.stderr.strip()  # one clear line, control characters not echoed
    assert cli.calls() == []
    assert not (cli.repo / "deployments").exists()


def test_pcluster_cli_accepts_the_emitted_command_lines(cli):
    """Parse every pcluster argv the script ran with the real pcluster 3 CLI's own argument parser."""
    cli.respond("pcluster", "{}", '"CREATE_COMPLETE"', "{}", "EXIT 1 does not exist", "{}", "")
    assert cli.run("--provider", "aws", "create", "llmft-test", **AWS_ENV).returncode == 0
    assert cli.run("--provider", "aws", "destroy", "llmft-test", **AWS_ENV).returncode == 0
    assert cli.run("--provider", "aws", "status", "llmft-test", **AWS_ENV).returncode == 0
    assert cli.run("--provider", "aws", "ssh", "llmft-test", **AWS_ENV).returncode == 0
    argvs = [call[1:] for call in cli.calls() if call[0] == "pcluster"]
    assert {a[0] for a in argvs} == {"create-cluster", "describe-cluster", "delete-cluster", "ssh"}
    program = r"""
import json, sys
import pcluster.cli.model as model
from pcluster.cli.entrypoint import add_cli_commands, gen_parser
parser, parser_map = gen_parser(model.load_model(model.package_spec()))
add_cli_commands(parser_map)
problems = []
for argv in json.load(sys.stdin):
    try:
        args, extra = parser.parse_known_args(argv)
    except BaseException as e:  # argparse exits; pcluster raises ParameterException for bad values
        problems.append([argv, repr(e)])
        continue
    if extra and not getattr(args, "expects_extra_args", False):
        problems.append([argv, f"unknown arguments {extra}"])
    elif args.operation != argv[0] or args.cluster_name != "llmft-test" or getattr(args, "region", None) != "us-east-1":
        problems.append([argv, f"parsed as {args.operation} {args.cluster_name}"])
print(json.dumps(problems))
"""
    proc = subprocess.run(
        [pcluster_python(), "-c", program],
        input=json.dumps(argvs),
        cwd=cli.repo,
        env={**os.environ, "AWS_DEFAULT_REGION": "us-east-1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def documented_cluster_commands() -> list[list[str]]:
    """The ./manage_cluster.sh invocations in docs/clusters.md, as argv lists."""
    import shlex

    section = (REPO / "docs" / "clusters.md").read_text()
    commands = []
    for block in section.split("```bash")[1:]:
        for line in block.split("```")[0].splitlines():
            if "./manage_cluster.sh" not in line or "|" in line:  # skip the usage synopsis
                continue
            words = shlex.split(line[line.index("./manage_cluster.sh") :], comments=True)
            commands.append(words[1:])
    for inline in re.findall(r"`(\./manage_cluster\.sh [^`|]*)`", section):  # in the prose
        commands.append(shlex.split(inline)[1:])
    return commands


def test_documented_cluster_commands_work(cli):
    """Every manage_cluster.sh command docs/clusters.md shows is accepted (run with --dry-run)."""
    commands = documented_cluster_commands()
    assert {c[c.index("--provider") + 1] if "--provider" in c else "gcp" for c in commands} == {"gcp", "aws"}
    assert {
        next(w for w in c if w in ("create", "destroy", "status", "ssh", "config", "--help")) for c in commands
    } >= {"create", "destroy", "status", "ssh"}
    (cli.repo / "deployments" / "llmft-cluster").mkdir(parents=True)  # as left by create, for destroy
    for args in commands:
        force = ["--force"] if "create" in args else []
        proc = cli.run("--dry-run", *force, *args, **GCP_ENV, **AWS_ENV)
        assert proc.returncode == 0, (args, proc.stderr)
    assert cli.calls() == []
