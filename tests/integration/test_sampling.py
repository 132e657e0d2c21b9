"""Top-k / top-p and stop strings: the learner scores the distribution the actor sampled from.

vLLM (logprobs_mode="processed_logprobs") reports each sampled token's logprob under softmax(logits / t)
renormalised over what top-k then top-p keep (vllm/v1/sample/ops/topk_topp_sampler.py). learner/train/scoring.py's
ChunkedLogprobs masks each chunk the same way. Checked three ways:
- the kept set against vLLM's own apply_top_k_top_p_pytorch, and values and gradients against a plain
  full-logits reference (with gradcheck);
- a real vLLM engine (CPU build) sampling at top_p < 1 and top_k: its logprobs equal the learner's at version 0
  (the weights from disk), and would not without the learner's masking;
- stop strings on that engine: finish reason "stop", the text cut before the stop string unless asked to keep it.
"""

import asyncio

import numpy as np
import pytest
import torch

from learner.train.scoring import ChunkedLogprobs, install_scoring_head, score_tokens, threshold
from tests.unit.test_scoring import LargestTensor

CASES = [(0, 0.8), (4, 1.0), (5, 0.7), (0, 0.3), (3, 0.999)]  # (top_k, top_p); top_k 0 and top_p 1 are off


def plain_keep(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Row by row, the textbook definition: the k largest, then the smallest most-likely prefix of their
    renormalised distribution whose mass reaches top_p."""
    keep = torch.zeros(z.shape, dtype=torch.bool)
    for i, row in enumerate(z):
        order = row.argsort(descending=True)
        if top_k:
            order = order[:top_k]
        probs = row[order].softmax(-1)
        before = torch.cumsum(probs, 0) - probs  # mass of the tokens ranked above each
        keep[i, order[before < top_p]] = True
    return keep


def reference(hidden, weight, targets, t, top_k, top_p):
    """Full [T, V] logits, masked with plain_keep (plus the target), through autograd."""
    z = hidden @ weight.t() / t
    keep = plain_keep(z.detach(), top_k, top_p)
    keep[torch.arange(len(targets)), targets] = True
    logp = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    p = logp.exp()
    entropy = -(p * logp.masked_fill(~keep, 0.0)).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy, keep


@pytest.mark.vllm
@pytest.mark.parametrize("top_k,top_p", CASES)
def test_kept_set_is_vllms(top_k, top_p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(top_k * 10 + int(top_p * 100))
    z = torch.randn(64, 50) * 2
    k = torch.full((64,), top_k) if top_k else None
    p = torch.full((64,), top_p) if top_p < 1 else None
    vllm_logits = apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True)
    ours = z >= threshold(z, top_k, top_p)[:, None]
    assert torch.equal(ours, torch.isfinite(vllm_logits))
    assert torch.equal(ours, plain_keep(z, top_k, top_p))
    assert (ours.sum(-1) >= 1).all() and (not top_k or (ours.sum(-1) <= top_k).all())


@pytest.mark.parametrize("chunk", [1, 5, 100])
@pytest.mark.parametrize("top_k,top_p", CASES)
@pytest.mark.parametrize("entropy", [False, True])
def test_masked_chunked_logprobs_match_reference_and_gradcheck(chunk, top_k, top_p, entropy):
    torch.manual_seed(chunk)
    hidden = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(13, 6, dtype=torch.float64) * 2).requires_grad_()
    z = (hidden @ weight.t() / 0.7).detach()
    kept = plain_keep(z, top_k, top_p)
    # Sampled tokens: in the kept set, except the last row's (a stale sample: see the target rule).
    targets = torch.stack([torch.multinomial(kept[i].double(), 1)[0] for i in range(11)])
    targets[-1] = (~kept[-1]).nonzero()[0, 0] if (~kept[-1]).any() else targets[-1]
    out = ChunkedLogprobs.apply(hidden, weight, targets, 0.7, chunk, entropy, top_k, top_p)
    logp, ent, _ = reference(hidden, weight, targets, 0.7, top_k, top_p)
    torch.testing.assert_close(out[:, 0], logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 1], ent if entropy else torch.zeros_like(ent), rtol=0, atol=1e-12)
    assert torch.isfinite(out).all()
    # Gradients: the same as autograd through the masked full logits, and as finite differences.
    (g_h, g_w) = torch.autograd.grad((out[:, 0] + 0.3 * out[:, 1]).sum(), (hidden, weight))
    (r_h, r_w) = torch.autograd.grad((logp + (0.3 * ent if entropy else 0)).sum(), (hidden, weight))
    torch.testing.assert_close(g_h, r_h, rtol=0, atol=1e-10)
    torch.testing.assert_close(g_w, r_w, rtol=0, atol=1e-10)
    assert torch.autograd.gradcheck(lambda h, w: ChunkedLogprobs.apply(h, w, targets, 0.7, chunk, entropy, top_k, top_p), (hidden, weight))


def test_masked_logits_get_no_gradient():
    """With an identity head (z = h / t) the hidden gradient is the logit gradient: 0 off the kept set, and
    (onehot(target) - softmax over the kept set) / t on it."""
    torch.manual_seed(1)
    hidden = (torch.randn(4, 9, dtype=torch.float64) * 2).requires_grad_()
    weight = torch.eye(9, dtype=torch.float64)
    targets = (hidden.detach() / 0.5).argmax(-1)  # the most likely token: always kept
    ChunkedLogprobs.apply(hidden, weight, targets, 0.5, 2, False, 3, 0.9)[:, 0].sum().backward()
    kept = plain_keep(hidden.detach() / 0.5, 3, 0.9)
    assert (hidden.grad[~kept] == 0).all() and kept.sum() < kept.numel()
    probs = (hidden.detach() / 0.5).masked_fill(~kept, float("-inf")).softmax(-1)
    expected = (torch.nn.functional.one_hot(targets, 9) - probs) / 0.5
    torch.testing.assert_close(hidden.grad, expected.masked_fill(~kept, 0.0), rtol=0, atol=1e-12)


def test_masking_keeps_no_tokens_by_vocab_tensor():
    hidden = torch.randn(400, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (400,))
    with LargestTensor() as seen:
        ChunkedLogprobs.apply(hidden, weight, targets, 1.0, 50, True, 20, 0.9).sum().backward()
    assert seen.largest < 400 * 1000, seen.largest


# ---- a real engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_setup(tmp_path_factory):
    """One engine for every case below (its startup is the slow part); each case sends its own sampling."""
    from transformers import AutoModelForCausalLM

    from actors.engine import Engine
    from deploy.tiny import write_tiny_model
    from protocol.config import load_config

    path = write_tiny_model(tmp_path_factory.mktemp("model"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # a random model is near uniform over its 20 tokens: spread it so top-p keeps a few
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    cfg = load_config(None, [f"model.path={path}", "rollout.max_tokens=12", "actor.max_model_len=32"])
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    engine = loop.run_until_complete(_make(Engine, cfg))
    head = install_scoring_head(model)
    yield engine, model, head, loop
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0.5))  # AsyncLLM closes its sockets from tasks on this loop
    loop.close()


async def _make(cls, cfg):
    return cls(cfg)


PROMPT = np.array([5, 6, 17, 7, 15], dtype=np.int32)


def learner_logprobs(model, head, completions, s, top_k=None, top_p=None):
    from learner.train.batch import Sample, make_micro_batch

    samples = [
        Sample(
            tokens=np.concatenate([PROMPT, c.token_ids]),
            prompt_len=len(PROMPT),
            behaviour_logprobs=c.logprobs,
            advantage=0.0,
            reward=0.0,
            version_min=0,
            version_max=0,
        )
        for c in completions
    ]
    mb = make_micro_batch(samples, 0)
    with torch.no_grad():
        logp, _ = score_tokens(
            model,
            head,
            mb,
            s.temperature,
            7,
            False,
            torch.device("cpu"),
            top_k=s.top_k if top_k is None else top_k,
            top_p=s.top_p if top_p is None else top_p,
        )
    return logp.numpy(), mb.behaviour_logp.numpy()


@pytest.mark.engine
@pytest.mark.vllm
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 0.8), (1.0, 4, 1.0), (0.7, 6, 0.9)])
def test_engine_logprobs_match_the_learner_under_top_k_top_p(engine_setup, temperature, top_k, top_p):
    from actors.engine import Sampling

    engine, model, head, loop = engine_setup
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    completions = loop.run_until_complete(engine.generate_group(PROMPT, 16, seed=7, sampling=s))
    ours, theirs = learner_logprobs(model, head, completions, s)
    assert len(ours) >= 16 and np.abs(ours - theirs).max() < 1e-4, np.abs(ours - theirs).max()
    # The control: scored without the truncation the learner would disagree (the check above proves something).
    untruncated, _ = learner_logprobs(model, head, completions, s, top_k=0, top_p=1.0)
    assert np.abs(untruncated - theirs).max() > 0.05


@pytest.mark.engine
@pytest.mark.vllm
def test_stop_strings(engine_setup):
    """A stop string ends a completion with finish reason "stop"; its text stops before it (vLLM's
    include_stop_str_in_output=False), or ends with it when asked (ORZ asks: it needs the "</answer>"); the token
    that completed it is kept in the token ids, and the logprobs still match the learner's."""
    from actors.engine import Sampling

    engine, model, head, loop = engine_setup
    plain = loop.run_until_complete(engine.generate_group(PROMPT, 16, seed=3, sampling=Sampling(temperature=1.0)))
    texts = "".join(c.text for c in plain)
    stop = max(set(texts) - {" "}, key=texts.count)  # the most common character: most completions meet it
    for keep in (False, True):
        s = Sampling(temperature=1.0, stop=(stop,), include_stop_str=keep)
        completions = loop.run_until_complete(engine.generate_group(PROMPT, 16, seed=3, sampling=s))
        stopped = [c for c in completions if c.finish_reason == "stop" and stop in engine.tokenizer.decode(c.token_ids)]
        assert stopped, "no completion met the stop string"
        for c in stopped:
            assert c.text.endswith(stop) if keep else stop not in c.text
            decoded = engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert decoded.startswith(c.text.removesuffix(stop)) and decoded.endswith(stop)
        for c in completions:
            if c.finish_reason == "length":
                assert stop not in c.text and len(c.token_ids) == 12
        ours, theirs = learner_logprobs(model, head, completions, s)
        assert np.abs(ours - theirs).max() < 1e-4


# ---- config -------------------------------------------------------------------------------------------


def test_sampling_config_fields():
    import tomllib

    from actors.engine import Sampling
    from protocol.config import ConfigError, dump_toml, load_config

    cfg = load_config(
        None,
        [
            'rollout.stop=["User:", "</answer>", "\\n\\n"]',
            "rollout.include_stop_str_in_output=true",
            "rollout.top_p=0.95",
            "rollout.top_k=20",
            "eval.greedy=false",
            "eval.top_p=0.9",
            'eval.stop=["</answer>"]',
        ],
    )
    assert cfg.rollout.stop == ["User:", "</answer>", "\n\n"]
    assert tomllib.loads(dump_toml(cfg))["rollout"]["stop"] == cfg.rollout.stop  # the run directory's copy reads back
    assert Sampling.rollout(cfg) == Sampling(
        temperature=1.0, top_p=0.95, top_k=20, stop=("User:", "</answer>", "\n\n"), include_stop_str=True
    )
    assert Sampling.evaluation(cfg, 1.0) == Sampling(temperature=1.0, top_p=0.9, top_k=0, stop=("</answer>",), include_stop_str=True)
    for override, field in (
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.top_k=-1", "rollout.top_k"),
        ("eval.top_p=0", "eval.top_p"),
        ("eval.top_k=-2", "eval.top_k"),
        ("rollout.stop=User:", "rollout.stop"),
        ('rollout.stop=[""]', "rollout.stop"),
        ("eval.stop=[1]", "eval.stop"),
        ("rollout.reward_timeout_s=0", "rollout.reward_timeout_s"),
        ("rollout.reward_workers=0", "rollout.reward_workers"),
    ):
        with pytest.raises(ConfigError, match=f"^{field}: "):
            load_config(None, [override])


@pytest.mark.engine
@pytest.mark.vllm
def test_a_long_prompt_generates_what_the_context_leaves(engine_setup):
    """rollout.max_tokens 12 in a 32-token context: a 27-token prompt (within data.max_prompt_tokens, over the default
    budget of 20) gets 5 tokens at most, ended as "length" there, which the hub's length check admits
    (protocol/budget.py): Open-Reasoner-Zero's 2048-token prompts in 8192 with 8000 to generate."""
    from conftest import rollout_group

    from actors.engine import Sampling
    from learner.hub.core.checks import GroupLimits, check_group
    from protocol.budget import completion_budget
    from protocol.config import load_config

    engine, _, _, loop = engine_setup
    prompt = np.resize(PROMPT, 27).astype(np.int32)
    assert completion_budget(len(prompt), 12, 32) == 5
    completions = loop.run_until_complete(engine.generate_group(prompt, 16, seed=3, sampling=Sampling(temperature=1.0)))
    lengths = [len(c.token_ids) for c in completions]
    assert max(lengths) == 5 and all(c.finish_reason == "length" for c in completions if len(c.token_ids) == 5)
    group = rollout_group(n=16, prompt_tokens=prompt)
    group.lengths = np.asarray(lengths, np.int32)
    group.completion_tokens = np.concatenate([c.token_ids for c in completions])
    group.behaviour_logprobs = np.concatenate([c.logprobs for c in completions])
    limits = GroupLimits.of(load_config(None, ["rollout.max_tokens=12", "actor.max_model_len=32", "data.max_prompt_tokens=27"]), 20)
    assert check_group(group, prompt, limits) is None
