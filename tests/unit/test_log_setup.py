"""What a process's log setup keeps off the user's screen."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from protocol.logs import setup_logging


def test_torchs_deprecation_notices_for_deepspeed_and_vllm_stay_off_the_screen(keep_logging, monkeypatch):
    """ZeRO-3 (DeepSpeed) calls all_gather_into_tensor and vLLM reads torch.distributed.reduce_op: torch's notices about
    their old names are nothing a user can act on. Other warnings still show. The processes it starts inherit the
    filters through PYTHONWARNINGS, after what was there (tests/slurm's learner crash test checks a job's output)."""
    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        setup_logging("learner")
        assert dist.reduce_op.SUM == dist.ReduceOp.SUM
        with pytest.raises((ValueError, RuntimeError)):  # no process group here: torch warns before it looks
            dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))
        warnings.warn("a warning of the user's own", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a warning of the user's own"]
    entries = os.environ["PYTHONWARNINGS"].split(",")
    assert entries[0] == "default::DeprecationWarning" and "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning" in entries
    setup_logging("learner")  # again: nothing added twice
    assert os.environ["PYTHONWARNINGS"].split(",") == entries
