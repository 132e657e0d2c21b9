"""log.wandb's config fields. An offline run's rows (wandb starts processes of its own):
tests/integration/test_wandb_offline.py."""

import pytest

from protocol.config import ConfigError, LogConfig, load_config


def test_config():
    with pytest.raises(ConfigError, match=r"log\.wandb_mode: 'cloud' must be online or offline"):
        load_config(None, ["log.wandb_mode=cloud"])
    with pytest.raises(ConfigError, match=r"log\.wandb_project: required when log\.wandb = true"):
        load_config(None, ["log.wandb=true", "log.wandb_project="])
    with pytest.raises(ConfigError, match=r"log\.samples_every_steps: must be >= 0"):
        load_config(None, ["log.samples_every_steps=-1"])
    assert LogConfig().wandb is False
