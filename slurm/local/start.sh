#!/usr/bin/env bash
# Start a real Slurm cluster on this one machine: munge, slurmctld and three slurmd, each node with four
# GPUs as Slurm sees them (empty device files; torch sees no CUDA). Partition debug (the default) has n1 and
# n2; the hidden partition spare has n1-n3, for a job that must go on without a node it excluded.
#
#   slurm/local/start.sh [--install] [--plugstack FILE] [--enroot PREFIX] [STATE_DIR]
#   export SLURM_CONF=STATE_DIR/slurm.conf      # then: sinfo, sbatch, squeue, scontrol ...
#   slurm/local/stop.sh [STATE_DIR]
#
# STATE_DIR defaults to $LLMFT_SLURM_DIR, else /tmp/llmft-slurm-$USER. Everything the cluster
# writes (configs, munge key and socket, logs, spool, pid files) lives there. --install first
# installs the Debian packages (slurmctld slurmd slurm-client munge) when they are missing
# (needs root and apt-get). Ports are picked free from $LLMFT_SLURM_PORT_BASE (default 16817) up.
# --plugstack FILE loads the SPANK plugins FILE lists (PlugStackConfig; the tests load the real pyxis).
# --enroot PREFIX installs enroot's install tree PREFIX as /usr/local/bin/enroot (where pyxis's job epilog finds it),
# which gives each node its own data, runtime and cache paths under /tmp/llmft-enroot/NODE: the node-local disk of a
# real node (pyxis refuses a job's ENROOT_*_PATH; only the node's own configuration sets them), and puts a per-node
# `enroot` first on each slurmd's PATH (where pyxis's job steps find it) that names the node to it.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "slurm/local/start.sh: $*" >&2; exit 1; }

install=0
state=""
plugstack=""
enroot_prefix=""
while (( $# > 0 )); do
  arg=$1; shift
  case "$arg" in
    --install) install=1 ;;
    --plugstack) (( $# > 0 )) || die "--plugstack needs a file"; plugstack=$1; shift
                 [[ -f "$plugstack" ]] || die "--plugstack $plugstack: no such file"
                 plugstack=$(cd "$(dirname "$plugstack")" && pwd)/$(basename "$plugstack") ;;
    --enroot) (( $# > 0 )) || die "--enroot needs enroot's install prefix"; enroot_prefix=$1; shift
              [[ -x "$enroot_prefix/bin/enroot" ]] || die "--enroot $enroot_prefix: no bin/enroot there" ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$arg' (known: --install, --plugstack FILE, --enroot PREFIX, --help)" ;;
    *) [[ -z "$state" ]] || die "only one STATE_DIR may be given"; state=$arg ;;
  esac
done
state=${state:-${LLMFT_SLURM_DIR:-/tmp/llmft-slurm-$(id -un)}}
mkdir -p "$state"
state=$(cd "$state" && pwd)

need=(munged mungekey slurmctld slurmd sbatch srun scontrol sinfo)
missing() {
  local b
  for b in "${need[@]}"; do
    command -v "$b" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$b" >/dev/null 2>&1 || { echo "$b"; return 0; }
  done
}
export PATH="$PATH:/usr/sbin:/sbin"
if [[ -n "$(missing)" ]]; then
  if [[ "$install" == 1 ]]; then
    [[ "$(id -u)" == 0 ]] || die "installing Slurm needs root (apt-get); missing: $(missing)"
    command -v apt-get >/dev/null 2>&1 || die "no apt-get to install Slurm with; install slurmctld slurmd slurm-client munge yourself"
    echo "installing slurmctld slurmd slurm-client munge ..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
  fi
  [[ -z "$(missing)" ]] || die "'$(missing)' not found; install the packages (apt-get install -y slurmctld slurmd slurm-client munge) or rerun with --install"
fi

if [[ -s "$state/run/started.pids" ]]; then
  while read -r _name pid; do
    if kill -0 "$pid" 2>/dev/null; then
      die "a cluster started from $state is still running (pid $pid); stop it with slurm/local/stop.sh $state"
    fi
  done < "$state/run/started.pids"
fi

# Fresh state every start: configs, key, spool and controller state.
rm -rf "$state/ctld" "$state/spool" "$state/run" "$state/log" "$state/munge"
mkdir -p "$state/ctld" "$state/spool" "$state/run" "$state/log" "$state/munge"
chmod 755 "$state" "$state/run" "$state/log" "$state/spool"
chmod 700 "$state/ctld"
chmod 755 "$state/munge"
for g in 0 1 2 3; do : > "$state/fake-gpu$g"; done
: > "$state/run/started.pids"

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
ports=()
p=${LLMFT_SLURM_PORT_BASE:-16817}
[[ "$p" =~ ^[0-9]+$ ]] || die "LLMFT_SLURM_PORT_BASE must be a port number, got '$p'"
while (( ${#ports[@]} < 4 )); do
  (( p < 65000 )) || die "no free ports found from ${LLMFT_SLURM_PORT_BASE:-16817} up"
  if port_free "$p"; then ports+=("$p"); fi
  p=$((p + 1))
done

host=$(hostname -s)
user=$(id -un)
# At least 16 CPUs per node as Slurm sees them (config_overrides): run_llm.slurm asks 4 per GPU, so a job
# with all 4 GPUs of a node fits, and 1-GPU test jobs run side by side.
cpus=$(nproc)
if (( cpus < 16 )); then cpus=16; fi
# Each node's memory as Slurm sees it: this machine's (MB), so a job with --mem=0 (run_llm.slurm) gets what the
# machine has; memory is not a consumable resource here (CR_Core), so jobs still share the nodes.
mem=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024}' /proc/meminfo)
first_job_id=$(( 1 + (ports[0] % 25) * 400 ))  # 25 ranges of 400 ids: ports 4 apart get different ones
plugstack_line="# PlugStackConfig: none (start.sh --plugstack FILE)"
if [[ -n "$plugstack" ]]; then plugstack_line="PlugStackConfig=$plugstack"; fi
render() {
  sed -e "s|@STATE@|$state|g" -e "s|@HOST@|$host|g" -e "s|@USER@|$user|g" -e "s|@CPUS@|$cpus|g" -e "s|@MEM@|$mem|g" -e "s|@PLUGSTACK@|$plugstack_line|g" \
      -e "s|@CTLD_PORT@|${ports[0]}|g" -e "s|@N1_PORT@|${ports[1]}|g" -e "s|@N2_PORT@|${ports[2]}|g" -e "s|@N3_PORT@|${ports[3]}|g" -e "s|@FIRST_JOB_ID@|$first_job_id|g" "$1" > "$2"
}
render "$here/slurm.conf.in" "$state/slurm.conf"
render "$here/gres.conf.in" "$state/gres.conf"
chmod 644 "$state/slurm.conf" "$state/gres.conf"
export SLURM_CONF="$state/slurm.conf"

record() { echo "$1 $2" >> "$state/run/started.pids"; }
wait_pidfile() {  # wait_pidfile NAME FILE: the daemon writes its pid file once it has daemonized
  local _
  for _ in $(seq 1 100); do
    if [[ -s "$2" ]]; then record "$1" "$(tr -dc '0-9' < "$2")"; return 0; fi
    sleep 0.1
  done
  die "$1 did not start (no pid file $2); see $state/log"
}

mungekey --create --keyfile="$state/munge/munge.key" --bits=1024 >/dev/null 2>&1 \
  || mungekey -c -k "$state/munge/munge.key" >/dev/null
chmod 600 "$state/munge/munge.key"
munged --key-file="$state/munge/munge.key" --socket="$state/munge/munge.socket" \
  --pid-file="$state/run/munged.pid" --log-file="$state/log/munged.log" \
  --seed-file="$state/munge/munged.seed" --force \
  || die "munged failed to start; see $state/log/munged.log"
wait_pidfile munged "$state/run/munged.pid"

slurmctld -c -f "$state/slurm.conf" || die "slurmctld failed to start; see $state/log/slurmctld.log"
wait_pidfile slurmctld "$state/run/slurmctld.pid"
node_path() {  # node_path NODE: the PATH slurmd NODE starts with (its own enroot first, with --enroot)
  [[ -n "$enroot_prefix" ]] || { echo "$PATH"; return 0; }
  local dir="$state/enroot/$1"
  mkdir -p "$dir/bin"
  {
    echo '#!/usr/bin/env bash'
    echo "# node $1's enroot (slurm/local/start.sh --enroot)"
    echo "SLURMD_NODENAME=$1 exec /usr/local/bin/enroot \"\$@\""
  } > "$dir/bin/enroot"
  chmod 755 "$dir/bin/enroot"
  echo "$dir/bin:$enroot_prefix/bin:$PATH"
}
if [[ -n "$enroot_prefix" ]]; then
  # The node-local paths of node N live in /tmp/llmft-enroot/N (every local cluster's node N: their job ids differ,
  # and with them pyxis's container names). pyxis's job epilog, which removes a job's containers, runs enroot with
  # PATH=/usr/local/bin:/usr/bin:/bin and SLURMD_NODENAME set, as a site's enroot package in /usr/bin is found:
  # /usr/local/bin/enroot is this machine's enroot, choosing the node's paths by that name.
  mkdir -p /usr/local/bin
  sed "s|@PREFIX@|$enroot_prefix|g" > /usr/local/bin/enroot.tmp <<'ENROOT'
#!/usr/bin/env bash
# enroot for the local Slurm clusters (slurm/local/start.sh --enroot): node $SLURMD_NODENAME's own paths
node=${SLURMD_NODENAME:?SLURMD_NODENAME is unset: run by a local Slurm node}
export ENROOT_DATA_PATH=/tmp/llmft-enroot/$node/data ENROOT_RUNTIME_PATH=/tmp/llmft-enroot/$node/runtime
export ENROOT_CACHE_PATH=/tmp/llmft-enroot/$node/cache PATH=@PREFIX@/bin:$PATH
exec @PREFIX@/bin/enroot "$@"
ENROOT
  chmod 755 /usr/local/bin/enroot.tmp
  mv /usr/local/bin/enroot.tmp /usr/local/bin/enroot
fi
for n in n1 n2 n3; do
  PATH="$(node_path "$n")" slurmd -N "$n" -f "$state/slurm.conf" || die "slurmd $n failed to start; see $state/log/slurmd-$n.log"
  wait_pidfile slurmd "$state/run/slurmd-$n.pid"
done

# Ready when every node is idle (sinfo -a: also the hidden partition's).
for _ in $(seq 1 120); do
  idle=$(sinfo -a -h -N -o '%N %t' 2>/dev/null | sort -u | grep -c ' idle' || true)
  if [[ "$idle" == 3 ]]; then
    {
      echo "# source this file to use the local cluster"
      echo "export SLURM_CONF=$state/slurm.conf"
    } > "$state/env"
    echo "local Slurm cluster up: nodes n1 n2, and n3 in the hidden partition spare (4 GPUs each as Slurm sees them), controller port ${ports[0]}"
    echo "export SLURM_CONF=$state/slurm.conf"
    exit 0
  fi
  sleep 0.5
done
sinfo -N >&2 || true
die "nodes did not become idle within 60 s; see $state/log"
