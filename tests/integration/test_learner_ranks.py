"""The multi-rank learner: ZeRO-3 on 2 processes trains exactly like 1 process on the same data.

Runs tests/drivers/train_steps.py under torchrun: rank 0 cuts each rollout batch into shares
and scatters them, every rank trains its share, DeepSpeed averages gradients. Losses, gradient
norms (which catch a wrong loss scale that Adam would hide) and the final weights must match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import torchrun_driver

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "train.total_steps=3",
    "train.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.micro_batch_samples=4",
    "train.mini_batches=2",
    "staleness.max_staleness=1",
    "train.lr=1e-3",
]


def run_ranks(model_dir: str, nproc: int, tmp_path: Path, *overrides: str) -> dict:
    out = tmp_path / f"out-{nproc}.json"
    ranks = f"cluster.learner_gpus_per_node={nproc}"
    return torchrun_driver("train_steps.py", nproc, out, model_dir, str(out), *SETTINGS, *overrides, ranks)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory):
    return run_ranks(str(tiny_model_dir), 1, tmp_path_factory.mktemp("one"), "train.zero_stage=3")


def test_zero3_two_ranks_match_one(one_rank, tiny_model_dir, tmp_path):
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, "train.zero_stage=3")
    assert two["world"] == 2 and one_rank["world"] == 1
    assert two["version"] == one_rank["version"] == 6  # 3 updates x 2 mini-batches: versions count optimizer steps
    assert two["samples"] == one_rank["samples"] == 16
    assert two["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-4)
    assert two["weight_abs"] == pytest.approx(one_rank["weight_abs"], rel=1e-6)
    assert one_rank["losses"][0] != pytest.approx(one_rank["losses"][-1], rel=1e-3), "the weights must change for this to prove anything"


def test_zero2_two_ranks_match_zero3_one(one_rank, tiny_model_dir, tmp_path):
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, "train.zero_stage=2")
    assert two["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-4)


def test_ppo_critic_kl_entropy_decoupled_two_ranks_match_one(tiny_model_dir, tmp_path):
    """Every algorithm unit on the multi-rank path: GAE with a critic (its own DeepSpeed engine), KL to the
    reference, the entropy bonus, decoupled correction with proximal logprobs from a pre-pass."""
    algo = (
        "algo.advantage=gae",
        "algo.kl_coef=0.05",
        "algo.entropy_coef=0.01",
        "algo.correction=decoupled",
        "algo.old_logprobs=recompute",
        "algo.critic_lr=1e-3",
        "train.zero_stage=2",
    )
    one = run_ranks(str(tiny_model_dir), 1, tmp_path, *algo)
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, *algo)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    for a, b in zip(one["extras"], two["extras"], strict=True):
        assert {"loss/kl", "loss/entropy", "loss/iw_mean", "loss/value", "loss/value_clip_frac"} <= set(a)
        assert b == pytest.approx(a, rel=1e-4, abs=1e-7)
    assert all(e["loss/value"] > 0 for e in one["extras"])  # the critic trains (tests/unit/test_critic.py shows it learns)
    kls = [e["loss/kl"] for e in one["extras"]]
    assert 0 <= kls[0] < kls[-1], f"the policy starts at the reference and drifts from it: {kls}"


def test_sequence_parallel_two_ranks_match_one(one_rank, tiny_model_dir, tmp_path):
    """SP = 2: both ranks get the same share, each trains its chunk of every packed row with ring attention;
    DeepSpeed sums their gradients (its sequence-parallel mpu). Same numbers as one rank with the whole row."""
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, "train.zero_stage=3", "train.sequence_parallel_size=2")
    assert two["samples"] == one_rank["samples"]
    assert two["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-4)
    assert two["weight_abs"] == pytest.approx(one_rank["weight_abs"], rel=1e-6)


def test_packed_equals_padded_in_the_trainer(one_rank, tiny_model_dir, tmp_path):
    """The default packs each micro-batch into one row; padded rows must train identically, less efficiently."""
    padded = run_ranks(str(tiny_model_dir), 1, tmp_path, "train.zero_stage=3", "train.packing=false")
    assert padded["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-6)
    assert padded["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-4)
    assert all(e["packing_efficiency"] == 1.0 for e in one_rank["extras"])
    assert all(0.3 < e["packing_efficiency"] < 0.95 for e in padded["extras"]), padded["extras"]
    # The packed run reports what padding would have cost on the same micro-batches: the padded run's figure.
    assert [e["padded_efficiency"] for e in one_rank["extras"]] == pytest.approx([e["packing_efficiency"] for e in padded["extras"]])


BUDGET = ("train.max_tokens_per_micro_batch=12", "actor.max_model_len=10", "train.logprob_chunk_tokens=3")


@pytest.mark.parametrize("stage", [3, 2])
def test_token_budget_two_ranks_match_one(one_rank, tiny_model_dir, tmp_path, stage):
    """Micro-batches packed up to 12 tokens (samples of 5-8): each rank gets a different number of samples per
    micro-batch, the ranks the same number of micro-batches, and the loss stays the mini-batch's token mean, so
    the numbers are those of one rank with 4-sample micro-batches. Logprobs come 3 tokens at a time."""
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, f"train.zero_stage={stage}", *BUDGET)
    sizes = [mini for update in two["micro_sizes"] for mini in update]
    assert all(sum(mini) == 4 for mini in sizes)  # 16 samples / 2 mini-batches / 2 ranks
    assert any(len(mini) > 1 for mini in sizes) and len({tuple(m) for m in sizes}) > 1, sizes  # real, varying cuts
    assert two["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-4)
    assert two["weight_abs"] == pytest.approx(one_rank["weight_abs"], rel=1e-6)


def test_gradient_checkpointing_trains_identically(one_rank, tiny_model_dir, tmp_path):
    """Recomputing each decoder layer in backward changes memory, not numbers (packed attention kwargs reach the
    recomputed layers); under ZeRO-3 with the token budget, on 2 ranks."""
    ckpt = run_ranks(str(tiny_model_dir), 2, tmp_path, "train.zero_stage=3", "train.gradient_checkpointing=true", *BUDGET)
    assert ckpt["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-6)
    assert ckpt["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-4)
    assert ckpt["weight_abs"] == pytest.approx(one_rank["weight_abs"], rel=1e-6)


def test_tied_embeddings_zero3_two_ranks_match_one(tmp_path):
    """Qwen2.5-0.5B and 1.5B tie the lm_head to the input embeddings: under ZeRO-3 the scoring head's weight is the
    embedding's partitioned Parameter, gathered for the head and for the embedding, its gradient from both summed."""
    from deploy.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(len(tok), seed=0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model_dir = tmp_path / "tied"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # the driver loads it tied
    one = run_ranks(str(model_dir), 1, tmp_path, "train.zero_stage=3", *BUDGET)
    two = run_ranks(str(model_dir), 2, tmp_path, "train.zero_stage=3", *BUDGET)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert two["weight_abs"] == pytest.approx(one["weight_abs"], rel=1e-6)
    assert one["losses"][0] != pytest.approx(one["losses"][-1], rel=1e-3)


def test_advantage_normalize_whitens_over_all_ranks(tiny_model_dir, tmp_path):
    """algo.advantage_normalize (Open-Reasoner-Zero's setting): GAE advantages whitened over the whole rollout batch,
    so 2 ranks, each with half of the tokens, train exactly as 1 rank; and differently from unwhitened advantages."""
    algo = ("algo.advantage=gae", "algo.critic_lr=1e-3", "train.zero_stage=2")
    one = run_ranks(str(tiny_model_dir), 1, tmp_path, *algo, "algo.advantage_normalize=true")
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, *algo, "algo.advantage_normalize=true")
    plain = run_ranks(str(tiny_model_dir), 1, tmp_path, *algo)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert one["grad_norms"][0] != pytest.approx(plain["grad_norms"][0], rel=1e-2)


@pytest.mark.parametrize(
    "algo",
    [
        ("algo.loss_agg=constant",),
        ("algo.loss_agg=seq_mean_token_mean", "algo.ratio=sequence", "algo.old_logprobs=recompute", "algo.seq_mask_bound=0.6"),
    ],
    ids=["dr_grpo_constant", "gspo_seq_mask"],
)
def test_split_free_loss_agg_two_ranks_match_one(tiny_model_dir, tmp_path, algo):
    """Dr. GRPO's constant denominator, and GSPO (sequence ratio, per-sample mean) with off-policy sequence masking:
    the loss divides by the mini-batch's samples over all ranks (rank 0 puts the count in each share), so 2 ranks
    with token-budget micro-batches of varying size train exactly as 1 rank with 4-sample micro-batches."""
    one = run_ranks(str(tiny_model_dir), 1, tmp_path, "train.zero_stage=2", *algo)
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, "train.zero_stage=2", *algo, *BUDGET)
    assert len({tuple(m) for update in two["micro_sizes"] for m in update}) > 1, two["micro_sizes"]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert two["weight_abs"] == pytest.approx(one["weight_abs"], rel=1e-6)
    if "algo.seq_mask_bound=0.6" in algo:
        masked = [e["loss/seq_masked_frac"] for e in one["extras"]]
        assert [e["loss/seq_masked_frac"] for e in two["extras"]] == pytest.approx(masked)


def test_micro_batch_token_mean_two_ranks_match_one_on_the_same_micro_batches(one_rank, tiny_model_dir, tmp_path):
    """ORZ's and SimpleRL's mean over micro-batches depends on the cut by definition; with the same micro-batches
    (4 consecutive samples each, on one rank or spread over two) it trains the same, and differently from the token
    mean of the same data (the micro-batches hold different token counts)."""
    agg = ("train.zero_stage=3", "algo.loss_agg=micro_batch_token_mean")
    one = run_ranks(str(tiny_model_dir), 1, tmp_path, *agg)
    two = run_ranks(str(tiny_model_dir), 2, tmp_path, *agg)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert one["grad_norms"][0] != pytest.approx(one_rank["grad_norms"][0], rel=1e-3)
