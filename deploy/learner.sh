#!/usr/bin/env bash
# Start the learner group's ranks on this node: deploy/learner.sh [--resume RUN_DIR] CONFIG [section.field=value ...]
# (--resume: continue RUN_DIR from its newest complete checkpoint, `fleetrl learner --resume`).
#
# One node: `fleetrl learner` starts cluster.learner_gpus_per_node ranks itself (torchrun).
# Several nodes: run this on every learner node with the same MASTER_ADDR / MASTER_PORT and its NODE_RANK:
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 deploy/learner.sh configs/orz_32b_ppo.toml
# (cluster.learner_nodes and cluster.learner_gpus_per_node in the config must match.) Under srun, NODE_RANK
# defaults to SLURM_NODEID (deploy/slurm/fleet.sbatch).
# deploy.torchrun is torchrun (same arguments) printing each rank's error once, as one line (deploy/errors.py).
#
# Rank 0 (node 0) hosts the hub on hub.bind (use tcp://0.0.0.0:PORT for remote actors) and the weight-group
# rendezvous on weights.host:weights.port; open both ports to the actor nodes only.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
resume=()
if [ "${1:-}" = --resume ]; then resume=(--resume "${2:?usage: $0 --resume RUN_DIR CONFIG [...]}"); shift 2; fi
[ $# -ge 1 ] || { echo "usage: $0 [--resume RUN_DIR] CONFIG [section.field=value ...]" >&2; exit 2; }
config="$1"; shift
nnodes="${NNODES:-1}"
if [ "$nnodes" -le 1 ]; then
  cmd=("$py" -m deploy.cli learner "${resume[@]}" --config "$config" "$@")
else
  NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
  : "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}" "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
  nproc="${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
  [ "$nproc" -ge 1 ] || { echo "$0: set NPROC_PER_NODE (no GPUs found)" >&2; exit 2; }
  cmd=("$py" -m deploy.torchrun --nnodes "$nnodes" --node-rank "$NODE_RANK" --nproc-per-node "$nproc"
       --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" -m deploy.cli learner "${resume[@]}" --config "$config" "$@")
fi
if dry; then show "${cmd[@]}"; exit 0; fi
exec "${cmd[@]}"
