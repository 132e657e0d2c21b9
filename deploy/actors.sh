#!/usr/bin/env bash
# Start N actors on this node, attached to a running learner:
#   deploy/actors.sh --learner tcp://HOST:PORT --config CONFIG [--count N] [--gpus-per-actor G] [section.field=value ...]
# --gpus-per-actor G gives actor i the GPUs i*G .. i*G+G-1 (CUDA_VISIBLE_DEVICES); without it every actor sees
# every GPU (CPU engines). If one actor fails, all actors started here are stopped and the script exits non-zero.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
learner="" config="" count=1 gpus=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --learner) learner="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --count) count="$2"; shift 2 ;;
    --gpus-per-actor) gpus="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
[ -n "$learner" ] && [ -n "$config" ] || { echo "usage: $0 --learner tcp://HOST:PORT --config CONFIG [--count N] [--gpus-per-actor G]" >&2; exit 2; }
# Actor ids must be unique in the fleet (the hub keeps one connection per id; each id has its own log file): under
# Slurm two jobs' steps may share a node, so the id names the job and step too.
prefix="$(hostname)-${SLURM_JOB_ID:+j$SLURM_JOB_ID.${SLURM_STEP_ID:-0}-}"
actor_cmd() {  # sets `cmd` to actor $1's command line
  cmd=("$py" -m deploy.cli actor --learner "$learner" --config "$config" --id "${prefix}a$1" "${extra[@]}")
  if [ "$gpus" -gt 0 ]; then
    cmd=(env CUDA_VISIBLE_DEVICES="$(seq -s, $(($1 * gpus)) $(($1 * gpus + gpus - 1)))" "${cmd[@]}")
  fi
}
if dry; then
  for i in $(seq 0 $((count - 1))); do actor_cmd "$i"; show "${cmd[@]}"; done
  exit 0
fi
pids=()
stop_all() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; }
# HUP: the ssh session of deploy/fleet.sh closed. Wait for the actors' clean stop (their own grace bounds it): under
# srun, a task that exits first has the rest of its step killed.
trap 'stop_all; wait; exit 130' INT TERM HUP
for i in $(seq 0 $((count - 1))); do
  actor_cmd "$i"
  setsid "${cmd[@]}" &  # own process group: an actor owns vLLM's engine processes
  pids+=($!)
done
status=0
wait_all actors.sh "${pids[@]}" || status=1
exit $status
