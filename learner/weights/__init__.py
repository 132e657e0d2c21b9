"""Fresh weights from learner rank 0 to every actor: bucketed (buckets.py) and broadcast over a weight
group whose membership and backend are planned per epoch (sync.py; protocol/weights.py on the wire).
"""
