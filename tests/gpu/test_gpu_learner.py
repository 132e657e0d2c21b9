"""The learner on one CUDA GPU: bf16 against fp32, the token budget and gradient checkpointing against plain
micro-batches. Each run is tests/drivers/train_steps.py under torchrun with one process (NCCL, DeepSpeed on CUDA),
on the demo's tiny model; skipped where there is no GPU (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import torchrun_driver

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "train.total_steps=3",
    "train.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.micro_batch_samples=4",
    "train.mini_batches=2",
    "staleness.max_staleness=1",
    "train.lr=1e-3",
    "train.zero_stage=2",
    "cluster.learner_gpus_per_node=1",
]
BUDGET = ("train.max_tokens_per_micro_batch=12", "actor.max_model_len=10", "train.logprob_chunk_tokens=3")


def run_gpu(model_dir: Path, tmp_path: Path, name: str, *overrides: str) -> dict:
    out = tmp_path / f"{name}.json"
    return torchrun_driver("train_steps.py", 1, out, str(model_dir), str(out), *SETTINGS, *overrides, accelerator="cuda")


@pytest.fixture(scope="module")
def fp32(tiny_model_dir, tmp_path_factory):
    return run_gpu(tiny_model_dir, tmp_path_factory.mktemp("fp32"), "fp32", "model.dtype=float32")


@pytest.fixture(scope="module")
def bf16(tiny_model_dir, tmp_path_factory):
    return run_gpu(tiny_model_dir, tmp_path_factory.mktemp("bf16"), "bf16", "model.dtype=bfloat16")


def test_bf16_update_matches_fp32(fp32, bf16):
    """Stated tolerance: the first update (same starting weights) within 2% in loss. Its gradient norm (of the update's
    last step) within 20%: bf16 compute and a first step below bf16's resolution move this small model's gradient
    norm by more than 5% (so do the same runs on the CPU); a wrong loss scale would be off by a whole factor. Later
    updates drift apart as bf16 rounding moves the weights differently, so only the first is held tight."""
    assert bf16["losses"][0] == pytest.approx(fp32["losses"][0], rel=2e-2, abs=1e-3)
    assert bf16["grad_norms"][0] == pytest.approx(fp32["grad_norms"][0], rel=2e-1)
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=1e-1, abs=1e-2)


def test_bf16_many_micro_batches_match_fp32(fp32, bf16, tiny_model_dir, tmp_path):
    """bf16 + ZeRO-2 with the token budget (several micro-batches per step, their gradients summed in fp32): the
    numbers of the same bf16 run with whole micro-batches, to kernel noise, and fp32's loss as above. The fp32 sum
    itself is proven exactly on the CPU (tests/integration/test_bf16_accumulation.py)."""
    budget = run_gpu(tiny_model_dir, tmp_path, "bf16-budget", "model.dtype=bfloat16", *BUDGET)
    assert budget["grad_accum_dtype"] == bf16["grad_accum_dtype"] == "torch.float32"
    assert max(len(mini) for update in budget["micro_sizes"] for mini in update) >= 2
    assert budget["losses"][0] == pytest.approx(bf16["losses"][0], rel=2e-3)
    assert budget["grad_norms"][0] == pytest.approx(bf16["grad_norms"][0], rel=2e-2)
    assert budget["losses"][0] == pytest.approx(fp32["losses"][0], rel=2e-2, abs=1e-3)


def test_token_budget_and_checkpointing_match_plain_micro_batches(fp32, tiny_model_dir, tmp_path):
    """Token-budget micro-batches, gradient checkpointing and chunked logprobs on CUDA: the numbers of 4-sample
    micro-batches, within fp32 reduction-order noise."""
    budget = run_gpu(tiny_model_dir, tmp_path, "budget", "model.dtype=float32", "train.gradient_checkpointing=true", *BUDGET)
    sizes = [mini for update in budget["micro_sizes"] for mini in update]
    assert any(len(mini) > 1 for mini in sizes)
    assert budget["losses"] == pytest.approx(fp32["losses"], rel=1e-3, abs=1e-6)
    assert budget["grad_norms"] == pytest.approx(fp32["grad_norms"], rel=1e-3)
    assert budget["weight_abs"] == pytest.approx(fp32["weight_abs"], rel=1e-5)
