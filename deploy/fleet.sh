#!/usr/bin/env bash
# Start actors on several machines over ssh (no Slurm), attached to a running learner:
#
#   deploy/fleet.sh --learner tcp://HOST:PORT --config CONFIG --hosts h1,h2,...|FILE [--count N]
#                   [--gpus-per-actor G] [--remote-dir DIR] [section.field=value ...]
#
# Runs deploy/actors.sh on every host (one line per host in FILE; '#' comments allowed) in DIR (default:
# this checkout's path, i.e. a shared filesystem or the same path on every host); CONFIG must be readable
# there. --count defaults to the config's actors per node (actor_gpus_per_node / tensor_parallel_size).
# Needs non-interactive ssh (keys; BatchMode). Each host's output is prefixed with its name.
# As every launcher here: if one host's actors fail, all are stopped and this exits 1; Ctrl-C stops all (130).
# The ssh sessions hold a terminal (-tt), so a dropped session hangs up the remote actors.sh, which stops its actors.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
learner="" config="" hosts="" count="" gpus="" remote_dir="$fleetrl_root" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --learner) learner="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --hosts) hosts="$2"; shift 2 ;;
    --count) count="$2"; shift 2 ;;
    --gpus-per-actor) gpus="$2"; shift 2 ;;
    --remote-dir) remote_dir="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
[ -n "$learner" ] && [ -n "$config" ] && [ -n "$hosts" ] || {
  echo "usage: $0 --learner tcp://HOST:PORT --config CONFIG --hosts h1,h2|FILE [--count N] [--gpus-per-actor G] [--remote-dir DIR]" >&2; exit 2; }
if [ -f "$hosts" ]; then
  mapfile -t host_list < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$hosts" | grep -v '^$')
else
  IFS=, read -r -a host_list <<< "$hosts"
fi
[ ${#host_list[@]} -gt 0 ] || { echo "$0: no hosts in '$hosts'" >&2; exit 2; }
env_lines="$("$py" -m deploy.jobenv "$config" "${extra[@]}")" || exit 2
eval "$env_lines"
# ssh hands the remote shell one string: quote each word, keep `&&` an operator.
printf -v cd_part '%q ' cd "$remote_dir"
printf -v actors_part '%q ' bash deploy/actors.sh --learner "$learner" --config "$config" \
  --count "${count:-$FLEETRL_ACTORS_PER_NODE}" --gpus-per-actor "${gpus:-$FLEETRL_GPUS_PER_ACTOR}" "${extra[@]}"
remote_line="${cd_part}&& ${actors_part% }"
ssh_cmd() { cmd=(ssh -tt -o BatchMode=yes -o ConnectTimeout=10 "$1" "$remote_line"); }
if dry; then
  for h in "${host_list[@]}"; do ssh_cmd "$h"; show "${cmd[@]}"; done
  exit 0
fi
pids=()
stop_all() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap 'stop_all; wait; exit 130' INT TERM
for h in "${host_list[@]}"; do
  ssh_cmd "$h"
  "${cmd[@]}" < /dev/null > >(sed -u "s/^/[$h] /") 2>&1 &
  pids+=($!)
done
status=0
wait_all fleet.sh "${pids[@]}" || status=1
wait
exit $status
