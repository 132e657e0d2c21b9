"""log.wandb in offline mode: no network, no account; the rows MetricsWriter writes land in RUN_DIR/wandb's run file.
wandb.init starts wandb's own processes (wandb-core, wandb-symon) and talks to them over sockets.

The run file (run-ID.wandb) is a LevelDB-style log of wandb's protobuf records (its SDK reads it back only from
Go now): read here with the few lines that format needs, so the values are checked, not just the file's presence.
"""

import json
import struct

import pytest

from protocol.config import load_config

wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install 'fleetrl[wandb]'; the dev extra has it)")


def test_offline_run_holds_the_logged_rows(tmp_path, monkeypatch):
    from learner.record.metrics import MetricsWriter
    from learner.record.wandb_log import WandbLogger

    monkeypatch.setenv("WANDB_API_KEY", "")  # offline needs none; a developer's own key must not matter
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # the config's run directory wins
    cfg = load_config(None, ["log.wandb=true", "log.wandb_mode=offline", "log.wandb_project=fleetrl-test"])
    logger = WandbLogger(cfg.log, tmp_path, cfg.to_dict())
    assert logger.where.startswith(str(tmp_path / "wandb" / "offline-run-"))
    writer = MetricsWriter(tmp_path, logger)
    rows = [
        {
            "step": s,
            "reward_mean": 0.25 * s,
            "response/length_mean": 3.5 + s,
            "reward/part/correct": 0.5,
            "logprob_mismatch": float("nan"),
            "note": "text",
        }
        for s in (1, 2, 3)
    ]
    for row in rows:
        writer.write(row)
    writer.close()

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(read_records(run_file))
    history = [{k: v for k, v in h.items() if not k.startswith("_")} | {"_step": h["_step"]} for h in (history_of(r) for r in records) if h]
    assert history == [
        {"reward_mean": 0.25 * s, "response/length_mean": 3.5 + s, "reward/part/correct": 0.5, "_step": s} for s in (1, 2, 3)
    ]  # NaN and strings left out, as in TensorBoard
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("fleetrl-test", tmp_path.name)
    assert json.loads({i.key: i.value_json for i in run.config.update}["train"])["lr"] == cfg.train.lr
    # The id is kept: a resumed learner continues the same W&B run.
    assert (tmp_path / "wandb" / "fleetrl-run-id").read_text() == run.run_id


def read_records(path):
    """wandb's run file: a 7-byte header, then 32 KiB blocks of records (crc32, length, type; FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    raw, block, pos, pending = path.read_bytes(), 32 * 1024, 7, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history_of(record) -> dict | None:
    if record.WhichOneof("record_type") != "history":
        return None
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
