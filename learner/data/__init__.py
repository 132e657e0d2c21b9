"""Prompt sets: the built-in addition task, or rows read through Hugging Face `datasets` (sources.py),
mapped from a known format and rendered to prompt text and tokens (rows.py), held as a PromptSet
with its validation and test splits (prompts.py).
"""
