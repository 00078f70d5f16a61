#!/usr/bin/env bash
# Start a real OpenPBS cluster on this one machine: pbs_server, pbs_sched, pbs_comm and PBS's own PostgreSQL
# datastore on the head pbs-head, and two pbs_mom daemons as the nodes pbs-n0 and pbs-n1 (each with its own
# PBS_HOME, pbs.conf and ports; ncpus 2 each, or the machine's cores if more), queue workq (the default).
# Jobs go in as the job user llmftjob (created if missing): PBS refuses root's jobs.
#
#   pbs/local/start.sh [--install] [--build-only] [STATE_DIR]
#   export PATH="$PATH:/opt/llmft-openpbs/NAME/bin"   # printed at the end; then: pbsnodes -a, qstat ...
#   su - llmftjob -c 'qsub -l select=2:ncpus=1 -l place=scatter job.sh'
#   pbs/local/stop.sh [--purge] [STATE_DIR]
#
# OpenPBS is built from source once (3-4 min on 2 cores) into the fixed prefix /opt/llmft-openpbs/NAME (NAME: the
# source tarball's name) and kept as a tarball in ${LLMFT_PBS_CACHE:-${XDG_CACHE_HOME:-~/.cache}/llmft}; later
# starts reuse or restore it and take about 20 s. The source: $LLMFT_PBS_SOURCE (a .tar.gz), else the vendored
# ../shared/vendor/openpbs-*.tar.gz beside the repository, else the v23.06.06 release from GitHub.
# Needs root: it adds 198.51.100.10-12/32 to lo with the /etc/hosts names pbs-head, pbs-n0, pbs-n1 (PBS ignores
# names that resolve to 127.x), writes PREFIX/etc/pbs.conf and starts the daemons. STATE_DIR (default
# $LLMFT_PBS_DIR, else /tmp/llmft-pbs) holds every PBS_HOME, the moms' pbs.conf files and the logs.
# --install installs the missing Debian packages with apt-get. --build-only builds or restores the install tree
# and exits without starting anything (make test-setup runs it).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
me=pbs/local/start.sh
die() { echo "$me: $*" >&2; exit 1; }

install=0
build_only=0
state=""
while (( $# > 0 )); do
  arg=$1; shift
  case "$arg" in
    --install) install=1 ;;
    --build-only) build_only=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option '$arg' (known: --install, --build-only, --help)" ;;
    *) [[ -z "$state" ]] || die "only one STATE_DIR may be given"; state=$arg ;;
  esac
done
[[ "$(id -u)" == 0 ]] || die "needs root (it installs into /opt, adds addresses to lo, edits /etc/hosts and starts the PBS daemons as root)"
export PATH="$PATH:/usr/sbin:/sbin"

# The fixed layout: PBS compiles its prefix (RUNPATH) and its pbs.conf path in, so the install tree only works where
# it was built. Bump `recipe` when the build below changes: an install tree of another recipe is rebuilt.
recipe="llmft-openpbs build 1"
release_url=https://github.com/openpbs/openpbs/archive/refs/tags/v23.06.06.tar.gz
opt_root=/opt/llmft-openpbs
cache=${LLMFT_PBS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmft}
head_name=pbs-head
node_names=(pbs-n0 pbs-n1)
declare -A address_of=([pbs-head]=198.51.100.10 [pbs-n0]=198.51.100.11 [pbs-n1]=198.51.100.12)
declare -A mom_port_of=([pbs-n0]=15011 [pbs-n1]=15013)  # each mom's service port
declare -A manager_port_of=([pbs-n0]=15012 [pbs-n1]=15014)  # and its manager port
head_ports=(15001 15004 15007 17001)  # server, scheduler, datastore, comm
job_user=llmftjob

# Which source: an explicit tarball, the vendored one, or the public release (downloaded only if it must be built).
shopt -s nullglob
vendored=("$repo"/../shared/vendor/openpbs-*.tar.gz)
shopt -u nullglob
if [[ -n "${LLMFT_PBS_SOURCE:-}" ]]; then
  [[ -f "$LLMFT_PBS_SOURCE" ]] || die "LLMFT_PBS_SOURCE=$LLMFT_PBS_SOURCE: no such file"
  source_tgz=$(cd "$(dirname "$LLMFT_PBS_SOURCE")" && pwd)/$(basename "$LLMFT_PBS_SOURCE")
  source_from="LLMFT_PBS_SOURCE ($source_tgz)"
elif (( ${#vendored[@]} > 0 )); then
  source_tgz=$(cd "$(dirname "${vendored[-1]}")" && pwd)/$(basename "${vendored[-1]}")
  source_from="the vendored tarball $source_tgz"
else
  source_tgz=$cache/openpbs-23.06.06.tar.gz
  source_from="the OpenPBS v23.06.06 release ($release_url)"
fi
name=$(basename "$source_tgz")
name=${name%.tar.gz}
name=${name%.tgz}
[[ "$name" =~ ^[A-Za-z0-9._+-]+$ ]] || die "the source tarball's name '$name' is not usable as a directory name"
prefix=$opt_root/$name
conf=$prefix/etc/pbs.conf
cached_tree=$cache/$name-install.tar.gz
echo "OpenPBS source: $source_from; install tree $prefix"

# Debian packages: what the build needs, and what a built (or restored) install tree needs to run.
build_packages=(gcc g++ make libtool autoconf automake pkg-config libhwloc-dev libx11-dev libxt-dev libedit-dev
  libical-dev libncurses-dev perl postgresql-server-dev-all postgresql-contrib postgresql python3-dev tcl-dev tk-dev
  swig libexpat1-dev libssl-dev libxext-dev libxft-dev libcjson-dev)
run_packages=(postgresql expat libedit2 python3 tcl tk libical3 libhwloc15 libcjson1 iproute2 passwd util-linux)
missing_packages() {  # missing_packages PKG...: those not installed (nothing where there is no dpkg to ask)
  local p
  command -v dpkg-query >/dev/null 2>&1 || return 0
  for p in "$@"; do
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" == installed ]] || echo "$p"
  done
}
ensure_packages() {  # ensure_packages PKG...: install the missing ones with --install, else one error line
  local missing
  mapfile -t missing < <(missing_packages "$@")
  (( ${#missing[@]} > 0 )) || return 0
  if [[ "$install" == 1 ]]; then
    command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and there is no apt-get to install them with"
    echo "installing ${missing[*]} ..."
    local log
    log=$(mktemp)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
      tail -n 5 "$log" >&2
      rm -f "$log"
      die "apt-get install ${missing[*]} failed"
    fi
    rm -f "$log"
    mapfile -t missing < <(missing_packages "$@")
    (( ${#missing[@]} == 0 )) || die "still missing after apt-get: ${missing[*]}"
  else
    die "missing Debian packages: run apt-get install -y ${missing[*]} (or rerun with --install)"
  fi
}

tree_complete() {  # the prefix holds an install tree of this recipe and source
  [[ -f "$prefix/.llmft-build" ]] && [[ "$(cat "$prefix/.llmft-build")" == "$recipe from $name" ]] \
    && [[ -x "$prefix/sbin/pbs_server.bin" && -x "$prefix/sbin/pbs_mom" && -x "$prefix/bin/qsub" && -x "$prefix/libexec/pbs_init.d" ]] \
    && [[ -u "$prefix/sbin/pbs_iff" ]]
}

build_tree() {  # build_tree: OpenPBS from source into $prefix (3-4 min on 2 cores)
  ensure_packages "${build_packages[@]}" "${run_packages[@]}"
  if [[ ! -f "$source_tgz" ]]; then
    local part=$source_tgz.partial
    echo "downloading $release_url ..."
    if command -v curl >/dev/null 2>&1; then
      curl -fsSL --retry 3 -o "$part" "$release_url" || { rm -f "$part"; die "could not download $release_url (curl failed); set LLMFT_PBS_SOURCE to a local OpenPBS source tarball"; }
    elif command -v wget >/dev/null 2>&1; then
      wget -q -O "$part" "$release_url" || { rm -f "$part"; die "could not download $release_url (wget failed); set LLMFT_PBS_SOURCE to a local OpenPBS source tarball"; }
    else
      die "neither curl nor wget to download $release_url with; set LLMFT_PBS_SOURCE to a local OpenPBS source tarball"
    fi
    mv -f "$part" "$source_tgz"
  fi
  local work log t0 started
  work=$(mktemp -d "${TMPDIR:-/tmp}/llmft-openpbs-build.XXXXXX")
  log=$cache/$name-build.log
  : > "$log"
  started=$SECONDS
  echo "building OpenPBS into $prefix (3-4 min on 2 cores; log: $log) ..."
  step() {  # step WHAT CMD...: run CMD in the source tree, its output to the log; on failure the log's tail and exit
    local what=$1; shift
    t0=$SECONDS
    if ! (cd "$work/src" && "$@") >>"$log" 2>&1; then
      tail -n 25 "$log" >&2
      die "building OpenPBS failed at '$what'; the full log is $log (the source tree is left in $work)"
    fi
    echo "  $what: $((SECONDS - t0)) s"
  }
  mkdir -p "$work/src"
  tar -xzf "$source_tgz" -C "$work/src" --strip-components=1 || die "could not unpack $source_tgz"
  # The shell scripts fall back to /etc/pbs.conf whatever --with-pbs-conf-file says: point them at ours, so that this
  # cluster never reads or needs a system-wide /etc/pbs.conf.
  local scripts
  mapfile -t scripts < <(grep -rlF 'PBS_CONF_FILE:-/etc/pbs.conf' "$work/src/src" || true)
  (( ${#scripts[@]} > 0 )) && sed -i "s|PBS_CONF_FILE:-/etc/pbs.conf|PBS_CONF_FILE:-$conf|g" "${scripts[@]}"
  if [[ -f "$work/src/src/modules/python/pbs/v1/_pmi_utils.py" ]]; then
    sed -i "s|pbsconf = \"/etc/pbs.conf\"|pbsconf = \"$conf\"|" "$work/src/src/modules/python/pbs/v1/_pmi_utils.py"
  fi
  step autogen ./autogen.sh
  # --with-python=/usr: not whichever python comes first on PATH (a venv's). --disable-security: PBS_HOME may then
  # live under /tmp (mode 1777), which the daemons' path checks refuse otherwise.
  step configure ./configure --prefix="$prefix" --with-pbs-conf-file="$conf" --with-pbs-server-home=/tmp/llmft-pbs/head \
    --with-python=/usr --disable-security --disable-static
  step make make -j "$(nproc)"
  rm -rf "$prefix"
  # make install writes /etc/profile.d/pbs.{sh,csh} and a systemd unit wherever the prefix is, unless told otherwise.
  step install make install sysprofiledir="$prefix/etc/profile.d" unitfiledir="$prefix/lib/systemd"
  # Set-uid root as PBS's packages install them (make install does not): pbs_iff authenticates a non-root user's
  # commands (qsub, qstat ... fail with "pbs_iff: cannot connect to host" without it).
  chmod 4755 "$prefix/sbin/pbs_iff" "$prefix/sbin/pbs_rcp"
  echo "$recipe from $name" > "$prefix/.llmft-build"
  rm -rf "$work"
  echo "built OpenPBS in $((SECONDS - started)) s"
}

# Build or restore the install tree, one start.sh at a time (another may be building the same tree).
mkdir -p "$cache" "$opt_root"
exec 9>"$cache/$name.lock"
flock -w 1800 9 || die "another start.sh has held $cache/$name.lock for 30 min"
if tree_complete; then
  echo "reusing the install tree in $prefix"
elif [[ -s "$cached_tree" ]] && rm -rf "$prefix" && tar -xzf "$cached_tree" -C "$opt_root" && tree_complete; then
  echo "restored the install tree $prefix from $cached_tree"
else
  [[ ! -e "$cached_tree" ]] || echo "the cached install tree $cached_tree is unusable; building afresh"
  build_tree
  rm -f "$cached_tree"  # a stale one (another recipe) makes way for this build's
fi
if [[ ! -s "$cached_tree" ]]; then
  tar -czf "$cached_tree.partial" -C "$opt_root" --exclude="$name/etc/pbs.conf" "$name" || die "could not write $cached_tree"
  mv -f "$cached_tree.partial" "$cached_tree"
  echo "cached the install tree as $cached_tree"
fi
flock -u 9
ensure_packages "${run_packages[@]}"
if [[ "$build_only" == 1 ]]; then
  echo "OpenPBS is installed in $prefix (--build-only: nothing started)"
  exit 0
fi

# ---- the cluster ----
state=${state:-${LLMFT_PBS_DIR:-/tmp/llmft-pbs}}
mkdir -p "$state"
state=$(cd "$state" && pwd)
# The datastore runs as postgres and jobs as llmftjob: both must reach their directories under STATE_DIR.
d=$state
while [[ "$d" != / ]]; do
  [[ "$(( 8#$(stat -c '%a' "$d") & 1 ))" == 1 ]] || die "STATE_DIR $state must be reachable by other users (postgres, $job_user), but $d is mode $(stat -c '%a' "$d"); pick another directory"
  d=$(dirname "$d")
done
getent passwd postgres >/dev/null || die "no postgres account (PBS runs its datastore as postgres): install the postgresql package"
# The datastore's socket directory: made by the postgresql package's install, but /run is emptied at each boot and, without
# systemd's tmpfiles, nothing makes it again. Without it the datastore starts but createdb cannot reach it.
install -d -m 2775 -o postgres -g postgres /var/run/postgresql

pids_file=$state/run/started.pids
if [[ -s "$pids_file" ]]; then
  while read -r pname pid; do
    if [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$pname" ]]; then
      die "a cluster started from $state is still running (pid $pid); stop it with pbs/local/stop.sh $state"
    fi
  done < "$pids_file"
fi
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in "${head_ports[@]}" "${mom_port_of[@]}" "${manager_port_of[@]}"; do
  if port_in_use "$port"; then
    other=$(sed -n 's|^PBS_HOME=\(.*\)/head$|\1|p' "$conf" 2>/dev/null || true)
    die "port $port is in use: another PBS is running${other:+ (the last cluster started: stop it with pbs/local/stop.sh $other)}"
  fi
done

# Names that do not resolve to 127.x (PBS ignores loopback addresses), each on its own address: PBS maps a mom's
# name back through its address, so two moms need two.
marker="# llmft pbs/local/start.sh"
want=()
# Each pipeline's input is read whole before it is matched: `cmd | grep -q` under pipefail fails when grep stops
# reading at the first match and cmd dies of SIGPIPE (an address already there was then added again).
lo_addresses=$(ip -4 -o addr show dev lo)
for n in "$head_name" "${node_names[@]}"; do
  ip_addr=${address_of[$n]}
  if [[ "$lo_addresses" != *" $ip_addr/32 "* ]]; then
    ip addr add "$ip_addr/32" dev lo || die "could not add $ip_addr/32 to lo"
  fi
  want+=("$ip_addr $n $marker")
done
if [[ "$(grep -F "$marker" /etc/hosts || true)" != "$(printf '%s\n' "${want[@]}")" ]]; then
  # Rewritten in place, not replaced: /etc/hosts is often a bind mount (containers), which mv or sed -i cannot replace.
  hosts=$(grep -vF "$marker" /etc/hosts || true)
  printf '%s\n' "$hosts" "${want[@]}" > /etc/hosts
fi
for n in "$head_name" "${node_names[@]}"; do
  got=$(getent hosts "$n" | awk '{print $1; exit}')
  [[ "$got" == "${address_of[$n]}" ]] || die "$n resolves to '$got', not ${address_of[$n]}: another /etc/hosts line names it"
  back=$(getent hosts "${address_of[$n]}" | awk '{print $2; exit}')
  [[ "$back" == "$n" ]] || die "${address_of[$n]} maps back to '$back', not $n: another /etc/hosts line names that address"
done

# The job user: PBS refuses root's jobs; its login shell gets PBS's commands on PATH (after /usr/bin: PBS ships its
# own mpiexec). Jobs run in a login shell, so the job scripts get them too.
if ! id -u "$job_user" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$job_user" || die "could not create the job user $job_user"
fi
job_home=$(getent passwd "$job_user" | cut -d: -f6)
[[ "$(getent passwd "$job_user" | cut -d: -f7)" == /bin/bash ]] || usermod --shell /bin/bash "$job_user"
if [[ ! -d "$job_home" ]]; then
  mkdir -p "$job_home"
  chown "$job_user:" "$job_home"
fi
profile=$job_home/.profile
path_line="PATH=\"\$PATH:$prefix/bin\"  $marker"
if [[ ! -f "$profile" ]] || [[ "$(grep -F "$marker" "$profile" || true)" != "$path_line" ]]; then
  {
    if [[ -f "$profile" ]]; then grep -vF "$marker" "$profile" || true; fi
    echo "$path_line"
  } > "$profile.llmft"
  mv -f "$profile.llmft" "$profile"
  chown "$job_user:" "$profile"
fi

# Fresh state every start: every PBS_HOME (server database included), configs and logs.
rm -rf "$state/head" "$state/pbs-n0" "$state/pbs-n1" "$state/conf" "$state/log" "$state/run"
mkdir -p "$state/conf" "$state/log" "$state/run"
chmod 755 "$state" "$state/conf" "$state/log" "$state/run"
: > "$pids_file"
cpus=$(nproc)
if (( cpus < 2 )); then cpus=2; fi

cat > "$conf" <<EOF
# written by pbs/local/start.sh: the head of the cluster in $state
PBS_EXEC=$prefix
PBS_HOME=$state/head
PBS_SERVER=$head_name
PBS_LEAF_NAME=$head_name
PBS_START_SERVER=1
PBS_START_SCHED=1
PBS_START_COMM=1
PBS_START_MOM=0
PBS_CORE_LIMIT=unlimited
PBS_SCP=/usr/bin/scp
EOF
chmod 644 "$conf"
for n in "${node_names[@]}"; do
  cat > "$state/conf/$n.conf" <<EOF
# written by pbs/local/start.sh: node $n of the cluster in $state
PBS_EXEC=$prefix
PBS_HOME=$state/$n
PBS_SERVER=$head_name
PBS_MOM_NODE_NAME=$n
PBS_LEAF_NAME=$n
PBS_MOM_SERVICE_PORT=${mom_port_of[$n]}
PBS_MANAGER_SERVICE_PORT=${manager_port_of[$n]}
PBS_START_SERVER=0
PBS_START_SCHED=0
PBS_START_COMM=0
PBS_START_MOM=1
PBS_CORE_LIMIT=unlimited
PBS_SCP=/usr/bin/scp
EOF
  chmod 644 "$state/conf/$n.conf"
done

# The head: pbs_init.d creates PBS_HOME and the datastore (pbs_habitat), then starts comm, scheduler and server
# (which starts the datastore). OpenPBS's pbs_db_utility runs createdb as soon as the new datastore's postmaster has a
# pid, not once it accepts connections: on a loaded machine createdb can meet "the database system is starting up"
# and the head fails (a CI run of 2026-11-28). pbs_db_utility stops that datastore itself; the head is then started
# again from an empty PBS_HOME, for that failure only, up to 3 times.
for attempt in 1 2 3; do
  if PBS_CONF_FILE=$conf "$prefix/libexec/pbs_init.d" start >"$state/log/head-start.log" 2>&1; then
    break
  fi
  if (( attempt == 3 )) || ! grep -qF "the database system is starting up" "$state/log/head-start.log"; then
    tail -n 20 "$state/log/head-start.log" >&2
    die "the PBS head did not start; see $state/log/head-start.log and $state/head/*_logs"
  fi
  echo "pbs/local/start.sh: the new datastore was not ready for OpenPBS's createdb; starting the head again ($((attempt + 1)) of 3)" >&2
  mv -f "$state/log/head-start.log" "$state/log/head-start.$attempt.log"
  for _ in $(seq 1 150); do  # the stopped datastore's postmaster gone, before its PBS_HOME is made again
    pgrep -f -- "$state/head/datastore" >/dev/null || break
    sleep 0.1
  done
  pgrep -f -- "$state/head/datastore" >/dev/null && die "the datastore of the failed head start is still running: pbs/local/stop.sh $state"
  rm -rf "$state/head"
done

record() {  # record NAME PIDFILE: the daemon's pid, once the first line of its pid file names a live process called NAME
  local pid _
  for _ in $(seq 1 300); do
    pid=$(head -n 1 "$2" 2>/dev/null | tr -dc '0-9' || true)
    if [[ -n "$pid" ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$1" ]]; then
      echo "$1 $pid" >> "$pids_file"
      return 0
    fi
    sleep 0.2
  done
  die "$1 did not start (no live pid in $2); see $state/log and $state/*/*_logs"
}
record pbs_comm "$state/head/server_priv/comm.lock"
record pbs_sched "$state/head/sched_priv/sched.lock"
record pbs_server.bin "$state/head/server_priv/server.lock"
record postgres "$state/head/datastore/postmaster.pid"

qmgr() { "$prefix/bin/qmgr" -c "$1" >/dev/null || die "qmgr -c '$1' failed"; }

# The nodes: each mom its own PBS_HOME (made by pbs_habitat) and config, started under its own pbs.conf.
for n in "${node_names[@]}"; do
  PBS_CONF_FILE=$state/conf/$n.conf "$prefix/libexec/pbs_habitat" >"$state/log/$n-habitat.log" 2>&1 \
    || die "could not create $state/$n; see $state/log/$n-habitat.log"
  # $usecp: output files are copied, not sent back with scp. Polling every 1-5 s: walltime is enforced at the
  # mom's polling interval (10-120 s by default).
  cat > "$state/$n/mom_priv/config" <<EOF
\$clienthost $head_name
\$usecp *:/ /
\$min_check_poll 1
\$max_check_poll 5
\$logevent 0x1ff
EOF
  PBS_CONF_FILE=$state/conf/$n.conf "$prefix/libexec/pbs_init.d" start >"$state/log/$n-start.log" 2>&1 \
    || { tail -n 20 "$state/log/$n-start.log" >&2; die "pbs_mom $n did not start; see $state/log/$n-start.log and $state/$n/mom_logs"; }
  record pbs_mom "$state/$n/mom_priv/mom.lock"
  qmgr "create node $n Mom=$n,Port=${mom_port_of[$n]}"
  qmgr "set node $n resources_available.ncpus = $cpus"
done
qmgr "set server flatuid = True"
qmgr "set server job_history_enable = True"
qmgr "set server scheduler_iteration = 10"
qmgr "set server mailer = /bin/true"
qmgr "set queue workq kill_delay = 10"

for _ in $(seq 1 120); do
  free=0
  for n in "${node_names[@]}"; do
    node_state=$("$prefix/bin/pbsnodes" "$n" 2>/dev/null || true)
    if grep -qx ' *state = free' <<< "$node_state"; then free=$((free + 1)); fi
  done
  [[ "$free" == "${#node_names[@]}" ]] && break
  sleep 0.5
done
if [[ "$free" != "${#node_names[@]}" ]]; then
  "$prefix/bin/pbsnodes" -a >&2 || true
  die "nodes ${node_names[*]} did not become free within 60 s; see $state/*/mom_logs and $state/head/server_logs"
fi
su - "$job_user" -c 'qstat -B >/dev/null' || die "the job user cannot run qstat: su - $job_user -c qstat failed"

{
  echo "# source this file to use the local PBS cluster"
  echo "export PATH=\"\$PATH:$prefix/bin\""
} > "$state/env"
echo "local OpenPBS cluster up: server $head_name, nodes ${node_names[*]} ($cpus cpus each), queue workq; submit as $job_user (su - $job_user)"
echo "export PATH=\"\$PATH:$prefix/bin\""
