"""The frozen reference policy: same logprobs as the policy it was copied from, and it never trains."""

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from deploy.tiny import write_tiny_model
from learner.train.batch import Sample, make_micro_batch, token_logprobs
from learner.train.reference import ReferencePolicy


def test_reference_logprobs_match_the_policy_and_stay_frozen(tmp_path):
    path = write_tiny_model(tmp_path / "policy", seed=0)
    policy = AutoModelForCausalLM.from_pretrained(str(path))
    ref = ReferencePolicy.from_pretrained(path)
    assert not ref.model.training and not any(p.requires_grad for p in ref.model.parameters())
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            tokens=rng.integers(3, 20, size=n).astype(np.int32),
            prompt_len=3,
            behaviour_logprobs=np.zeros(n - 3, np.float32),
            advantage=1.0,
            reward=1.0,
            version_min=0,
            version_max=0,
        )
        for n in (5, 8)
    ]
    mb = make_micro_batch(samples, version=0)
    ref_logp = ref.logprobs(mb, temperature=0.7)
    assert ref_logp.shape == (2 + 5,) and not ref_logp.requires_grad
    logp = token_logprobs(policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb, 0.7)
    assert torch.allclose(ref_logp, logp.detach(), atol=1e-6)
    # one policy step moves the policy, not the reference
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    (-logp.sum()).backward()
    opt.step()
    assert torch.equal(ref.logprobs(mb, temperature=0.7), ref_logp)
    new = token_logprobs(policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb, 0.7)
    assert (new - ref_logp).abs().max().item() > 1e-3
