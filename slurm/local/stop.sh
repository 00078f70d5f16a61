#!/usr/bin/env bash
# Stop the local Slurm cluster started by slurm/local/start.sh: cancel its jobs, then end exactly the
# daemons it started (by the pids it recorded, each checked to still be that daemon), nothing else.
#
#   slurm/local/stop.sh [--purge] [STATE_DIR]     # --purge also deletes STATE_DIR
set -euo pipefail

die() { echo "slurm/local/stop.sh: $*" >&2; exit 1; }
purge=0
state=""
for arg in "$@"; do
  case "$arg" in
    --purge) purge=1 ;;
    -h|--help) sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$arg' (known: --purge, --help)" ;;
    *) [[ -z "$state" ]] || die "only one STATE_DIR may be given"; state=$arg ;;
  esac
done
state=${state:-${LLMFT_SLURM_DIR:-/tmp/llmft-slurm-$(id -un)}}
[[ -d "$state" ]] || die "no cluster state directory $state"
pids_file="$state/run/started.pids"
export PATH="$PATH:/usr/sbin:/sbin"

alive() {  # alive NAME PID: the pid is still the daemon we started (not a recycled pid)
  [[ -r "/proc/$2/comm" ]] && [[ "$(cat "/proc/$2/comm" 2>/dev/null)" == "$1" ]]
}

job_leftovers() {  # job_leftovers CONF: pids of this cluster's job processes still running (SLURM_JOB_ID and SLURM_CONF=CONF)
  local environ pid vars
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    vars=$(tr '\0' '\n' 2>/dev/null < "$environ") || continue
    if grep -qxF "SLURM_CONF=$1" <<< "$vars" && grep -q '^SLURM_JOB_ID=' <<< "$vars"; then echo "$pid"; fi
  done
}

if [[ -s "$pids_file" ]]; then
  # Cancel this cluster's jobs first so their steps end through Slurm, not as orphans.
  ctld_up=0
  while read -r name pid; do
    if [[ "$name" == slurmctld ]] && alive "$name" "$pid"; then ctld_up=1; fi
  done < "$pids_file"
  if [[ "$ctld_up" == 1 ]]; then
    export SLURM_CONF="$state/slurm.conf"
    mapfile -t jobs < <(squeue -h -o '%i' 2>/dev/null || true)
    if (( ${#jobs[@]} > 0 )); then
      scancel "${jobs[@]}" 2>/dev/null || true
      for _ in $(seq 1 30); do
        [[ -z "$(squeue -h -o '%i' 2>/dev/null || true)" ]] && break
        sleep 0.5
      done
    fi
  fi
  # The Slurm daemons together, then munged (they may still talk to it while shutting down).
  stop_pids() {  # stop_pids "NAME PID"...: SIGTERM each, wait up to 10 s, SIGKILL what is left
    local entry name pid
    for entry in "$@"; do
      read -r name pid <<< "$entry"
      if alive "$name" "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
    done
    for _ in $(seq 1 100); do
      local left=0
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
        echo "$name (pid $pid) did not exit after SIGTERM; sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
      fi
    done
  }
  mapfile -t slurm_daemons < <(grep -v '^munged ' "$pids_file" || true)
  mapfile -t munge_daemons < <(grep '^munged ' "$pids_file" || true)
  if (( ${#slurm_daemons[@]} > 0 )); then stop_pids "${slurm_daemons[@]}"; fi
  if (( ${#munge_daemons[@]} > 0 )); then stop_pids "${munge_daemons[@]}"; fi
  # A job's processes that outlived it: this cluster tracks them as Slurm's proctrack/linuxproc does, by parentage, so
  # a process reparented when Slurm killed its parent escapes the step's kill (a hung rank whose torchrun was killed).
  # On a real cluster proctrack/cgroup ends them; here they would hold their memory until the machine restarts.
  # A killed process stays in /proc, its environment readable, until it has released its memory (a moment, longer
  # on a loaded machine: a CI run once found one there right after the kill), and a dying parent may have started
  # another: so each kill is waited for (up to 10 s) and the scan repeated.
  for _ in 1 2 3; do
    mapfile -t leftovers < <(job_leftovers "$state/slurm.conf")
    (( ${#leftovers[@]} > 0 )) || break
    echo "ending ${#leftovers[@]} process(es) of this cluster's jobs that outlived them: ${leftovers[*]}"
    kill -KILL "${leftovers[@]}" 2>/dev/null || true
    for _ in $(seq 1 50); do
      [[ -z "$(job_leftovers "$state/slurm.conf")" ]] && break
      sleep 0.2
    done
  done
  : > "$pids_file"
  echo "local Slurm cluster in $state stopped"
else
  echo "no running local Slurm cluster recorded in $state"
fi
if [[ "$purge" == 1 ]]; then
  rm -rf "$state"
fi
