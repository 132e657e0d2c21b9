"""Generation stall per weight sync, against the raw transfer time of the same bytes.

A learner (CPU 0) and one actor (CPU 1) train for `--steps` updates; the actor logs every sync
(debug), with how long its engine was paused (actors/engine.py apply_weights: pause, receive and
load, repack, resume) and the parts. Then a raw gloo broadcast of the same number of bytes, one
flat tensor into one preallocated tensor between two processes (bench.weight_sync's raw column),
gives the transfer floor. ratio = median stall / median raw transfer; the first sync (the join) is
left out.

  stall       engine paused: pause_generation -> resume_generation returned
  recv+load   receive every bucket and `load_weights` it (actors/weight_receiver.py)
  repack      rebuild the CPU build's packed GEMM weights (actors/worker_ext.py)
  control     the rest: pause/resume and RPC round trips into the engine process (vLLM's pause sleeps 20 ms)

    python -m bench.sync_stall [--steps 30] [--hidden 128 --layers 2] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

from bench.fleet import Fleet, exit_on_sigterm
from bench.weight_sync import measure
from deploy.launch import demo_model
from deploy.tiny import build_model, build_tokenizer
from protocol.config import load_config


def model_dir(hidden: int, layers: int, root: Path) -> tuple[Path, int]:
    """The demo model (128 x 2), or an untrained one of the given size (the stall does not care what it says)."""
    if (hidden, layers) == (128, 2):
        path = demo_model(load_config())
    else:
        path = root / "model"
        tok = build_tokenizer()
        build_model(len(tok), seed=0, hidden=hidden, layers=layers, heads=max(2, hidden // 64)).save_pretrained(path)
        tok.save_pretrained(path)
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return path, sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--trials", type=int, default=15, help="raw broadcasts timed")
    args, overrides = ap.parse_known_args()
    exit_on_sigterm()
    with tempfile.TemporaryDirectory() as tmp:
        path, params = model_dir(args.hidden, args.layers, Path(tmp))
        fleet = Fleet(Path(tmp) / "run", path, [f"train.total_steps={args.steps}", "actor.kvcache_gib=1", *overrides])
        try:
            fleet.start_learner(cpus="0")
            fleet.start_actor("a0", cpus="1", env={"FLEETRL_DEBUG": "1"})
            assert fleet.wait_exit("learner", 1200) == 0, fleet.output("learner")[-3000:]
        finally:
            fleet.stop_all()
        syncs = fleet.find("a0", "actor.weights_loaded")[1:]  # the first is the join
        bucket_mb = fleet.cfg.weights.bucket_mb
    assert syncs, "no weight sync was logged"
    nbytes = params * 4
    raw = measure(1, [[math.ceil(params / 256), 256]], bucket_mb, args.trials, separate=False)["raw"]
    med = {k: statistics.median(s[k] for s in syncs) for k in ("paused_s", "recv_load_s", "repack_s", "join_s")}
    control = statistics.median(s["paused_s"] - s["recv_load_s"] - s["repack_s"] - s["join_s"] for s in syncs)
    raw_s = statistics.median(raw)
    print(
        f"\nGeneration stall per weight sync: {params:,} fp32 parameters ({nbytes / 2**20:.1f} MiB), {bucket_mb} MiB buckets, "
        f"median of {len(syncs)} syncs; raw = one flat broadcast of the same bytes, median of {len(raw)}"
    )
    print(f"{'stall s':>9}{'recv+load s':>13}{'repack s':>10}{'control s':>11}{'raw s':>9}{'stall / raw':>13}{'recv+load / raw':>17}")
    print(
        f"{med['paused_s']:>9.4f}{med['recv_load_s']:>13.4f}{med['repack_s']:>10.4f}{control:>11.4f}{raw_s:>9.4f}"
        f"{med['paused_s'] / raw_s:>13.1f}{med['recv_load_s'] / raw_s:>17.1f}"
    )


if __name__ == "__main__":
    main()
