#!/usr/bin/env bash
# Start the learner on this node: deploy/learner.sh CONFIG [section.field=value ...]
# The hub listens on hub.bind from the config (use tcp://0.0.0.0:PORT for remote actors) and the
# weight-group rendezvous on weights.host:weights.port; open both ports to the actor nodes only.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 CONFIG [section.field=value ...]" >&2; exit 2; }
config="$1"; shift
if [ -x "$here/.venv/bin/fleetrl" ]; then bin="$here/.venv/bin/fleetrl"; else bin="fleetrl"; fi
exec "$bin" learner --config "$config" "$@"
