"""Attention over packed rows: each sample attends only to itself. varlen.py picks the kernel (flash-attn,
torch's varlen_attn, SDPA), ring.py splits a sequence across sequence-parallel ranks, hf.py registers the
chosen function with transformers' models.
"""
