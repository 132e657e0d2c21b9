"""Multi-turn episodes: observation tokens are context, never trained (learner/train/batch.py's scored tokens).

A hand-built trajectory prompt | model turn | observation | model turn: its observation tokens stay in the sequence
(the model attends to them) but every loss term, advantage and count sees only the model's tokens. Each check below
compares FleetRL's masked computation with the same numbers made by hand from the full logits, taking only the
model's tokens; they would differ if an observation token were scored, or if it were dropped from the context.
"""

import numpy as np
import pytest
import torch
from conftest import rollout_group
from test_packing import tiny_qwen2

from learner.hub.core.checks import GroupLimits, check_group
from learner.train.advantages import GAEAdvantage, make_advantage
from learner.train.aggregation import Denominators
from learner.train.attention.hf import VARLEN
from learner.train.batch import Sample, group_samples, make_micro_batch, token_logprobs
from learner.train.losses import make_policy_loss
from learner.train.packing import pack_samples
from learner.train.shard import Share, decode_share, encode_share, make_shares
from protocol import messages as m
from protocol.config import AlgoConfig, load_config

T = 0.7
# (prompt length, completion mask): model turn, observation, model turn; a one-turn sample (no mask); obs at the end
SHAPES = [(4, [1, 1, 0, 0, 0, 1, 1]), (2, None), (3, [1, 0, 1, 0, 0, 1]), (5, [1, 1, 1, 0, 0])]


def masked_samples(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, mask) in enumerate(SHAPES):
        c = len(mask) if mask is not None else 5
        scored = c if mask is None else sum(mask)
        out.append(
            Sample(
                tokens=rng.integers(0, 40, p + c).astype(np.int32),
                prompt_len=p,
                behaviour_logprobs=(-3.7 + 0.1 * rng.normal(size=scored)).astype(np.float32),
                advantage=(-1.0) ** i * (0.5 + i),
                reward=float(i),
                version_min=3,
                version_max=3,
                loss_mask=None if mask is None else np.asarray(mask, np.uint8),
            )
        )
    return out


def by_hand(model, samples):
    """Each sample alone through the model (its observations in the context); logprobs of the model's tokens only."""
    logps = []
    for s in samples:
        logits = model(input_ids=torch.from_numpy(s.tokens.astype(np.int64))[None]).logits[0]
        c = len(s.tokens) - s.prompt_len
        keep = np.ones(c, bool) if s.loss_mask is None else s.loss_mask.astype(bool)
        at = torch.from_numpy(s.prompt_len + np.flatnonzero(keep))
        logps.append(torch.log_softmax(logits[at - 1] / T, -1).gather(1, torch.from_numpy(s.tokens[at].astype(np.int64))[:, None])[:, 0])
    return torch.cat(logps)


def loss_of(logp, behaviour, adv, tokens):
    return make_policy_loss(AlgoConfig())(logp, behaviour, adv, Denominators(tokens=tokens)).loss


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_loss_and_gradients_count_only_the_models_tokens(layout):
    samples = masked_samples()
    scored = sum(s.n_scored for s in samples)
    assert scored == 4 + 5 + 3 + 3 and scored < sum(len(s.tokens) - s.prompt_len for s in samples)
    model = tiny_qwen2(2, 2)
    ref_logp = by_hand(model, samples)
    behaviour = torch.from_numpy(np.concatenate([s.behaviour_logprobs for s in samples]))
    adv = torch.cat([torch.full((s.n_scored,), s.advantage) for s in samples])
    ref_loss = loss_of(ref_logp, behaviour, adv, scored)
    model.zero_grad()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    if layout == "packed":
        model.set_attn_implementation(VARLEN)
        mb = pack_samples(samples, version=3)
        logits = model(**mb.model_kwargs()).logits
    else:
        mb = make_micro_batch(samples, version=3)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    assert mb.lengths.tolist() == [s.n_scored for s in samples]
    logp = token_logprobs(logits, mb, T)
    torch.testing.assert_close(logp.detach(), ref_logp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(mb.behaviour_logp, behaviour)
    loss = loss_of(logp, mb.behaviour_logp, mb.token_adv, scored)
    model.zero_grad()
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-5, atol=1e-6, msg=lambda msg, n=name: f"{n}: {msg}")


def test_gae_runs_over_the_models_tokens_as_if_the_observations_were_absent():
    """The critic's values and the reward at the model's tokens only: GAE over a masked episode is GAE over the same
    trajectory with its observation tokens cut out (the reward on the last model token)."""
    masked, absent = masked_samples()[0], masked_samples()[0]
    keep = masked.loss_mask.astype(bool)
    absent.tokens = np.concatenate([masked.tokens[: masked.prompt_len], masked.tokens[masked.prompt_len :][keep]])
    absent.loss_mask = None
    unit = GAEAdvantage(gamma=0.9, lam=0.8)
    values = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    a = unit(torch.tensor([1.0]), make_micro_batch([masked], 3).lengths, values)
    b = unit(torch.tensor([1.0]), make_micro_batch([absent], 3).lengths, values)
    torch.testing.assert_close(a.tokens, b.tokens)
    torch.testing.assert_close(a.returns, b.returns)
    assert len(a.tokens) == 4


def episode_group(n=3, seed=0):
    """A well-formed group whose completions are episodes: observation tokens (mask 0) with logprob slots of 0."""
    g = rollout_group(n=n, seed=seed)
    g.lengths = np.asarray([6, 4, 5][:n], np.int32)
    total = int(g.lengths.sum())
    rng = np.random.default_rng(seed)
    g.completion_tokens = rng.integers(0, 20, total).astype(np.int32)
    g.loss_mask = np.asarray([1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1][:total], np.uint8)
    g.behaviour_logprobs = np.where(g.loss_mask == 1, -rng.random(total), 0.0).astype(np.float32)
    return g


def test_group_samples_keep_the_mask_and_the_models_logprobs():
    g = episode_group()
    g.check()
    assert g.model_token_counts().tolist() == [4, 3, 3]
    samples = group_samples(g, torch.zeros(3))
    assert [s.n_scored for s in samples] == [4, 3, 3]
    assert np.array_equal(np.concatenate([s.behaviour_logprobs for s in samples]), g.behaviour_logprobs[g.loss_mask == 1])
    one_turn = group_samples(rollout_group(n=3), torch.zeros(3))
    assert all(s.loss_mask is None for s in one_turn)


def test_a_share_carries_the_mask_to_the_other_ranks():
    share = Share(samples=masked_samples(), mini_batch_tokens=[15], mini_batch_samples=[4], micro_sizes=[[4]], version=3)
    back = decode_share(encode_share(share))
    for a, b in zip(share.samples, back.samples, strict=True):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
        assert (a.loss_mask is None and b.loss_mask is None) or np.array_equal(a.loss_mask, b.loss_mask)
        assert a.scored().tolist() == b.scored().tolist()


@pytest.mark.parametrize("advantage", ["grpo", "reinforce_baseline"])
def test_shares_count_the_models_tokens(advantage):
    cfg = load_config(
        None, ["rollout.samples_per_prompt=3", "train.prompts_per_step=2", "train.micro_batch_samples=6", f"algo.advantage={advantage}"]
    )
    groups = [episode_group(seed=0), episode_group(seed=1)]
    (share,), adv = make_shares(cfg, groups, version=0, max_staleness=0, dp_size=1)
    assert share.mini_batch_tokens == [20] and share.mini_batch_samples == [6]
    rewards = torch.from_numpy(np.stack([g.rewards for g in groups]))
    counts = torch.from_numpy(np.stack([g.model_token_counts() for g in groups]))
    torch.testing.assert_close(adv, make_advantage(cfg.algo).per_sample(rewards, counts))


def test_the_wire_refuses_a_broken_mask():
    for edit, needle in (
        (lambda g: setattr(g, "loss_mask", g.loss_mask[:-1]), "loss_mask: 14 values, lengths sum to 15"),
        (lambda g: g.loss_mask.__setitem__(0, 2), "loss_mask: value 2, only 0 and 1"),
        (lambda g: g.loss_mask.__setitem__(slice(6, 10), 0), "a completion with no model token"),
    ):
        g = episode_group()
        edit(g)
        with pytest.raises(m.ProtocolError, match=needle):
            g.check()


def test_the_hub_takes_observation_tokens_only_from_an_environment():
    g = episode_group()
    granted = g.prompt_tokens
    one_turn = GroupLimits.of(load_config(None, ["rollout.max_tokens=8"]), 20)
    refusal = check_group(g, granted, one_turn)
    assert refusal is not None and refusal.reason == "mask" and "5 observation tokens" in refusal.detail
    episodes = GroupLimits.of(load_config(None, ["rollout.max_tokens=2", "rollout.env=x:Y", "rollout.max_episode_tokens=6"]), 20)
    assert check_group(g, granted, episodes) is None  # 6 tokens per episode, turns of 2
    short = GroupLimits.of(load_config(None, ["rollout.max_tokens=2", "rollout.env=x:Y", "rollout.max_episode_tokens=5"]), 20)
    assert check_group(g, granted, short).reason == "length"
    g.behaviour_logprobs[2] = -0.5  # an observation token's slot
    assert check_group(g, granted, episodes).reason == "logprob"
