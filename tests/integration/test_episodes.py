"""Multi-turn episodes on a real vLLM engine (CPU build): the learner trains on exactly the ids the engine sampled.

One engine for the module, on a tiny Qwen2 whose tokenizer is a BPE trained here on digit strings: its merges
("34", "67", ...) make the re-tokenization of an episode's joined text differ from the ids of its turns, so a
learner that re-tokenized the conversation would score other tokens. Proved here:
- a 3-turn episode's mask is 1 on exactly the engine's sampled ids and 0 on the observations' ids; the learner's
  path (Sample, make_micro_batch, score_tokens on the HF model from the same folder) reproduces the engine's
  logprobs within 1e-4 on every model token, and the re-tokenized joined text does not line up;
- an environment that raises, hangs (a coroutine awaiting forever, a plain def sleeping) or answers garbage ends
  that episode only ("env_error", the cause named, timed_out for a hang); the same runner runs the next episode;
  through Rollouts.episode_group (a real RewardPool) the group counts them and, as rollout.env_errors says, the
  hub's check_group refuses it ("env") or trains it with the failed episodes scored 0;
- rollout.max_turns and rollout.max_episode_tokens end an episode ("length") within them;
- a single-turn group (no rollout.env) carries no loss mask and no turns.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from actors.env.base import EpisodeRow, Step

HERE = "tests.integration.test_episodes"
PROMPT_TEXT = "3141 5926"
OBSERVATIONS = ("42", "7 9")  # start with a digit: the BPE merges it with the turn's last digit when re-tokenized
TIMEOUT_S = 0.5  # rollout.env_timeout_s for every test here
SLEEP_S = 4.0  # a plain-def step sleeps this long: past the timeout and a loaded machine's generation; its thread ends soon


# ---- environments -------------------------------------------------------------------------------------


class Moody:
    """Answers OBSERVATIONS to the first two turns and ends the episode at the third with reward 1.

    row.metadata["mode"] says what goes wrong instead (ok, raise_init, raise, hang, not_step, bad_obs, bad_messages), for the
    first row.metadata["fail"] episodes of the row (all when absent): Rollouts hands one row (one metadata dict) to
    every episode of a group, so a counter kept in it tells them apart (itertools.count: its next() is atomic, and
    the constructors run in threads)."""

    def __init__(self, row: EpisodeRow):
        count = row.metadata.setdefault("_started", itertools.count())
        self.mode = row.metadata.get("mode", "ok")
        self.fails = self.mode != "ok" and next(count) < row.metadata.get("fail", 1 << 30)
        self.turn = 0
        if self.fails and self.mode == "raise_init":
            raise KeyError("no such tool")

    def answer(self, text: str) -> Any:
        self.turn += 1
        if self.fails:
            if self.mode == "raise":
                raise RuntimeError("calculator exploded\nsecond line")
            if self.mode == "not_step":
                return {"observation": "42"}
            if self.mode == "bad_obs":
                return Step(observation=42)  # type: ignore[arg-type]
            if self.mode == "bad_messages":
                return Step(observation=[{"content": "no role"}])  # type: ignore[list-item]
        if self.turn >= 3:
            return Step(reward=1.0, done=True)
        return Step(observation=OBSERVATIONS[self.turn - 1])

    async def step(self, text: str) -> Any:
        if self.fails and self.mode == "hang":
            await asyncio.Event().wait()  # never set
        return self.answer(text)


class Sleepy(Moody):
    """Moody with a plain `def step` (run in a thread): mode "hang" sleeps past the timeout."""

    def step(self, text: str) -> Any:  # type: ignore[override]
        if self.fails and self.mode == "hang":
            time.sleep(SLEEP_S)
        return self.answer(text)


class Chatty:
    """Never done: answers every turn with "7 " (two tokens)."""

    def __init__(self, row: EpisodeRow):
        pass

    async def step(self, text: str) -> Step:
        return Step(observation="7 ")


# ---- the model, the engine and the learner's scoring ----------------------------------------------------


def write_bpe_model(out: Path) -> Path:
    """deploy/tiny.py's Qwen2 over a BPE tokenizer trained on random digit strings (merges like "34", "67")."""
    import random

    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from deploy.tiny import SPECIALS, build_model

    rng = random.Random(0)
    corpus = ["".join(rng.choice("0123456789") for _ in range(rng.randint(2, 8))) for _ in range(2000)]
    bpe = Tokenizer(models.BPE())
    bpe.decoder = decoders.Fuse()  # the tokens' text joined as it is (BPE's default decoder would put spaces between)
    bpe.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=64, special_tokens=SPECIALS, initial_alphabet=list("0123456789 "), show_progress=False)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", model_max_length=256)
    assert tokenizer.convert_tokens_to_ids(SPECIALS) == [0, 1, 2]  # build_model's pad, eos and bos ids
    build_model(len(tokenizer), seed=5).save_pretrained(out)
    tokenizer.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():  # a random model is near uniform: spread it, so that other ids score visibly differently
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out)
    return out.absolute()


def config(path: Path, *overrides: str):
    from protocol.config import load_config

    base = [
        f"model.path={path}",
        "rollout.max_tokens=6",
        "rollout.max_turns=3",
        "rollout.temperature=1.0",
        "rollout.samples_per_prompt=4",
        f"rollout.env_timeout_s={TIMEOUT_S}",
        "actor.max_model_len=64",
    ]
    return load_config(None, [*base, *overrides])


class Recording:
    """The engine as the runner sees it, keeping each request's ids, max_tokens and completion."""

    def __init__(self, engine: Any):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.calls: list[tuple[list[int], int, Any]] = []

    async def generate_group(self, ids: np.ndarray, n: int, **kwargs: Any) -> list[Any]:
        out = await self.engine.generate_group(ids, n, **kwargs)
        self.calls.append(([int(t) for t in ids], kwargs["max_tokens"], out[0]))
        return out


class RecordingLog:
    def __init__(self):
        self.records: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.records.append((event, fields))

    error = warning


@dataclass
class Setup:
    path: Path
    engine: Any
    loop: asyncio.AbstractEventLoop
    pool: Any  # RewardPool, shared by every Rollouts here (tests.reward_fns:behaves scores 1)
    prompt: np.ndarray  # int32: PROMPT_TEXT's ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from actors.engine import Engine
    from actors.rewards.pool import RewardPool

    path = write_bpe_model(tmp_path_factory.mktemp("bpe"))
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    engine = loop.run_until_complete(_make(Engine, config(path)))
    pool = RewardPool("tests.reward_fns:behaves", workers=1, timeout_s=10.0)
    loop.run_until_complete(pool.start())
    prompt = np.asarray(engine.tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"], np.int32)
    yield Setup(path=path, engine=engine, loop=loop, pool=pool, prompt=prompt)
    loop.run_until_complete(pool.close())
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0.5))  # AsyncLLM closes its sockets from tasks on this loop
    loop.close()


async def _make(cls, cfg):
    return cls(cfg)


def runner(s: Setup, env_cls: type, *overrides: str):
    from actors.engine import Sampling
    from actors.episode import EpisodeRunner

    cfg = config(s.path, *overrides)
    engine = Recording(s.engine)
    return EpisodeRunner(cfg, engine, env_cls, Sampling.rollout(cfg)), engine


def episode(s: Setup, run: Any, row: EpisodeRow) -> Any:
    """One episode, bounded: a runner that let a hanging environment hold it would fail here, not hang the test."""
    return s.loop.run_until_complete(asyncio.wait_for(run.run(s.prompt, row), 60.0))


def row(mode: str = "ok") -> EpisodeRow:
    return EpisodeRow(prompt=PROMPT_TEXT, answer="", metadata={"mode": mode})


def learner_logprobs(path: Path, tokens: np.ndarray, prompt_len: int, mask: np.ndarray | None, behaviour: np.ndarray) -> np.ndarray:
    """The learner's logprobs of a sample's scored tokens: its micro-batch scored by the model from `path` (float32,
    temperature 1, as sampled)."""
    from transformers import AutoModelForCausalLM

    from learner.train.batch import Sample, make_micro_batch
    from learner.train.scoring import install_scoring_head, score_tokens

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head = install_scoring_head(model)
    sample = Sample(
        tokens=tokens.astype(np.int32),
        prompt_len=prompt_len,
        behaviour_logprobs=behaviour,
        advantage=0.0,
        reward=0.0,
        version_min=0,
        version_max=0,
        loss_mask=mask,
    )
    mb = make_micro_batch([sample], 0)
    with torch.no_grad():
        logp, _ = score_tokens(model, head, mb, 1.0, 7, False, torch.device("cpu"))
    return logp.numpy()


# ---- 1. token-exact training across a 3-turn episode ---------------------------------------------------


@pytest.mark.engine
@pytest.mark.vllm
def test_three_turn_episode_trains_on_the_sampled_ids(setup):
    s = setup
    run, engine = runner(s, Moody)
    ep = episode(s, run, row())
    tok = engine.tokenizer
    assert ep.error is None and ep.turns == 3 and ep.reward == 1.0 and len(engine.calls) == 3

    # Turn by turn: each request is the prompt and the episode so far, as ids (token in); the episode is the
    # sampled ids as they came (token out), then each observation's ids, tokenized once on its own.
    prompt = s.prompt.tolist()
    expected_ids: list[int] = []
    expected_mask: list[int] = []
    for i, (ids_in, _, turn) in enumerate(engine.calls):
        assert ids_in == prompt + expected_ids
        expected_ids += turn.token_ids.tolist()
        expected_mask += [1] * len(turn.token_ids)
        if i < 2:
            obs = tok(OBSERVATIONS[i], add_special_tokens=False)["input_ids"]
            expected_ids += obs
            expected_mask += [0] * len(obs)
    assert ep.token_ids == expected_ids and ep.mask == expected_mask
    sampled = np.concatenate([c.logprobs for _, _, c in engine.calls])
    mask = np.asarray(ep.mask, np.uint8)
    assert np.array_equal(np.asarray(ep.logprobs, np.float32)[mask == 1], sampled)
    assert (np.asarray(ep.logprobs)[mask == 0] == 0).all() and (mask == 0).sum() >= 2

    # The tokenizer drifts: the joined text re-tokenizes to other ids (else this test would prove nothing).
    segments = [(tok.decode(prompt), "prompt")] + [(text, role) for role, text in ep.text]
    joined = "".join(t for t, _ in segments)
    assert [role for _, role in segments] == ["prompt", "model", "env", "model", "env", "model"]
    retok = tok(joined, add_special_tokens=False, return_offsets_mapping=True)
    assert retok["input_ids"] != prompt + ep.token_ids

    # The learner's path on the episode's ids and mask: the engine's logprobs on every model token.
    tokens = np.asarray(prompt + ep.token_ids)
    ours = learner_logprobs(s.path, tokens, len(prompt), mask, sampled)
    diff = np.abs(ours - sampled)
    assert len(ours) == int(mask.sum()) == len(sampled) >= 3 and diff.max() < 1e-4, diff.max()
    print(f"episode: {len(ep.token_ids)} tokens, {int(mask.sum())} the model's; max |learner - engine| = {diff.max():.2e}")

    # The control: the re-tokenized conversation, the model's tokens told apart by their characters, does not line
    # up with what the engine sampled: other ids, so other (or differently many) logprobs.
    spans, at = [], 0
    for text, role in segments:
        if role == "model":
            spans.append((at, at + len(text)))
        at += len(text)
    ids = retok["input_ids"]
    prompt_len = next(i for i, (a, _) in enumerate(retok["offset_mapping"]) if a >= len(segments[0][0]))
    model = np.asarray([any(a <= start < b for a, b in spans) for start, _ in retok["offset_mapping"][prompt_len:]], np.uint8)
    retok_model_ids = [t for t, m in zip(ids[prompt_len:], model, strict=True) if m]
    sampled_ids = [t for t, m in zip(ep.token_ids, ep.mask, strict=True) if m]
    assert retok_model_ids != sampled_ids
    drifted = learner_logprobs(s.path, np.asarray(ids), prompt_len, model, np.zeros(int(model.sum()), np.float32))
    assert len(drifted) != len(sampled) or np.abs(drifted - sampled).max() > 1e-2


# ---- 2. robustness: an environment ends its own episode, never the runner --------------------------------

FAILURES = [
    (Moody, "raise_init", "KeyError: 'no such tool'$", False),
    (Moody, "raise", "RuntimeError: calculator exploded$", False),
    (Moody, "hang", f"rollout.env_timeout_s = {TIMEOUT_S:g} s", True),
    (Sleepy, "hang", f"rollout.env_timeout_s = {TIMEOUT_S:g} s", True),
    (Moody, "not_step", "step returned dict, not a Step", False),
    (Moody, "bad_obs", "observation is int: it must be text or a list of chat messages", False),
    (Moody, "bad_messages", "observation is list: it must be text or a list of chat messages", False),
]


@pytest.mark.engine
@pytest.mark.vllm
@pytest.mark.parametrize("env_cls,mode,error,timed_out", FAILURES, ids=[f"{c.__name__}-{m}" for c, m, _, _ in FAILURES])
def test_a_failing_environment_ends_only_its_episode(setup, env_cls, mode, error, timed_out):
    import re

    from protocol.messages import ENV_ERROR

    s = setup
    run, engine = runner(s, env_cls)
    t0 = time.perf_counter()
    ep = episode(s, run, row(mode))
    took = time.perf_counter() - t0
    assert ep.finish_reason == ENV_ERROR and ep.error is not None and re.search(error, ep.error), ep.error
    assert ep.timed_out is timed_out and ep.turns == 1 and ep.reward is None
    assert ep.mask == [1] * len(ep.token_ids) and ep.token_ids == engine.calls[0][2].token_ids.tolist()
    if timed_out:
        assert TIMEOUT_S <= ep.env_s < SLEEP_S and took < SLEEP_S  # the hang was left behind at the timeout
    # The same runner, the next episode: whole.
    good = episode(s, run, row("ok"))
    assert good.error is None and good.turns == 3 and good.reward == 1.0 and good.finish_reason in ("stop", "length")


GROUPS = [
    ("Moody", "raise_init", "zero"),
    ("Moody", "raise_init", "requeue"),
    ("Moody", "raise", "requeue"),
    ("Moody", "hang", "zero"),
    ("Sleepy", "hang", "requeue"),
    ("Moody", "not_step", "zero"),
]


@pytest.mark.engine
@pytest.mark.vllm
@pytest.mark.parametrize("env,mode,policy", GROUPS, ids=["-".join(g) for g in GROUPS])
def test_a_group_with_failed_episodes(setup, env, mode, policy):
    """Two of a group's four episodes fail: the group counts them, then is refused and requeued (requeue) or
    trained with them scored 0 and ended as "length" (zero); logged once with the cause."""
    from actors.rollout import Rollouts
    from learner.hub.core.checks import GroupLimits, check_group
    from protocol import messages as m

    s = setup
    cfg = config(s.path, f"rollout.env={HERE}:{env}", f"rollout.env_errors={policy}")
    log = RecordingLog()
    rollouts = Rollouts(cfg, s.engine, s.pool, log)
    grant = m.WorkGrant(
        prompt_id=3,
        epoch=0,
        prompt_tokens=s.prompt,
        answer="",
        policy_version=0,
        lease_s=60.0,
        prompt=PROMPT_TEXT,
        metadata=json.dumps({"mode": mode, "fail": 2}),
    )
    group = s.loop.run_until_complete(asyncio.wait_for(rollouts.train_group(grant, "a0", lambda: 0), 60.0))
    group.check()  # what the hub's decoder checks
    timeouts = 2 if mode == "hang" else 0
    assert group.env_errors == 2 and group.env_timeouts == timeouts
    assert sorted(group.turns.tolist()) == [1, 1, 3, 3]
    limits = GroupLimits.of(cfg, len(s.engine.tokenizer))
    refusal = check_group(group, s.prompt, limits)
    if policy == "requeue":
        assert group.finish_reasons.count(m.ENV_ERROR) == 2
        assert refusal is not None and refusal.reason == "env", refusal
    else:
        assert m.ENV_ERROR not in group.finish_reasons and refusal is None, refusal
        failed = [i for i, r in enumerate(group.rewards) if r == 0.0]
        assert len(failed) == 2 and all(group.finish_reasons[i] == "length" for i in failed)
        assert sorted(group.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]
    (event, fields), *rest = log.records
    assert event == "actor.env_errors" and fields["errors"] == 2 and fields["then"] == policy and not rest
    causes = {"hang": "rollout.env_timeout_s", "not_step": "not a Step", "raise": "calculator exploded", "raise_init": "no such tool"}
    assert causes[mode] in fields["first"]


# ---- 3. budgets -------------------------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.vllm
def test_max_turns_ends_an_episode(setup):
    s = setup
    run, engine = runner(s, Chatty, "rollout.max_turns=2")
    ep = episode(s, run, row())
    assert ep.error is None and ep.finish_reason == "length" and ep.turns == 2 and len(engine.calls) == 2
    first, second = (c.token_ids.tolist() for _, _, c in engine.calls)
    obs = engine.tokenizer("7 ", add_special_tokens=False)["input_ids"]
    assert ep.token_ids == first + obs + second and ep.mask == [1] * len(first) + [0] * len(obs) + [1] * len(second)


@pytest.mark.engine
@pytest.mark.vllm
def test_max_episode_tokens_bounds_an_episode(setup):
    """10 tokens, model and observation, where 3 turns of 6 would be 22: each turn asks for what is left, and the
    episode ends ("length") within the bound; a group of such episodes passes the hub's length check."""
    from actors.rollout import Rollouts
    from learner.hub.core.checks import GroupLimits, check_group
    from protocol import messages as m

    s = setup
    limit = ["rollout.max_episode_tokens=10", "rollout.max_turns=5"]
    run, engine = runner(s, Chatty, *limit)
    for _ in range(3):
        engine.calls.clear()
        ep = episode(s, run, row())
        assert ep.error is None and ep.finish_reason == "length" and len(ep.token_ids) <= 10 and ep.turns < 5
        for ids_in, max_tokens, turn in engine.calls:
            left = 10 - (len(ids_in) - len(s.prompt))
            assert max_tokens == min(6, left) and len(turn.token_ids) <= max_tokens
    cfg = config(s.path, f"rollout.env={HERE}:Chatty", *limit)
    grant = m.WorkGrant(prompt_id=1, epoch=0, prompt_tokens=s.prompt, answer="", policy_version=0, lease_s=60.0, prompt=PROMPT_TEXT)
    group = s.loop.run_until_complete(Rollouts(cfg, s.engine, s.pool, RecordingLog()).train_group(grant, "a0", lambda: 0))
    group.check()
    assert group.lengths.max() <= 10 and group.finish_reasons == ["length"] * 4 and (group.turns < 5).all()
    assert len(group.loss_mask) == group.lengths.sum() and group.env_errors == 0
    assert check_group(group, s.prompt, GroupLimits.of(cfg, len(s.engine.tokenizer))) is None


# ---- 4. single turn, unchanged ---------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.vllm
def test_a_single_turn_group_has_no_mask_and_no_turns(setup):
    from actors.rollout import Rollouts
    from learner.hub.core.checks import GroupLimits, check_group
    from protocol import messages as m

    s = setup
    cfg = config(s.path)
    rollouts = Rollouts(cfg, s.engine, s.pool, RecordingLog())
    assert rollouts.episodes is None
    grant = m.WorkGrant(prompt_id=1, epoch=0, prompt_tokens=s.prompt, answer="", policy_version=0, lease_s=60.0, prompt=PROMPT_TEXT)
    group = s.loop.run_until_complete(rollouts.train_group(grant, "a0", lambda: 0))
    group.check()
    assert len(group.loss_mask) == 0 and len(group.turns) == 0 and len(group.tool_calls) == 0
    assert group.env_errors == group.env_timeouts == 0 and group.env_s == 0.0
    assert len(group.lengths) == 4 and group.lengths.max() <= 6 and group.rewards.tolist() == [1.0] * 4
    assert check_group(group, s.prompt, GroupLimits.of(cfg, len(s.engine.tokenizer))) is None
