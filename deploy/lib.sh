# Sourced by the deploy scripts: the checkout, its Python, and dry runs.
#
# FLEETRL_DRY_RUN=1 makes a script print each command it would start (one line, shell-quoted) instead of
# starting it: a preview for operators, and how tests/integration/test_deploy_scripts.py renders the Slurm templates.
# FLEETRL_PYTHON picks the interpreter (default: the checkout's .venv, else python3).
fleetrl_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${FLEETRL_PYTHON:-}" ]; then py="$FLEETRL_PYTHON"
elif [ -x "$fleetrl_root/.venv/bin/python" ]; then py="$fleetrl_root/.venv/bin/python"
else py="python3"; fi
export PYTHONPATH="$fleetrl_root${PYTHONPATH:+:$PYTHONPATH}"  # `-m deploy.cli` finds this checkout from any cwd

dry() { [ -n "${FLEETRL_DRY_RUN:-}" ]; }

show() {  # print a command line, shell-quoted
  local line
  printf -v line '%q ' "$@"
  printf '%s\n' "${line% }"
}

wait_all() {  # wait_all NAME PID...: wait for every PID; if one fails, stop_all (the caller's) and return 1
  local name="$1"; shift
  local pids=("$@") status=0 alive p
  while [ ${#pids[@]} -gt 0 ]; do
    if ! wait -n; then status=1; break; fi
    alive=(); for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done; pids=("${alive[@]}")
  done
  if [ $status -ne 0 ]; then echo "$name: one failed; stopping the others" >&2; stop_all; fi
  return $status
}
