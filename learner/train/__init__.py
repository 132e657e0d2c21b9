"""The update, on every learner rank: a rank's share of the batch (shard.py) cut into micro-batches
(micro_batches.py, packing.py, batch.py), scored (scoring.py, attention/), and trained with the PPO/GRPO
losses and advantages under DeepSpeed (trainer.py), with the optional critic and reference model and the
data- x sequence-parallel layout of the ranks (distributed.py, sequence_parallel.py).
"""
