"""bf16 + ZeRO-2 with micro-batch gradients summed in fp32 (learner/train/engines.py), on the CPU backend: DeepSpeed's
CPU accelerator runs bf16, so none of this needs a GPU (tests/gpu/test_gpu_learner.py compares it with fp32 on one).

- The learner's own DeepSpeed config on one weight, eight micro-batches with gradients 256, 1, ..., 1: bf16 has 8
  significant bits, so 256 + 1 rounds back to 256 and a bf16 sum stays 256; an fp32 sum is 263. The same engine with
  DeepSpeed's default (the model's dtype) is the control that shows the probe can tell them apart.
- The real trainer in bf16 (tests/drivers/train_steps.py): a token budget cuts each optimizer step into many
  micro-batches, and the step's loss and gradient norm are those of 4-sample micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from conftest import torchrun_driver

SETTINGS = [
    "train.total_steps=2",
    "train.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.micro_batch_samples=4",
    "train.mini_batches=1",  # update 0's step starts from the same weights in both runs
    "staleness.max_staleness=1",
    "train.lr=1e-3",
    "train.zero_stage=2",
    "cluster.learner_gpus_per_node=1",
    "model.dtype=bfloat16",
]
BUDGET = ("train.max_tokens_per_micro_batch=12", "actor.max_model_len=10", "train.logprob_chunk_tokens=3")


@pytest.mark.parametrize("fp32_sum, norm", [(True, 263.0), (False, 256.0)])
def test_zero2_bf16_sums_micro_batch_gradients_in_fp32(fp32_sum, norm):
    import deepspeed

    from learner.train.distributed import init_distributed
    from learner.train.engines import UpdateLayout, deepspeed_config
    from protocol.config import load_config

    cfg = load_config(None, ["model.dtype=bfloat16", "train.zero_stage=2"])
    init_distributed()
    layout = UpdateLayout(mini_batches=1, ppo_epochs=1, micro_samples=1, accumulation=8, run_steps=10)
    config = deepspeed_config(cfg, layout, 1e-3, cuda=False)
    assert config["bf16"] == {"enabled": True} and config["zero_optimization"]["stage"] == 2
    if not fp32_sum:
        config.pop("data_types")  # the control: DeepSpeed's default
    model = torch.nn.Linear(1, 1, bias=False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    grads = [256.0] + [1.0] * 7  # d(w * x)/dw = x, exact in bf16
    for i, x in enumerate(grads):
        engine.set_gradient_accumulation_boundary(i == len(grads) - 1)  # as the trainer does
        engine.backward(engine(torch.tensor([[x]], dtype=torch.bfloat16)).sum(), scale_wrt_gas=False)
        engine.step()
    assert engine.get_data_types() == (torch.bfloat16, torch.float32 if fp32_sum else torch.bfloat16)
    assert float(engine.get_global_grad_norm()) == norm


def test_trainer_bf16_token_budget_matches_whole_micro_batches(tiny_model_dir, tmp_path):
    """Many small micro-batches per step sum to the gradient of a few whole ones (bf16 compute, fp32 sums)."""
    runs = {}
    for name, extra in (("whole", ()), ("budget", BUDGET)):
        out = tmp_path / f"{name}.json"
        runs[name] = torchrun_driver("train_steps.py", 1, out, str(tiny_model_dir), str(out), *SETTINGS, *extra)
    whole, budget = runs["whole"], runs["budget"]
    assert whole["grad_accum_dtype"] == budget["grad_accum_dtype"] == "torch.float32"
    assert [len(m) for m in whole["micro_sizes"][0]] == [4] and len(budget["micro_sizes"][0][0]) > 4
    assert budget["losses"][0] == pytest.approx(whole["losses"][0], rel=1e-4)
    assert budget["grad_norms"][0] == pytest.approx(whole["grad_norms"][0], rel=1e-3)
    assert budget["losses"][1] != pytest.approx(budget["losses"][0], rel=1e-3), "the step must move the weights"
