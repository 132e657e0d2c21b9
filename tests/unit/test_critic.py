"""The critic on a freshly built tiny Qwen2: shapes, learning the clipped value loss, packing, save/load."""

import pytest
import torch
from safetensors.torch import load_file

from deploy.tiny import write_tiny_model
from learner.train.critic import HEAD_FILE, Critic
from learner.train.losses import value_loss


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("policy"), seed=0)


def test_values_shape_dtype_and_init_from_policy(policy_dir):
    critic = Critic.from_pretrained(policy_dir)
    ids = torch.randint(3, 20, (2, 7))
    values = critic(ids)
    assert values.shape == (2, 7) and values.dtype == torch.float32
    assert torch.equal(critic.value_head.bias.detach(), torch.zeros(1))
    assert critic.value_head.weight.abs().max().item() < 0.1  # small init: std 1/129
    # the backbone is the policy's transformer body, weight for weight
    policy = load_file(str(policy_dir / "model.safetensors"))
    assert torch.equal(critic.backbone.embed_tokens.weight.detach(), policy["model.embed_tokens.weight"])
    assert torch.equal(critic.backbone.layers[1].mlp.up_proj.weight.detach(), policy["model.layers.1.mlp.up_proj.weight"])


def test_padding_and_packing_give_the_same_values(policy_dir):
    critic = Critic.from_pretrained(policy_dir).eval()
    torch.manual_seed(0)
    a, b = torch.randint(3, 20, (5,)), torch.randint(3, 20, (3,))
    with torch.no_grad():
        va, vb = critic(a[None])[0], critic(b[None])[0]
        # right-padded batch
        ids = torch.zeros(2, 5, dtype=torch.long)
        ids[0], ids[1, :3] = a, b
        mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
        padded = critic(ids, attention_mask=mask)
        # one packed row, positions restarting per sequence, no mask
        packed = critic(torch.cat([a, b])[None], position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))[0]
    assert torch.allclose(padded[0], va, atol=1e-5) and torch.allclose(padded[1, :3], vb, atol=1e-5)
    assert torch.allclose(packed[:5], va, atol=1e-5) and torch.allclose(packed[5:], vb, atol=1e-5)
    # negative control: without the restart, b's tokens attend to a and get other values
    with torch.no_grad():
        run_on = critic(torch.cat([a, b])[None], position_ids=torch.arange(8)[None])[0]
    assert (run_on[5:] - vb).abs().max().item() > 1e-3


def test_adam_on_clipped_value_loss_fits_fixed_returns(policy_dir):
    torch.manual_seed(0)
    critic = Critic.from_pretrained(policy_dir)
    ids = torch.randint(3, 20, (4, 6))
    returns = torch.rand(4, 6) * 2 - 1
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        values = critic(ids)
        old = values.detach()  # clip around the critic as it was before this step, like one PPO epoch
        out = value_loss(values.flatten(), old.flatten(), returns.flatten(), value_clip=0.2, total_tokens=values.numel())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.2 * losses[0], losses


def test_save_load_reproduces_values_exactly(policy_dir, tmp_path):
    torch.manual_seed(1)
    critic = Critic.from_pretrained(policy_dir)
    with torch.no_grad():  # a trained-looking head, so a fresh head on reload would show
        critic.value_head.weight.normal_()
        critic.value_head.bias.fill_(0.7)
    critic.save_pretrained(tmp_path / "critic")
    assert (tmp_path / "critic" / "config.json").exists() and (tmp_path / "critic" / HEAD_FILE).exists()
    ids = torch.randint(3, 20, (3, 9))
    again = Critic.from_pretrained(tmp_path / "critic")
    with torch.no_grad():
        assert torch.equal(critic.eval()(ids), again.eval()(ids))
        # negative control: the policy folder alone gives a fresh head, so different values
        assert not torch.allclose(Critic.from_pretrained(policy_dir).eval()(ids), critic(ids))
