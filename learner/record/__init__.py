"""What learner rank 0 records of each update: only rank 0 writes.

row.py            an update's metrics row, from what the update returned (no I/O)
rollout_stats.py  the rollout batch's statistics in that row (lengths, finish reasons, reward parts)
metrics.py        RUN_DIR/metrics.jsonl, TensorBoard, and W&B (wandb_log.py)
curve.py          RUN_DIR/reward_curve.png: the few series it draws, kept for the whole run
samples.py        RUN_DIR/samples.jsonl: sample prompts, completions and rewards, decoded
"""
