"""The learner group: rank 0 serves the fleet (hub/), every rank trains (train/), rank 0 sends weights (weights/)
and records each update (record/), and every rank checks the run's plan before it starts (plan/).

The files at this level are the run around them: the rank entry point (main.py), rank 0's run (root.py) and its
update (update.py), the staleness rule both hub/ and train/ obey (staleness.py), eval rounds (evaluator.py),
checkpoints and resume, the model folder check, the demo's warm start and DeepSpeed's build locks; the prompt
sets are data/.
"""
