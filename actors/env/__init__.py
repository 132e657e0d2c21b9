"""Environments for multi-turn episodes (rollout.env): the interface (base.py) and the tool-calling one (tools.py)."""

from actors.env.base import Environment, EpisodeRow, Step, load_env

__all__ = ["Environment", "EpisodeRow", "Step", "load_env"]
