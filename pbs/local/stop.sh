#!/usr/bin/env bash
# Stop the local OpenPBS cluster started by pbs/local/start.sh: delete its jobs, stop both moms, then the server,
# scheduler, comm and datastore, and end exactly the daemons it recorded (each checked to still be that daemon),
# nothing else. The install tree in /opt/llmft-openpbs, its cached tarball, the lo addresses, the /etc/hosts names
# and the job user stay: the next start takes about 20 s.
#
#   pbs/local/stop.sh [--purge] [STATE_DIR]     # --purge also deletes STATE_DIR
set -euo pipefail

die() { echo "pbs/local/stop.sh: $*" >&2; exit 1; }
purge=0
state=""
for arg in "$@"; do
  case "$arg" in
    --purge) purge=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option '$arg' (known: --purge, --help)" ;;
    *) [[ -z "$state" ]] || die "only one STATE_DIR may be given"; state=$arg ;;
  esac
done
state=${state:-${LLMFT_PBS_DIR:-/tmp/llmft-pbs}}
[[ -d "$state" ]] || die "no cluster state directory $state"
state=$(cd "$state" && pwd)
pids_file=$state/run/started.pids
export PATH="$PATH:/usr/sbin:/sbin"

alive() {  # alive NAME PID: the pid is still the daemon we started (not a recycled pid)
  [[ "$(cat "/proc/$2/comm" 2>/dev/null)" == "$1" ]]
}
recorded() {  # recorded NAME: the recorded "NAME PID" lines whose daemon is still alive
  local name pid
  [[ -s "$pids_file" ]] || return 0
  while read -r name pid; do
    if [[ "$name" == "$1" ]] && alive "$name" "$pid"; then echo "$name $pid"; fi
  done < "$pids_file"
}
stop_pids() {  # stop_pids SIGNAL "NAME PID"...: SIGNAL to each, wait up to 15 s, SIGKILL what is left
  local signal=$1 entry name pid left _
  shift
  for entry in "$@"; do
    read -r name pid <<< "$entry"
    if alive "$name" "$pid"; then kill "-$signal" "$pid" 2>/dev/null || true; fi
  done
  for _ in $(seq 1 150); do
    left=0
    for entry in "$@"; do
      read -r name pid <<< "$entry"
      if alive "$name" "$pid"; then left=1; fi
    done
    [[ "$left" == 0 ]] && return 0
    sleep 0.1
  done
  for entry in "$@"; do
    read -r name pid <<< "$entry"
    if alive "$name" "$pid"; then
      echo "$name (pid $pid) did not exit after SIG$signal; sending SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}
job_leftovers() {  # pids of this cluster's job processes still running (PBS_NODEFILE in one of its moms' PBS_HOME)
  local environ pid job_env
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    job_env=$(tr '\0' '\n' 2>/dev/null < "$environ" || true)
    if grep -qE "^PBS_NODEFILE=$state/pbs-n[0-9]+/aux/" <<< "$job_env"; then echo "$pid"; fi
  done
}

mapfile -t live < <(for n in pbs_server.bin pbs_sched pbs_comm postgres pbs_mom; do recorded "$n"; done)
if (( ${#live[@]} == 0 )); then
  echo "no running local OpenPBS cluster recorded in $state"
  [[ "$purge" == 0 ]] || rm -rf "$state"
  exit 0
fi

prefix=$(sed -n 's/^PBS_EXEC=//p' "$state/conf/pbs-n0.conf" 2>/dev/null || true)
conf=$prefix/etc/pbs.conf
head_conf_ok=0
if [[ -n "$prefix" ]] && grep -qxF "PBS_HOME=$state/head" "$conf" 2>/dev/null; then head_conf_ok=1; fi

# Delete the jobs first, so that they end through PBS rather than as orphans of a killed mom.
if [[ "$head_conf_ok" == 1 ]] && [[ -n "$(recorded pbs_server.bin)" ]]; then
  mapfile -t jobs < <(PBS_CONF_FILE=$conf timeout 30 "$prefix/bin/qselect" 2>/dev/null || true)
  if (( ${#jobs[@]} > 0 )); then
    PBS_CONF_FILE=$conf timeout 60 "$prefix/bin/qdel" -W force "${jobs[@]}" >/dev/null 2>&1 || true
    for _ in $(seq 1 60); do
      [[ -z "$(PBS_CONF_FILE=$conf timeout 30 "$prefix/bin/qselect" 2>/dev/null || true)" ]] && break
      sleep 0.5
    done
  fi
fi

# The moms (SIGTERM: each kills its jobs and exits), then the head through pbs_init.d (qterm ends the server, which
# stops the datastore; then scheduler and comm), then whatever of it is still running, by pid.
mapfile -t moms < <(recorded pbs_mom)
if (( ${#moms[@]} > 0 )); then stop_pids TERM "${moms[@]}"; fi
if [[ "$head_conf_ok" == 1 ]] && [[ -n "$(recorded pbs_server.bin)$(recorded pbs_sched)$(recorded pbs_comm)" ]]; then
  PBS_CONF_FILE=$conf timeout 120 "$prefix/libexec/pbs_init.d" stop >"$state/log/head-stop.log" 2>&1 \
    || echo "pbs_init.d stop failed (see $state/log/head-stop.log); ending the daemons by pid" >&2
fi
mapfile -t daemons < <(for n in pbs_server.bin pbs_sched pbs_comm; do recorded "$n"; done)
if (( ${#daemons[@]} > 0 )); then stop_pids TERM "${daemons[@]}"; fi
mapfile -t datastore < <(recorded postgres)
if (( ${#datastore[@]} > 0 )); then stop_pids INT "${datastore[@]}"; fi  # SIGINT: PostgreSQL's fast shutdown

# A job's processes that outlived it (a process that left the job's session escapes the mom's kill).
for _ in 1 2 3; do
  mapfile -t leftovers < <(job_leftovers)
  (( ${#leftovers[@]} > 0 )) || break
  echo "ending ${#leftovers[@]} process(es) of this cluster's jobs that outlived them: ${leftovers[*]}"
  kill -KILL "${leftovers[@]}" 2>/dev/null || true
  for _ in $(seq 1 50); do
    [[ -z "$(job_leftovers)" ]] && break
    sleep 0.2
  done
done

mapfile -t still < <(for n in pbs_server.bin pbs_sched pbs_comm postgres pbs_mom; do recorded "$n"; done)
(( ${#still[@]} == 0 )) || die "still running after SIGKILL: ${still[*]}"
: > "$pids_file"
echo "local OpenPBS cluster in $state stopped"
[[ "$purge" == 0 ]] || rm -rf "$state"
