#!/usr/bin/env bash
# Submit FleetRL to Slurm with the resources the config asks for (deploy/submit.py), from the checkout:
#
#   deploy/slurm/submit.sh CONFIG [section.field=value ...]                     the fleet (fleet.sbatch, a hetjob)
#   deploy/slurm/submit.sh --resume RUN_DIR [section.field=value ...]           continue a run from its newest checkpoint
#   deploy/slurm/submit.sh --add-actors RUN_DIR [--nodes N] [section.field=value ...]   more actor nodes (add_actors.sbatch)
#
# GPU nodes by default (cluster.*_gpus_per_node GPUs per node); actor.device=cpu asks for CPU nodes. A request the
# cluster cannot run (too few nodes, no GPUs) fails here with one line, exit 2. FLEETRL_SBATCH="--partition=... --time=..."
# adds sbatch options to every component; FLEETRL_DRY_RUN=1 prints the sbatch command.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
exec "$py" -m deploy.submit "$@"
