"""Packing: one row, no padding, same logprobs and gradients as the padded path, boundaries respected."""

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import create_causal_mask

from learner.train.aggregation import Denominators
from learner.train.attention.hf import VARLEN
from learner.train.batch import Sample, make_micro_batch, token_logprobs
from learner.train.losses import make_policy_loss
from learner.train.packing import pack_samples, packing_efficiency
from protocol.config import AlgoConfig

# (total length, prompt length): different lengths, a one-token completion, a one-token prompt
SHAPES = [(9, 4), (3, 2), (15, 6), (6, 5), (11, 1)]


def tiny_qwen2(heads: int, kv_heads: int, seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=64 * heads,
        intermediate_size=128 * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # head_dim 64, as the demo model's
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def make_samples(shapes=SHAPES, seed=0, version=3) -> list[Sample]:
    """Behaviour logprobs near a random 40-token model's (about -log 40), so most ratios are unclipped and carry grads."""
    rng = np.random.default_rng(seed)
    return [
        Sample(
            tokens=rng.integers(0, 40, n).astype(np.int32),
            prompt_len=p,
            behaviour_logprobs=(-3.7 + 0.1 * rng.normal(size=n - p)).astype(np.float32),
            advantage=(-1.0) ** i * (0.5 + i),
            reward=0.0,
            version_min=version - i % 2,
            version_max=version,
        )
        for i, (n, p) in enumerate(shapes)
    ]


def loss_and_grads(model, logits, mb, total_tokens):
    logp = token_logprobs(logits, mb, temperature=0.7)
    loss = make_policy_loss(AlgoConfig())(logp, mb.behaviour_logp, mb.token_adv, Denominators(tokens=total_tokens)).loss
    model.zero_grad()
    loss.backward()
    return logp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_packed_equals_padded(heads, kv_heads):
    samples = make_samples()
    total_tokens = sum(n - p for n, p in SHAPES)
    model = tiny_qwen2(heads, kv_heads)
    padded = make_micro_batch(samples, version=3)
    ref_logp, ref_loss, ref_grads = loss_and_grads(
        model, model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits, padded, total_tokens
    )

    model.set_attn_implementation(VARLEN)
    packed = pack_samples(samples, version=3)
    assert packed.input_ids.shape == (1, sum(n for n, _ in SHAPES))
    logp, loss, grads = loss_and_grads(model, model(**packed.model_kwargs()).logits, packed, total_tokens)

    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, name  # every parameter is exercised, so the comparison means something
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_plain_causal_on_packed_row_crosses_samples():
    """Negative control: without the boundaries, later samples attend to earlier ones and their logprobs move."""
    samples = make_samples()
    model = tiny_qwen2(4, 2)
    model.set_attn_implementation(VARLEN)
    packed = pack_samples(samples, version=3)
    with torch.no_grad():
        varlen = token_logprobs(model(**packed.model_kwargs()).logits, packed, 1.0)
        # the same row and positions, attention causal over the whole row
        plain = token_logprobs(model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits, packed, 1.0)
    first = SHAPES[0][0] - SHAPES[0][1]
    torch.testing.assert_close(plain[:first], varlen[:first], rtol=0, atol=1e-5)  # sample 0 sees nothing earlier
    assert (plain[first:] - varlen[first:]).abs().max() > 0.05


def test_no_dense_mask_is_built():
    model = tiny_qwen2(4, 2)
    model.set_attn_implementation(VARLEN)
    packed = pack_samples(make_samples(), version=3)
    embeds = model.model.embed_tokens(packed.input_ids)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=packed.position_ids
    )
    assert mask is None
    model.set_attn_implementation("sdpa")  # control: stock sdpa detects the packed positions and builds [N, N]
    mask = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=packed.position_ids
    )
    assert mask is not None and mask.shape[-2:] == (packed.input_ids.shape[1],) * 2


def test_varlen_without_boundaries_keeps_right_padded_batches_exact():
    samples = make_samples()
    padded = make_micro_batch(samples, version=3)
    model = tiny_qwen2(4, 2)
    with torch.no_grad():
        ref = token_logprobs(model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits, padded, 1.0)
        model.set_attn_implementation(VARLEN)
        got = token_logprobs(model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits, padded, 1.0)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_packed_layout():
    samples = make_samples(shapes=[(4, 2), (3, 1), (5, 3)])
    packed = pack_samples(samples, version=3)
    padded = make_micro_batch(samples, version=3)
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == [0, 4, 7, 12]
    assert packed.max_seqlen == 5
    # completion tokens 2-3 of sample 0, 1-2 of sample 1, 3-4 of sample 2; each scored by the position before it
    assert packed.score_cols.tolist() == [1, 2, 4, 5, 9, 10]
    assert packed.score_rows.tolist() == [0] * 6
    assert torch.equal(packed.input_ids[0, packed.score_cols + 1], packed.targets)
    for field in ("targets", "behaviour_logp", "token_adv", "on_policy"):
        assert torch.equal(getattr(packed, field), getattr(padded, field)), field
    assert packed.on_policy.tolist() == [True, True, False, False, True, True]


def test_packing_efficiency():
    eff = packing_efficiency([10, 4, 6, 20])  # 40 useful tokens; padded to 4 x 20 = 80
    assert eff.padded == pytest.approx(0.5) and eff.packed == pytest.approx(1.0)
    eff = packing_efficiency([10, 4, 6, 20], sp_size=3)  # packed row padded to 42 for 3 ranks
    assert eff.packed == pytest.approx(40 / 42)
    assert packing_efficiency([7, 7]).padded == pytest.approx(1.0)
    with pytest.raises(ValueError, match="lengths"):
        packing_efficiency([])


def test_layout_and_attention_are_chosen_once_from_the_config():
    from learner.train.attention.hf import RING
    from learner.train.batch import MicroBatch
    from learner.train.layout import attention_implementation, micro_batch_layout
    from learner.train.packing import PackedBatch
    from protocol.config import ConfigError, load_config

    samples = make_samples()
    packed_cfg, padded_cfg = (load_config(None, [f"train.packing={v}"]).train for v in ("true", "false"))
    assert attention_implementation(packed_cfg) == VARLEN
    assert isinstance(micro_batch_layout(packed_cfg)(samples, 3), PackedBatch)
    assert attention_implementation(padded_cfg) == "sdpa"
    assert isinstance(micro_batch_layout(padded_cfg)(samples, 3), MicroBatch)
    sp_cfg = load_config(None, ["train.sequence_parallel_size=2"]).train
    assert attention_implementation(sp_cfg) == RING
    with pytest.raises(ValueError, match=r"train\.sequence_parallel_size=2 but the SP group has 0 ranks"):
        micro_batch_layout(sp_cfg, None)
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel_size: 2 needs train\.packing"):
        load_config(None, ["train.sequence_parallel_size=2", "train.packing=false"])
