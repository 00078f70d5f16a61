#!/usr/bin/env bash
# Create, inspect and destroy llmft's Slurm GPU cluster on Google Cloud (Cluster Toolkit,
# blueprints/gcp/hpc-slurm.yaml) or AWS (ParallelCluster 3, blueprints/aws/config.yaml).
# Run ./manage_cluster.sh --help for usage. Every cloud command is printed before it runs;
# --dry-run prints them without running anything.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: ./manage_cluster.sh [--provider gcp|aws] [--dry-run] [--force] COMMAND [NAME]

Commands:
  create [NAME]   create the cluster (NAME defaults to llmft-cluster)
  destroy [NAME]  delete the cluster and everything it created (shared filesystem included)
  status [NAME]   show the cluster's state (GCP: its VMs; AWS: pcluster describe-cluster)
  ssh [NAME]      open a shell on the login node (AWS: the head node)
  config [NAME]   AWS only: print the filled ParallelCluster config without creating anything

Options:
  --provider gcp|aws  cloud to use (default: gcp)
  --dry-run           print the cloud commands instead of running them
  --force             create even if deployments/NAME exists (overwrites it)
  -h, --help          show this help

NAME: lowercase letters, digits and hyphens, starting with a letter and ending with a
letter or digit; 2 to 30 characters on GCP, 2 to 60 on AWS.

Google Cloud (needs gcluster or ghpc from Cluster Toolkit, and gcloud for status/ssh):
  PROJECT_ID  (required) your project id
  REGION      (default us-central1)   ZONE (default us-central1-a); pick ones with L4/A100 quota
  create runs:  gcluster create blueprints/gcp/hpc-slurm.yaml -o deployments --vars project_id=...,deployment_name=NAME,region=...,zone=...
                gcluster deploy deployments/NAME --auto-approve
  destroy runs: gcluster destroy deployments/NAME --auto-approve

AWS (needs pcluster from aws-parallelcluster 3.11.1+, and the aws CLI for create):
  AWS_REGION (or AWS_DEFAULT_REGION)  region, e.g. us-east-1
  HEAD_SUBNET_ID, COMPUTE_SUBNET_ID   subnet ids (subnet-...); compute: private with NAT
  KEY_NAME                            EC2 key pair name for SSH to the head node
  S3_BUCKET                           bucket the custom-action scripts are uploaded to
  SSH_KEY_FILE                        (ssh only, optional) private key passed to ssh -i
  POLL_SECONDS (default 30), WAIT_TIMEOUT_SECONDS (default 5400): create/destroy status loop
  create writes deployments/NAME/cluster-config.yaml, uploads blueprints/aws/*.sh to
  s3://S3_BUCKET/llmft/NAME/, runs pcluster create-cluster and waits for CREATE_COMPLETE.
EOF
}

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly REPO_DIR
readonly GCP_BLUEPRINT=blueprints/gcp/hpc-slurm.yaml
readonly AWS_TEMPLATE=blueprints/aws/config.yaml
readonly AWS_SCRIPTS=(blueprints/aws/on-head-node-configured.sh blueprints/aws/on-compute-node-start.sh)
readonly DEPLOYMENTS=deployments
readonly DEFAULT_NAME=llmft-cluster
# Spelled out rather than [a-z]: character ranges depend on the locale.
readonly LOWER=abcdefghijklmnopqrstuvwxyz
readonly DIGITS=0123456789

die() { # die [exit_code] message...
    local code=1
    if [[ $1 =~ ^[0-9]+$ ]]; then code=$1; shift; fi
    printf 'manage_cluster.sh: error: %s\n' "$*" >&2
    exit "$code"
}

# A value safe to echo back in an error message (no control characters).
show() { printf '%s' "${1//[^[:print:]]/?}"; }

# Print a command the way a shell would read it back.
quote_cmd() {
    local out="" a
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
            out+="$a "
        else
            out+="'${a//\'/\'\\\'\'}' "
        fi
    done
    printf '%s' "${out% }"
}

# Print a cloud command, then run it unless --dry-run.
run() {
    printf '+ %s\n' "$(quote_cmd "$@")"
    if ((dry_run)); then
        return 0
    fi
    "$@"
}

need_tool() { # need_tool name how-to-install...
    local tool=$1
    shift
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed (not found on PATH). $*"
}

validate_name() { # validate_name name max_length cloud
    local re="^[$LOWER][$LOWER$DIGITS-]*[$LOWER$DIGITS]\$"
    if [[ ! $1 =~ $re ]] || ((${#1} > $2)); then
        die 2 "invalid cluster name '$(show "$1")': use only lowercase letters, digits and hyphens," \
            "start with a letter, end with a letter or digit, 2 to $2 characters on $3" \
            "(for example: $DEFAULT_NAME)."
    fi
}

# check_var NAME regex example what: the variable must be set and match regex.
check_var() {
    local var=$1 re=$2 example=$3 what=$4 value
    value=${!var:-}
    [[ -n $value ]] || die 2 "$var is not set: export $var=$example ($what)."
    [[ $value =~ $re ]] || die 2 "$var='$(show "$value")' is not a valid $what (expected something like $example)."
}

# ---------------------------------------------------------------- Google Cloud
gcp_tool() {
    if command -v gcluster >/dev/null 2>&1; then
        echo gcluster
    elif command -v ghpc >/dev/null 2>&1; then
        echo ghpc
    else
        die "Cluster Toolkit's 'gcluster' (or its older name 'ghpc') is not installed (not found on PATH)." \
            "Install it: git clone https://github.com/GoogleCloudPlatform/cluster-toolkit &&" \
            "cd cluster-toolkit && make, then add that directory to PATH" \
            "(needs Go and Terraform; see https://cloud.google.com/cluster-toolkit/docs/setup/configure-environment)."
    fi
}

gcp_need_gcloud() {
    need_tool gcloud "Install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install), then run: gcloud auth login"
}

gcp_check_project() {
    check_var PROJECT_ID "^[$LOWER][$LOWER$DIGITS-]{4,28}[$LOWER$DIGITS]\$" my-project-123 "Google Cloud project id"
}

gcp_check_location() {
    REGION=${REGION:-us-central1}
    ZONE=${ZONE:-us-central1-a}
    check_var REGION "^[$LOWER]+-[$LOWER]+[$DIGITS]+\$" us-central1 "Google Cloud region"
    check_var ZONE "^[$LOWER]+-[$LOWER]+[$DIGITS]+-[$LOWER]\$" us-central1-a "Google Cloud zone"
    [[ $ZONE == "$REGION"-? ]] || die 2 "ZONE=$ZONE is not in REGION=$REGION: set ZONE to a zone of that region (e.g. $REGION-a)."
}

gcp_create() {
    local tool dir=$DEPLOYMENTS/$name
    gcp_check_project
    gcp_check_location
    tool=$(gcp_tool)
    [[ -f $GCP_BLUEPRINT ]] || die "blueprint $GCP_BLUEPRINT not found: run from a complete llmft checkout."
    if [[ -e $dir ]] && ((!force)); then
        die "deployment directory $dir already exists (from an earlier create of '$name')." \
            "To finish or update that deployment run: $tool deploy $dir --auto-approve;" \
            "to regenerate it from the blueprint pass --force; to remove the cluster: ./manage_cluster.sh destroy $name"
    fi
    local args=(create "$GCP_BLUEPRINT" -o "$DEPLOYMENTS"
        --vars "project_id=$PROJECT_ID,deployment_name=$name,region=$REGION,zone=$ZONE")
    if ((force)); then
        args+=(-w)
    fi
    ((dry_run)) || mkdir -p "$DEPLOYMENTS"
    run "$tool" "${args[@]}"
    run "$tool" deploy "$dir" --auto-approve
    ((dry_run)) || cat <<EOF

Cluster '$name' is up. Next:
  ./manage_cluster.sh ssh $name        # log in to the login node
  # then, on the login node: clone llmft into your home (/home is the shared Filestore), see docs/clusters.md
EOF
}

gcp_destroy() {
    local tool dir=$DEPLOYMENTS/$name
    tool=$(gcp_tool)
    [[ -d $dir ]] || die "no deployment directory $dir: no cluster named '$name' was created from this checkout." \
        "If it exists anyway, delete its resources in the Cloud Console (label ghpc_deployment=$name)."
    run "$tool" destroy "$dir" --auto-approve
}

gcp_status() {
    gcp_check_project
    gcp_need_gcloud
    run gcloud compute instances list --project "$PROJECT_ID" \
        --filter "labels.ghpc_deployment=$name" \
        --format "table(name,zone.basename(),status,labels.slurm_instance_role)"
}

gcp_ssh() {
    gcp_check_project
    gcp_need_gcloud
    local lookup=(gcloud compute instances list --project "$PROJECT_ID"
        --filter "labels.ghpc_deployment=$name AND labels.slurm_instance_role=login"
        --format "value(name,zone.basename())" --limit 1)
    if ((dry_run)); then
        run "${lookup[@]}"
        run gcloud compute ssh LOGIN_NODE --zone LOGIN_ZONE --project "$PROJECT_ID" --tunnel-through-iap
        return 0
    fi
    local found node zone
    printf '+ %s\n' "$(quote_cmd "${lookup[@]}")"
    found=$("${lookup[@]}")
    read -r node zone <<<"$found" || true
    local re="^[$LOWER][$LOWER$DIGITS-]*\$"
    if [[ ! ${node:-} =~ $re || ! ${zone:-} =~ $re ]]; then
        die "no login node found for cluster '$name' in project $PROJECT_ID (is it created? ./manage_cluster.sh status $name)"
    fi
    run gcloud compute ssh "$node" --zone "$zone" --project "$PROJECT_ID" --tunnel-through-iap
}

# ------------------------------------------------------------------------- AWS
aws_need_pcluster() {
    need_tool pcluster "Install AWS ParallelCluster 3 (>= 3.11.1) in a virtual environment:" \
        "python3 -m venv ~/pcluster-venv && ~/pcluster-venv/bin/pip install aws-parallelcluster &&" \
        "export PATH=~/pcluster-venv/bin:\$PATH (create-cluster also needs Node.js;" \
        "see https://docs.aws.amazon.com/parallelcluster/latest/ug/install-v3-parallelcluster.html)."
}

aws_check_region() {
    AWS_REGION=${AWS_REGION:-${AWS_DEFAULT_REGION:-}}
    [[ -n $AWS_REGION ]] || die 2 "AWS_REGION is not set: export AWS_REGION=us-east-1 (a region with G6/P4d quota)."
    check_var AWS_REGION "^[$LOWER]{2}(-gov)?-[$LOWER]+-[$DIGITS]\$" us-east-1 "AWS region"
}

aws_check_create_vars() {
    local missing=() v
    for v in HEAD_SUBNET_ID COMPUTE_SUBNET_ID KEY_NAME S3_BUCKET; do
        [[ -n ${!v:-} ]] || missing+=("$v")
    done
    if ((${#missing[@]})); then
        die 2 "missing environment variables: ${missing[*]}. Set them before create, e.g." \
            "export HEAD_SUBNET_ID=subnet-0123456789abcdef0 COMPUTE_SUBNET_ID=subnet-0fedcba9876543210" \
            "KEY_NAME=my-key S3_BUCKET=my-bucket (see ./manage_cluster.sh --help)."
    fi
    local subnet_re="^subnet-[0-9a-f]{8}([0-9a-f]{9})?\$"
    check_var HEAD_SUBNET_ID "$subnet_re" subnet-0123456789abcdef0 "subnet id"
    check_var COMPUTE_SUBNET_ID "$subnet_re" subnet-0fedcba9876543210 "subnet id"
    check_var KEY_NAME '^[A-Za-z0-9._-]{1,255}$' my-key "EC2 key pair name (letters, digits, . _ -)"
    check_var S3_BUCKET "^[$LOWER$DIGITS][$LOWER$DIGITS.-]{1,61}[$LOWER$DIGITS]\$" my-bucket "S3 bucket name"
}

# Print blueprints/aws/config.yaml with its ${PLACEHOLDERS} filled (values were validated above).
aws_render_config() {
    [[ -f $AWS_TEMPLATE ]] || die "ParallelCluster config $AWS_TEMPLATE not found: run from a complete llmft checkout."
    local text
    text=$(<"$AWS_TEMPLATE")
    local key value
    for key in AWS_REGION HEAD_SUBNET_ID COMPUTE_SUBNET_ID KEY_NAME S3_BUCKET CLUSTER_NAME; do
        if [[ $key == CLUSTER_NAME ]]; then value=$name; else value=${!key}; fi
        text=${text//"\${$key}"/"$value"}
    done
    local left='\$\{[A-Z_]+\}'
    if [[ $text =~ $left ]]; then
        die "$AWS_TEMPLATE has a placeholder manage_cluster.sh does not fill: ${BASH_REMATCH[0]}"
    fi
    printf '%s\n' "$text"
}

# Poll pcluster describe-cluster until the cluster reaches state $1 (or is gone, for deletes).
aws_wait() {
    local want=$1 poll=${POLL_SECONDS:-30} timeout=${WAIT_TIMEOUT_SECONDS:-5400}
    [[ $poll =~ ^[0-9]+$ ]] || die 2 "POLL_SECONDS must be a whole number of seconds, not '$(show "$poll")'."
    [[ $timeout =~ ^[0-9]+$ ]] || die 2 "WAIT_TIMEOUT_SECONDS must be a whole number of seconds, not '$(show "$timeout")'."
    local cmd=(pcluster describe-cluster --cluster-name "$name" --region "$AWS_REGION" --query clusterStatus)
    if ((dry_run)); then
        printf '+ %s   (repeated every %ss until %s)\n' "$(quote_cmd "${cmd[@]}")" "$poll" "$want"
        return 0
    fi
    printf '+ %s   (every %ss until %s)\n' "$(quote_cmd "${cmd[@]}")" "$poll" "$want"
    local start=$SECONDS out status
    while :; do
        if out=$("${cmd[@]}" 2>&1); then
            status=${out//[^A-Z_]/}
        elif [[ $want == DELETED && $out == *"does not exist"* ]]; then
            status=DELETED
        else
            die "pcluster describe-cluster failed: $(show "$out")"
        fi
        case $status in
            "$want")
                echo "cluster $name: $status"
                return 0
                ;;
            *_FAILED | *FAILED*)
                die "cluster $name: $status. Find out why with:" \
                    "pcluster get-cluster-stack-events --cluster-name $name --region $AWS_REGION"
                ;;
        esac
        echo "cluster $name: $status (waiting)"
        if ((SECONDS - start >= timeout)); then
            die "cluster $name still $status after ${timeout}s; check it with: ./manage_cluster.sh --provider aws status $name"
        fi
        sleep "$poll"
    done
}

aws_create() {
    local dir=$DEPLOYMENTS/$name config
    config=$dir/cluster-config.yaml
    aws_check_region
    aws_check_create_vars
    aws_need_pcluster
    need_tool aws "It uploads the custom-action scripts to S3: install the AWS CLI" \
        "(https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html) and run aws configure."
    local rendered script
    rendered=$(aws_render_config)
    for script in "${AWS_SCRIPTS[@]}"; do
        [[ -f $script ]] || die "custom-action script $script not found: run from a complete llmft checkout."
    done
    if [[ -e $dir ]] && ((!force)); then
        die "deployment directory $dir already exists (from an earlier create of '$name')." \
            "Pass --force to overwrite its config and create again, or remove the cluster: ./manage_cluster.sh --provider aws destroy $name"
    fi
    if ((dry_run)); then
        echo "(dry run) would write $config (print it with: ./manage_cluster.sh --provider aws config $name)"
    else
        mkdir -p "$dir"
        printf '%s\n' "$rendered" >"$config"
        echo "wrote $config"
    fi
    for script in "${AWS_SCRIPTS[@]}"; do
        run aws s3 cp "$script" "s3://$S3_BUCKET/llmft/$name/${script##*/}" --region "$AWS_REGION"
    done
    run pcluster create-cluster --cluster-name "$name" --cluster-configuration "$config" --region "$AWS_REGION"
    aws_wait CREATE_COMPLETE
    ((dry_run)) || cat <<EOF

Cluster '$name' is up. Next:
  ./manage_cluster.sh --provider aws ssh $name   # log in to the head node
  # then: clone llmft into /fsx (the shared FSx for Lustre filesystem), see docs/clusters.md
EOF
}

aws_destroy() {
    aws_check_region
    aws_need_pcluster
    run pcluster delete-cluster --cluster-name "$name" --region "$AWS_REGION"
    aws_wait DELETED
}

aws_status() {
    aws_check_region
    aws_need_pcluster
    run pcluster describe-cluster --cluster-name "$name" --region "$AWS_REGION"
}

aws_ssh() {
    aws_check_region
    aws_need_pcluster
    local args=(pcluster ssh --cluster-name "$name" --region "$AWS_REGION")
    if [[ -n ${SSH_KEY_FILE:-} ]]; then
        [[ -f $SSH_KEY_FILE ]] || die 2 "SSH_KEY_FILE=$(show "$SSH_KEY_FILE") does not exist: point it at the private key of KEY_NAME."
        args+=(-i "$SSH_KEY_FILE")
    fi
    run "${args[@]}"
}

aws_config() {
    aws_check_region
    aws_check_create_vars
    aws_render_config
}

# ------------------------------------------------------------------------ main
provider=gcp
dry_run=0
force=0
command=""
name=""
name_given=0
while (($#)); do
    case $1 in
        -h | --help)
            usage
            exit 0
            ;;
        --provider)
            (($# >= 2)) || die 2 "--provider needs a value: gcp or aws."
            provider=$2
            shift 2
            ;;
        --provider=*)
            provider=${1#*=}
            shift
            ;;
        --dry-run)
            dry_run=1
            shift
            ;;
        --force)
            force=1
            shift
            ;;
        -*)
            die 2 "unknown option '$(show "$1")' (see ./manage_cluster.sh --help)."
            ;;
        *)
            if [[ -z $command ]]; then
                command=$1
            elif ((!name_given)); then
                name=$1
                name_given=1
            else
                die 2 "too many arguments: '$(show "$1")' (usage: ./manage_cluster.sh [options] COMMAND [NAME])."
            fi
            shift
            ;;
    esac
done

[[ -n $command ]] || { usage >&2; die 2 "no command given: use create, destroy, status, ssh or config."; }
case $command in
    create | destroy | status | ssh | config) ;;
    *) die 2 "unknown command '$(show "$command")': use create, destroy, status, ssh or config (see --help)." ;;
esac
if ((!name_given)); then
    name=$DEFAULT_NAME
fi

cd "$REPO_DIR"
case $provider in
    gcp)
        validate_name "$name" 30 "Google Cloud"
        case $command in
            create) gcp_create ;;
            destroy) gcp_destroy ;;
            status) gcp_status ;;
            ssh) gcp_ssh ;;
            config) die 2 "config is for --provider aws; the GCP blueprint gets its values from gcluster --vars (see --help)." ;;
        esac
        ;;
    aws)
        validate_name "$name" 60 "AWS"
        case $command in
            create) aws_create ;;
            destroy) aws_destroy ;;
            status) aws_status ;;
            ssh) aws_ssh ;;
            config) aws_config ;;
        esac
        ;;
    *)
        die 2 "unknown provider '$(show "$provider")': use --provider gcp or --provider aws."
        ;;
esac
