#!/usr/bin/env bash
# Start N actors on this node, attached to a running learner:
#   deploy/actors.sh --learner tcp://HOST:PORT --config CONFIG [--count N] [section.field=value ...]
# If one actor fails, all actors started here are stopped and the script exits non-zero.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
learner="" config="" count=1 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --learner) learner="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --count) count="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
[ -n "$learner" ] && [ -n "$config" ] || { echo "usage: $0 --learner tcp://HOST:PORT --config CONFIG [--count N]" >&2; exit 2; }
if [ -x "$here/.venv/bin/fleetrl" ]; then bin="$here/.venv/bin/fleetrl"; else bin="fleetrl"; fi
pids=()
stop_all() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; }
trap 'stop_all; exit 130' INT TERM
for i in $(seq 0 $((count - 1))); do
  setsid "$bin" actor --learner "$learner" --config "$config" --id "$(hostname)-a$i" "${extra[@]}" &
  pids+=($!)
done
status=0
while [ ${#pids[@]} -gt 0 ]; do
  if ! wait -n; then status=1; break; fi
  alive=(); for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done; pids=("${alive[@]}")
done
if [ $status -ne 0 ]; then echo "actors.sh: an actor failed; stopping the others" >&2; stop_all; fi
exit $status
