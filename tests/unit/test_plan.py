"""`learner/plan/` and `fleetrl plan`: every shipped recipe plans, the reference setups' numbers hold, and bad
batch arithmetic is rejected at start with the arithmetic in the message."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from learner.plan import make_plan, render
from protocol.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(CONFIGS.glob("*.toml"))


def plan_of(name: str, *overrides: str):
    return make_plan(load_config(CONFIGS / name, list(overrides)))


def default(*overrides: str):
    """The built-in config with 8 samples per prompt (128-sample batches) in micro-batches of 8, so that they split over many ranks."""
    return load_config(None, ["rollout.samples_per_prompt=8", "train.micro_batch_samples=8", *overrides])


def test_recipes_are_globbed():
    names = {p.name for p in RECIPES}
    assert "demo.toml" in names and len(names) >= 7, names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_plans(path):
    cfg = load_config(path)
    p = make_plan(cfg)
    # The arithmetic closes: nothing is dropped or duplicated between the levels of the batch.
    assert p.batch.rollout_batch == cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
    assert p.batch.mini_batch * p.batch.mini_batches == p.batch.rollout_batch
    assert p.batch.samples_per_rank * p.placement.data_parallel == p.batch.mini_batch
    assert p.batch.accumulation * p.batch.micro_batch == p.batch.samples_per_rank
    assert p.placement.data_parallel * p.placement.sequence_parallel == p.placement.learner_ranks
    assert p.batch.steps_per_update == cfg.train.mini_batches * cfg.train.ppo_epochs
    assert p.batch.max_staleness >= p.batch.steps_per_update - 1
    assert p.length.optimizer_steps == p.length.updates * p.batch.steps_per_update
    text = render(p)
    for section in ("Placement", "Batch arithmetic", "Run length", "Memory per learner GPU"):
        assert section in text
    # A GPU recipe keeps its engines' batches full: 8 prompts x 1 sample would leave a GPU engine nearly idle.
    assert p.placement.engine_sequences == cfg.actor.max_groups * cfg.rollout.samples_per_prompt
    if not path.stem.startswith("demo"):  # the demos run on CPU actors
        assert p.placement.engine_sequences >= cfg.actor.max_num_seqs and "part idle" not in text, (path.stem, p.placement.engine_sequences)
        assert p.actor_memory is None or p.actor_memory.fits, path.stem


def test_plan_says_when_an_engine_would_run_part_idle():
    text = render(make_plan(default("actor.max_groups=2", "actor.max_num_seqs=256")))
    (row,) = [line for line in text.splitlines() if "sequences per engine" in line]
    assert row.split()[3] == "16" and "a GPU engine would run part idle: actor.max_groups = 32 fills it" in row


ORZ_RECIPES = ["orz_0p5b_ppo.toml", "orz_1p5b_ppo.toml", "orz_7b_ppo.toml", "orz_32b_ppo.toml"]


@pytest.mark.parametrize("name", ORZ_RECIPES)
def test_orz_recipes(name):
    """Open-Reasoner-Zero's playground configs (every size the same here): 8000 generated in an 8192 context with
    2048-token prompts truncated, Adam betas (0.9, 0.95), the old logprobs recomputed, 20 episodes of ceil(N/128)
    batches, every checkpoint kept."""
    cfg = load_config(CONFIGS / name)
    assert (cfg.rollout.max_tokens, cfg.actor.max_model_len, cfg.data.max_prompt_tokens, cfg.data.long_prompts) == (
        8000,
        8192,
        2048,
        "truncate",
    )
    t, a = cfg.train, cfg.algo
    assert (t.adam_betas, t.adam_eps, t.weight_decay, t.lr_schedule, t.warmup_steps) == ([0.9, 0.95], 1e-8, 0.0, "constant", 50)
    assert (a.advantage, a.gamma, a.lam, a.kl_coef, cfg.rollout.temperature) == ("gae", 1.0, 1.0, 0.0, 1.0)
    assert (a.old_logprobs, a.correction, a.loss_agg) == ("recompute", "none", "micro_batch_token_mean")
    assert (cfg.checkpoint.every_steps, cfg.checkpoint.keep_every) == (50, 50)
    p = make_plan(cfg)
    assert (p.batch.prompts_per_update, p.batch.samples_per_prompt, p.batch.rollout_batch, p.batch.steps_per_update) == (128, 64, 8192, 1)
    assert p.batch.max_tokens == 8000 and "8,000" in render(p)
    assert p.length.updates == 20 * p.length.batches_kept  # num_episodes 20, ORZ's partial last batch trained
    assert p.length.max_epochs * cfg.data.num_prompts >= p.length.updates * 128  # the ledger does not run dry


def test_orz_32b_is_32_gpus_colocated_with_critic_and_reference():
    p = plan_of("orz_32b_ppo.toml")
    assert p.placement.learner_ranks == 32 and p.placement.learner_gpus == 32 and p.placement.colocate
    assert p.placement.models == ["policy", "critic", "reference"]
    assert (p.placement.actor_engines, p.placement.tensor_parallel) == (16, 4)
    assert len(p.learner_memory.models) == 3 and p.learner_memory.gpu_bytes == pytest.approx(sum(m.total for m in p.learner_memory.models))
    assert "policy, critic, reference: colocated on the same 32 GPUs" in render(p)


def test_simplerl_zoo_epochs():
    p = plan_of("simplerl_zoo_qwen2.5_7b.toml")
    assert (p.batch.prompts_per_update, p.batch.samples_per_prompt, p.length.num_prompts) == (1024, 8, 8532)
    assert round(p.length.updates_per_epoch, 2) == 8.33
    assert p.length.updates == 100
    assert p.length.epochs == pytest.approx(12.0, abs=0.01)
    assert p.length.samples_per_prompt == pytest.approx(96.0, abs=0.1)
    # 1024 prompts / 256 per mini-batch: 4 optimizer steps, so fresh samples need k >= 3.
    assert (p.batch.steps_per_update, p.batch.min_staleness) == (4, 3) and p.batch.max_staleness >= 3
    text = render(p)
    assert "8.33" in text and "12.00" in text and "96.0" in text
    with pytest.raises(ConfigError, match=r"staleness\.max_staleness: 2 < S - 1 = 3"):
        plan_of("simplerl_zoo_qwen2.5_7b.toml", "staleness.max_staleness=2")


def test_run_length_counts_the_sources_per_epoch_batches():
    """FleetRL's epochs run back to back (no partial batch); the sources' dataloaders end each epoch with a batch of
    N mod B prompts, which ORZ trains (ceil) and verl and open-instruct drop (floor). The plan counts both."""
    orz = plan_of("orz_0p5b_ppo.toml").length  # 57,000 prompts in batches of 128
    assert (orz.last_batch, orz.batches_kept, orz.batches_dropped) == (40, 446, 445)
    assert orz.updates_per_epoch == pytest.approx(445.3125)  # FleetRL's own count is unchanged
    text = render(plan_of("orz_0p5b_ppo.toml"))
    assert "446 | 445" in text and "the last of 40 prompts trained (ORZ) | dropped (verl, open-instruct)" in text
    assert "as the sources count: 20.00 (ORZ) | 20.04 (verl, open-instruct)" in text  # 8,920 / 446, 8,920 / 445
    simplerl = plan_of("simplerl_zoo_qwen2.5_7b.toml").length  # 8,532 / 1,024: verl's 8 batches per epoch
    assert (simplerl.last_batch, simplerl.batches_kept, simplerl.batches_dropped) == (340, 9, 8)
    whole = make_plan(default("train.prompts_per_step=20"))  # addition's 100 prompts: 5 whole batches
    assert (whole.length.last_batch, whole.length.batches_kept, whole.length.batches_dropped) == (0, 5, 5)
    assert "batches per epoch, none partial" in render(whole)
    short = render(make_plan(default("data.epochs=10")))  # 100 updates x 16 prompts = 16 passes over 100 prompts
    assert "more than data.epochs = 10: the prompts run out first" in short
    assert "data.epochs" not in render(make_plan(default()))


def test_plan_shows_the_learning_rate():
    (row,) = [line for line in render(make_plan(default())).splitlines() if "learning rate" in line]
    assert "0.0005" in row and "warmup over 10 optimizer steps from 5e-05, then constant" in row
    cfg = default("train.lr_schedule=cosine", "train.min_lr_ratio=0.1", "train.warmup_steps=0")
    (row,) = [line for line in render(make_plan(cfg)).splitlines() if "learning rate" in line]
    assert row.endswith("peak (train.lr); cosine decay to 5e-05 after step 100")


def test_open_instruct_tulu3_8b():
    p = plan_of("open_instruct_tulu3_8b_rlvr.toml")
    assert p.placement.learner_ranks == 7 and p.placement.actor_engines == 1  # 8 GPUs: 7 learning, 1 generating
    assert p.placement.learner_gpus + p.placement.actor_engines * p.placement.tensor_parallel == 8
    assert p.batch.samples_per_rank == 32 and p.batch.mini_batch == 224  # local mini-batch 32, global 224


BAD = [
    # (overrides on the default config, field named, arithmetic shown)
    (
        ["train.mini_batches=3"],
        "train.mini_batches",
        "16 prompts x 8 samples = 128 samples per rollout batch / 3 mini-batches is not whole",
    ),
    (
        ["train.micro_batch_samples=48"],
        "train.micro_batch_samples",
        "128 samples per mini-batch / 1 data-parallel ranks = 128 per rank is not a multiple of train.micro_batch_samples 48",
    ),
    (
        ["cluster.learner_gpus_per_node=256"],
        "cluster.learner_gpus_per_node",
        "256 data-parallel ranks (256 learner ranks (cluster.learner_nodes 1 x cluster.learner_gpus_per_node 256) / "
        "sequence_parallel_size 1) exceed the 128 samples of a mini-batch",
    ),
    (["cluster.learner_gpus_per_node=3"], "cluster.learner_gpus_per_node", "128 samples per mini-batch / 3 data-parallel ranks"),
    (
        ["cluster.learner_gpus_per_node=4", "train.sequence_parallel_size=3"],
        "train.sequence_parallel_size",
        "sequence_parallel_size 3 does not divide 4 learner ranks",
    ),
    (
        ["train.mini_batches=4", "staleness.max_staleness=2"],
        "staleness.max_staleness",
        "2 < S - 1 = 3: a rollout batch is trained in S = 4 optimizer steps (train.mini_batches 4 x train.ppo_epochs 1)",
    ),
    (
        ["train.ppo_epochs=3", "staleness.max_staleness=1"],
        "staleness.max_staleness",
        "1 < S - 1 = 2: a rollout batch is trained in S = 3 optimizer steps (train.mini_batches 1 x train.ppo_epochs 3)",
    ),
    (
        ["train.total_episodes=1000"],
        "train.total_episodes",
        "1000 samples / (16 prompts x 8 samples = 128 samples per rollout batch) = 7.81 rollout batches is not whole",
    ),
    (
        ["cluster.learner_gpus_per_node=4", "train.sequence_parallel_size=2", "cluster.debug_gpus=3"],
        "cluster.debug_gpus",
        "sequence_parallel_size 2 does not divide cluster.debug_gpus = 3 learner ranks",
    ),
    (
        ["cluster.learner_gpus_per_node=4", "cluster.debug_gpus=3"],
        "cluster.debug_gpus",
        "128 samples per mini-batch / 3 data-parallel ranks (cluster.debug_gpus = 3 learner ranks",
    ),
    (
        ["cluster.learner_gpus_per_node=4", "train.micro_batch_samples=32", "cluster.debug_gpus=8"],
        "cluster.debug_gpus",
        "128 samples per mini-batch / 8 data-parallel ranks = 16 per rank is not a multiple of train.micro_batch_samples 32",
    ),
    (
        ["cluster.actor_gpus_per_node=6", "cluster.tensor_parallel_size=4"],
        "cluster.tensor_parallel_size",
        "6 actor GPUs / tensor_parallel_size 4 is not whole",
    ),
    (
        ["cluster.actor_nodes=2", "cluster.actor_gpus_per_node=2", "cluster.tensor_parallel_size=4", "cluster.debug_gpus=1"],
        "cluster.debug_gpus",
        "cluster.actor_gpus_per_node 2 / tensor_parallel_size 4 makes no whole engine",
    ),
]


@pytest.mark.parametrize("overrides, field, arithmetic", BAD, ids=[b[1] + ":" + b[0][-1] for b in BAD])
def test_bad_arithmetic_is_rejected_with_the_numbers(overrides, field, arithmetic):
    cfg = default(*overrides)  # the config itself is valid: only the plan's arithmetic fails
    with pytest.raises(ConfigError) as e:
        make_plan(cfg)
    assert str(e.value).startswith(f"{field}: ")
    assert arithmetic in str(e.value)


@pytest.mark.parametrize(
    "good",
    [
        ["train.mini_batches=4"],
        ["train.micro_batch_samples=32"],
        ["cluster.learner_gpus_per_node=128", "train.micro_batch_samples=1"],
        ["cluster.learner_gpus_per_node=4", "train.sequence_parallel_size=2"],
        ["train.total_episodes=1280"],
        ["cluster.learner_gpus_per_node=4", "cluster.debug_gpus=2"],
        ["cluster.actor_gpus_per_node=8", "cluster.tensor_parallel_size=4"],
    ],
)
def test_neighbours_of_the_bad_cases_pass(good):
    """Controls: one step away from each rejected case, the plan is accepted."""
    make_plan(default(*good, "staleness.max_staleness=3"))


@pytest.mark.parametrize("mini_batches, ppo_epochs", [(1, 1), (2, 1), (1, 4), (4, 2), (8, 1)])
def test_staleness_bound_is_tight(mini_batches, ppo_epochs):
    steps = mini_batches * ppo_epochs
    base = [f"train.mini_batches={mini_batches}", f"train.ppo_epochs={ppo_epochs}", "train.micro_batch_samples=8"]
    p = make_plan(load_config(None, base + [f"staleness.max_staleness={steps - 1}"]))
    assert (p.batch.steps_per_update, p.batch.min_staleness) == (steps, steps - 1)
    if steps > 1:
        with pytest.raises(ConfigError, match=rf"staleness\.max_staleness: {steps - 2} < S - 1 = {steps - 1}"):
            make_plan(load_config(None, base + [f"staleness.max_staleness={steps - 2}"]))


def test_debug_placement_keeps_the_global_batch():
    recipe = plan_of("orz_7b_ppo.toml")
    debug = plan_of("orz_7b_ppo.toml", "cluster.debug_gpus=8")
    assert debug.placement.debug and not recipe.placement.debug
    assert (debug.placement.learner_ranks, debug.placement.data_parallel, debug.placement.recipe_data_parallel) == (8, 8, 32)
    assert (recipe.batch.accumulation, debug.batch.accumulation, debug.batch.recipe_accumulation) == (256, 1024, 256)
    assert (debug.placement.actor_nodes, debug.placement.actor_engines, debug.placement.recipe_actor_engines) == (1, 8, 32)
    # Everything about the algorithm is identical: batch sizes, steps, staleness, run length.
    placement = {"debug", "learner_ranks", "data_parallel", "learner_gpus", "actor_nodes", "actor_engines"}
    moved = {
        "placement": placement,
        "batch": {"samples_per_rank", "accumulation"},
        "length": set(),
        "learner_memory": {"models", "gpu_bytes"},
        "actor_memory": set(),
    }
    for part, fields in moved.items():
        ours, theirs = getattr(debug, part), getattr(recipe, part)
        for f in dataclasses.fields(ours):
            if f.name not in fields:
                assert getattr(ours, f.name) == getattr(theirs, f.name), f"{part}.{f.name}"
    assert debug.batch.samples_per_rank * debug.placement.data_parallel == recipe.batch.samples_per_rank * recipe.placement.data_parallel
    # Fewer ranks share the ZeRO-3 state: 4x the bytes per GPU.
    assert debug.learner_memory.gpu_bytes == pytest.approx(4 * recipe.learner_memory.gpu_bytes)
    assert "debug placement (recipe: 32 = 4 node(s) x 8 GPUs)" in render(debug)


@pytest.mark.parametrize(
    "dtype, stage, params, grads, adam",
    [
        ("bfloat16", 0, 2e6, 4e6, 12e6),  # nothing sharded; fp32 gradient sums; Adam = fp32 m + v + master copy
        ("bfloat16", 1, 2e6, 4e6, 3e6),
        ("bfloat16", 2, 2e6, 1e6, 3e6),
        ("bfloat16", 3, 0.5e6, 1e6, 3e6),
        ("float32", 0, 4e6, 4e6, 8e6),  # fp32 training: no master copy
        ("float32", 3, 1e6, 1e6, 2e6),
    ],
)
def test_memory_per_gpu(dtype, stage, params, grads, adam):
    over = [
        "model.num_params=1000000",
        f"model.dtype={dtype}",
        f"train.zero_stage={stage}",
        "cluster.learner_gpus_per_node=4",
        "algo.advantage=gae",
        "algo.kl_coef=0.1",
    ]
    p = make_plan(default(*over))
    policy, critic, ref = p.learner_memory.models
    assert (policy.name, critic.name, ref.name) == ("policy", "critic", "reference")
    assert (policy.params, policy.grads, policy.optimizer) == (params, grads, adam)
    assert critic.total == policy.total
    # The reference: weights only, sharded only under ZeRO-3.
    assert (ref.params, ref.grads, ref.optimizer) == (1e6 * (2 if dtype == "bfloat16" else 4) / (4 if stage == 3 else 1), 0, 0)
    assert p.placement.colocate and p.placement.learner_gpus == 4 and p.learner_memory.gpu_bytes == 2 * policy.total + ref.params
    # Not colocated: each model on its own 4 GPUs; the busiest GPU holds the largest model.
    apart = make_plan(default(*over, "cluster.colocate=false"))
    assert apart.placement.learner_gpus == 12 and apart.learner_memory.gpu_bytes == policy.total


def test_models_follow_the_algorithm():
    assert plan_of("demo.toml").placement.models == ["policy"]
    assert make_plan(load_config(None, ["algo.kl_coef=0.01"])).placement.models == ["policy", "reference"]
    assert make_plan(load_config(None, ["algo.keep_reference=true"])).placement.models == ["policy", "reference"]
    assert make_plan(load_config(None, ["algo.advantage=gae"])).placement.models == ["policy", "critic"]


def test_param_count_from_the_model_folder(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from deploy.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny")
    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).parameters())
    p = make_plan(default(f"model.path={path}", "cluster.learner_gpus_per_node=2", "train.zero_stage=3"))
    assert p.learner_memory.num_params == real and p.learner_memory.params_source.endswith("config.json")
    assert p.learner_memory.models[0].params == real * 4 / 2  # float32, ZeRO-3 over 2 ranks
    explicit = make_plan(load_config(None, [f"model.path={path}", "model.num_params=123"]))
    assert (explicit.learner_memory.num_params, explicit.learner_memory.params_source) == (123, "model.num_params")
    unknown = make_plan(load_config(None, [f"model.path={tmp_path / 'absent'}"]))
    assert unknown.learner_memory.num_params is None and unknown.learner_memory.models == [] and "unknown" in render(unknown)


def test_prompt_count(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows[:5]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[5:]) + "\n")
    base = ["data.task=file", f"data.path={jsonl}", "train.prompts_per_step=4"]
    p = make_plan(default(*base))
    assert (p.length.num_prompts, p.length.updates_per_epoch) == (10, 2.5)
    held = make_plan(default(*base, "data.val_fraction=0.2"))
    assert held.length.num_prompts == 8 and "minus 2 held out" in held.length.prompts_source
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows + rows[:2]), parquet)
    assert make_plan(load_config(None, ["data.task=file", f"data.path={parquet}"])).length.num_prompts == 12
    # Not at hand: data.num_prompts, else unknown; the caller's count wins over both.
    absent = ["data.task=file", f"data.path={tmp_path / 'absent.jsonl'}"]
    assert make_plan(load_config(None, absent + ["data.num_prompts=640"])).length.epochs == pytest.approx(100 * 16 / 640)
    assert make_plan(load_config(None, absent)).length.epochs is None
    assert make_plan(load_config(None, absent), num_prompts=50).length.num_prompts == 50


def test_samples_per_prompt_1_only_with_a_critic():
    assert make_plan(default("rollout.samples_per_prompt=1", "algo.advantage=gae")).batch.rollout_batch == 16
    with pytest.raises(ConfigError, match=r"rollout\.samples_per_prompt: algo\.advantage = grpo needs >= 2"):
        load_config(None, ["rollout.samples_per_prompt=1"])


def test_cli_plan(capsys):
    from deploy.cli import main

    assert main(["plan", str(CONFIGS / "orz_32b_ppo.toml")]) == 0
    out = capsys.readouterr().out
    assert "policy, critic, reference: colocated on the same 32 GPUs" in out
    assert re.search(r"generated tokens\s+8,000", out) and re.search(r"learner ranks\s+32", out)
    assert re.search(r"per GPU\s+\d+\.\d GiB", out)
    assert main(["plan", str(CONFIGS / "orz_32b_ppo.toml"), "cluster.debug_gpus=8"]) == 0
    assert re.search(r"data parallel\s+8\s+8 ranks / SP 1 \(recipe: 32\)", capsys.readouterr().out)
    assert main(["plan", str(CONFIGS / "demo.toml"), "train.mini_batches=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetrl: config error: train.mini_batches: 16 prompts x 16 samples = 256")


@pytest.mark.parametrize("path", [p for p in RECIPES if not p.stem.startswith("demo")], ids=lambda p: p.stem)
def test_gpu_recipes_checkpoint_budget_and_fit_80gb(path):
    """Every GPU recipe trains with gradient checkpointing and a token budget that holds its longest sample (or
    micro-batches counted in samples, as SimpleRL-Zoo's and Tulu 3's sources count them), and its model states plus
    one micro-batch's activations fit an 80 GB GPU (the ORZ recipes at 8k-16k tokens)."""
    cfg = load_config(path)
    budget = cfg.train.max_tokens_per_micro_batch  # 0: micro-batches of train.micro_batch_samples, each up to max_model_len
    assert cfg.train.gradient_checkpointing and (budget >= cfg.actor.max_model_len or budget == 0)
    p = make_plan(cfg)
    tokens = budget or cfg.train.micro_batch_samples * cfg.actor.max_model_len
    assert p.learner_memory.activations is not None and p.learner_memory.activations.tokens == tokens
    assert p.learner_memory.fits, render(p)
    assert re.search(r"per GPU\s+\d+\.\d GiB\s+fits", render(p))


def test_activations_follow_the_budget_and_checkpointing():
    ckpt = plan_of("orz_0p5b_ppo.toml")
    full = plan_of("orz_0p5b_ppo.toml", "train.gradient_checkpointing=false")
    double = plan_of("orz_0p5b_ppo.toml", "train.max_tokens_per_micro_batch=20096")  # 2 x packing_max_len 10,048
    assert (
        ckpt.learner_memory.activations.layers * 5 < full.learner_memory.activations.layers
    )  # 24 layers' activations vs inputs + one layer
    assert double.learner_memory.activations.layers == pytest.approx(2 * ckpt.learner_memory.activations.layers)
    # Without checkpointing 64k tokens of 8k samples on one GPU run out of 80 GB, as the first H100 run found.
    oom = plan_of("orz_0p5b_ppo.toml", "train.gradient_checkpointing=false", "train.max_tokens_per_micro_batch=65536")
    assert oom.learner_memory.fits is False and "DOES NOT FIT" in render(oom)
    small = plan_of("orz_0p5b_ppo.toml", "cluster.gpu_memory_gib=8")
    assert small.learner_memory.fits is False


def test_budget_must_hold_the_longest_sample():
    with pytest.raises(
        ConfigError,
        match=r"train\.max_tokens_per_micro_batch: 8000 x sequence_parallel_size 1 < "
        r"actor\.max_model_len 8192.*at least 8192",
    ):
        plan_of("orz_0p5b_ppo.toml", "train.max_tokens_per_micro_batch=8000")
    # with SP the budget is per GPU: 2 ranks x 8000 hold it
    ok = plan_of("orz_0p5b_ppo.toml", "train.max_tokens_per_micro_batch=8000", "train.sequence_parallel_size=2")
    assert ok.batch.token_budget == 8000 and "8,000 tokens" in render(ok)


def test_arch_file_counts_parameters():
    cfg = load_config(CONFIGS / "orz_1p5b_ppo.toml", ["model.num_params=0"])
    p = make_plan(cfg)
    assert p.learner_memory.num_params == 1_543_714_304 and p.learner_memory.params_source.endswith("qwen2.5-1.5b.json")
    unknown = make_plan(load_config(CONFIGS / "orz_1p5b_ppo.toml", ["model.arch="]))
    assert unknown.learner_memory.activations is None and "activations" in render(unknown) and unknown.learner_memory.fits is None


def test_zero3_snapshot_counts_on_rank_0_unless_kept_on_the_host():
    """Rank 0 serves the actors from a full copy of the weights under ZeRO-3: 61 GiB for 32B in bf16, which does not
    fit beside training, so that recipe keeps it in host memory."""
    device = plan_of("orz_32b_ppo.toml", "weights.snapshot=device")
    host = plan_of("orz_32b_ppo.toml")
    assert device.learner_memory.snapshot_bytes == 32_763_876_352 * 2 and device.learner_memory.fits is False
    assert host.learner_memory.snapshot_bytes == 0 and host.learner_memory.fits
    assert "weight snapshot" in render(device) and "weight snapshot" not in render(host)
    assert plan_of("orz_7b_ppo.toml").learner_memory.snapshot_bytes == 7_615_616_512 * 2
    assert plan_of("orz_7b_ppo.toml", "train.zero_stage=2").learner_memory.snapshot_bytes == 0  # ZeRO-2 serves from the parameters


def test_an_engine_gpu_keeps_room_outside_vllm_for_the_weight_buffers():
    """A sync allocates the landing buffer (the largest weight: 32B's embedding, 152,064 x 5,120 bf16) and NCCL's
    buffers after vLLM took actor.gpu_memory_utilization of the GPU."""
    p = plan_of("orz_32b_ppo.toml")
    assert p.actor_memory.landing_bytes == 152_064 * 5_120 * 2 and p.actor_memory.fits
    assert "outside vLLM" in render(p) and "fits (landing buffer + NCCL)" in render(p)
    tight = plan_of("orz_32b_ppo.toml", "actor.gpu_memory_utilization=0.99")
    assert tight.actor_memory.fits is False and "DOES NOT FIT: lower actor.gpu_memory_utilization" in render(tight)
    assert plan_of("orz_0p5b_ppo.toml", "weights.bucket_mb=2048").actor_memory.landing_bytes == 2048 << 20  # a bucket above every weight
    unknown = make_plan(default("model.path=/nonexistent"))
    assert unknown.actor_memory is None and "outside vLLM" not in render(unknown)
    on_cpu = plan_of("orz_0p5b_ppo.toml", "actor.device=cpu")
    assert on_cpu.actor_memory is None and "Memory per actor GPU" not in render(on_cpu)


ORZ_STOPS = ["User:", "Human:", "Assistant:", "</answer>"]


@pytest.mark.parametrize("name", ["orz_0p5b_ppo.toml", "orz_1p5b_ppo.toml", "orz_7b_ppo.toml", "orz_32b_ppo.toml"])
def test_orz_recipes_use_orz_stops_reward_data_and_normalisation(name):
    """Open-Reasoner-Zero's config.py and playground scripts: these stops kept in the text (its answer pattern needs
    the closing </answer>), 1 only for a stopped right answer, advantages whitened, eval sampled with the same stops."""
    cfg = load_config(CONFIGS / name)
    r = cfg.rollout
    assert (r.stop, r.include_stop_str_in_output, r.top_p, r.top_k, r.reward_fn) == (ORZ_STOPS, True, 1.0, 0, "actors.rewards:orz")
    assert (cfg.data.format, cfg.data.path) == ("orz", "data/orz_math_57k_collected.json")
    assert cfg.algo.advantage_normalize and (cfg.eval.greedy, cfg.eval.stop, cfg.eval.top_p) == (False, ORZ_STOPS, 1.0)


def test_simplerl_and_open_instruct_recipes_follow_their_sources():
    """SimpleRL-Zoo on verl: AdamW's weight decay 0.01, GRPO's unbiased std, a constant LR from the first step, the
    old logprobs recomputed, k3 clamped at 10, 2-sample micro-batches, its grader. Tulu 3 on open-instruct: the KL
    penalty in the reward, weight decay 0.01, linear decay, the old logprobs recomputed, IFEval as run."""
    s = load_config(CONFIGS / "simplerl_zoo_qwen2.5_7b.toml")
    assert (s.data.format, s.rollout.reward_fn, s.rollout.top_p, s.eval.top_p) == ("verl", "actors.rewards:simplerl_math", 1.0, 0.95)
    assert (s.train.weight_decay, s.train.lr_schedule, s.train.warmup_steps, s.train.adam_betas) == (0.01, "constant", 0, [0.9, 0.999])
    assert (s.algo.grpo_std, s.algo.old_logprobs, s.algo.correction, s.algo.kl_clamp) == ("unbiased", "recompute", "none", 10.0)
    assert (s.algo.loss_agg, s.train.micro_batch_samples, s.train.max_tokens_per_micro_batch) == ("micro_batch_token_mean", 2, 0)
    assert (s.checkpoint.every_steps, s.checkpoint.keep_every) == (5, 5)
    t = load_config(CONFIGS / "open_instruct_tulu3_8b_rlvr.toml")
    assert (t.data.format, t.rollout.reward_fn, t.algo.advantage_normalize) == ("open_instruct", "actors.rewards:tulu3_as_run", True)
    assert (t.algo.kl_in_reward, t.algo.kl_coef, t.algo.kl_estimator) == (True, 0.05, "k1")
    assert (t.train.weight_decay, t.train.lr_schedule, t.train.warmup_steps) == (0.01, "linear", 0)
    assert (t.algo.old_logprobs, t.algo.correction, t.algo.loss_agg, t.train.micro_batch_samples) == (
        "recompute",
        "none",
        "micro_batch_token_mean",
        2,
    )
    assert (t.checkpoint.every_steps, t.checkpoint.keep_every) == (100, 100)
    (row,) = [line for line in render(make_plan(t)).splitlines() if "learning rate" in line]
    assert "linear decay to 0 after step 1,784" in row  # 446 updates x 4 PPO epochs, as open-instruct's scheduler counts


@pytest.mark.parametrize("path", [p for p in RECIPES if not p.stem.startswith("demo")], ids=lambda p: p.stem)
def test_recipes_end_with_a_departures_table(path):
    tail = path.read_text().rstrip().splitlines()
    header = next(i for i, line in enumerate(tail) if line.startswith("# Departures from"))
    rows = [line for line in tail[header:] if line.startswith("#   ") and "|" in line]
    assert len(rows) >= 4 and all(line.startswith("#") for line in tail[header:])  # nothing after the table


def test_top_p_counts_the_sorted_chunk():
    """Top-p masking sorts each chunk of logits (learner/train/scoring.py): 12 more bytes per logit of a chunk."""
    plain = plan_of("orz_0p5b_ppo.toml").learner_memory.activations
    nucleus = plan_of("orz_0p5b_ppo.toml", "rollout.top_p=0.9").learner_memory.activations
    assert nucleus.head - plain.head == 1024 * 151936 * 12 and nucleus.layers == plain.layers
