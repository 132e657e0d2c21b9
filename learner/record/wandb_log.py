"""Weights & Biases, optional (log.wandb = true; `pip install 'fleetrl[wandb]'`): each metrics row, as
MetricsWriter writes it, becomes one wandb.log at step = row["step"].

log.wandb_mode = "offline" needs no network and no account: wandb writes RUN_DIR/wandb/offline-run-*/ and
`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later. The run's id is kept in RUN_DIR/wandb/fleetrl-run-id,
so `fleetrl learner --resume` continues the same W&B run. wandb's console capture is off: the learner's own log
lines go where they always go.
"""

from __future__ import annotations

import math
import secrets
from pathlib import Path
from typing import Any

from protocol.config import ConfigError, LogConfig


class WandbLogger:
    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(
                "log.wandb: true, but the wandb package is not installed: pip install 'fleetrl[wandb]' (or set log.wandb = false)"
            ) from e
        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "fleetrl-run-id"
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))  # W&B ids: lowercase letters and digits
        self.run = wandb.init(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name or run_dir.absolute().name,
            mode="offline" if cfg.wandb_mode == "offline" else "online",
            dir=str(run_dir),
            id=id_file.read_text().strip(),
            resume="allow",
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    @property
    def where(self) -> str:
        """The run's page online, or its local folder offline."""
        return self.run.url or self.run.dir

    def log(self, row: dict[str, Any]) -> None:
        values = {
            k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float) and math.isfinite(v)
        }  # bool: a 0/1 chart
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()
