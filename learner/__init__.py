"""The learner group: rank 0 serves the fleet (hub/), every rank trains (train/), rank 0 sends weights (weights/).

The files at this level are the run around them: the rank entry point (main.py), its plan and memory
estimate (plan.py, memory.py), checkpoints and resume, metrics, wandb, sample completions, rollout
statistics, the model folder check, the demo's warm start and DeepSpeed's build locks.
"""
