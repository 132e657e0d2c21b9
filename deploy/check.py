"""`fleetrl check CONFIG [overrides]` (or `fleetrl plan --check`): what a run needs, verified in seconds, nothing
started (no engine, no learner, no hub).

    model   model.path is a Hugging Face folder; its config.json and tokenizer load (no weights are read)
    data    the prompt sets load as the learner loads them; the first training prompt is shown as the model sees it
    reward  rollout.reward_fn imports and scores that prompt's reference answer, in a reward worker process as an
            actor runs it (rollout.reward_timeout_s)

The first thing that fails raises ConfigError naming the field (the command line prints it as one line, exit 2).
`fleetrl demo` runs the same model, data and reward-import checks before it starts any process.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, TextIO

from protocol.config import Config, ConfigError
from protocol.logs import first_line


@dataclass(frozen=True, slots=True)
class Model:
    config: Any  # transformers' config of model.path
    tokenizer: Any


def check_model(cfg: Config) -> Model:
    from learner.model_files import check_model_paths, load_model_config, load_tokenizer

    check_model_paths(cfg)
    config = load_model_config(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.path)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and not getattr(config, "rope_scaling", None) and cfg.actor.max_model_len > limit:
        raise ConfigError(
            f"actor.max_model_len: {cfg.actor.max_model_len} exceeds the model's max_position_embeddings "
            f"{limit} ({cfg.model.path}/config.json); lower actor.max_model_len"
        )
    return Model(config, tokenizer)


def check_data(cfg: Config, tokenizer: Any) -> Any:
    """The learner's own loading (learner/data/prompts.py): its errors name the file, row and column."""
    from learner.data.prompts import load_datasets

    return load_datasets(cfg, tokenizer)


def check_reward_import(cfg: Config) -> Any:
    from actors.rewards import load_reward

    spec = cfg.rollout.reward_fn
    try:
        return load_reward(spec)
    except ValueError as e:  # load_reward's messages name rollout.reward_fn already
        raise ConfigError(
            f"{e}; set rollout.reward_fn to a package.module:function importable here (installed, or its folder on PYTHONPATH)"
        ) from e
    except Exception as e:  # the module itself raised as it was imported (SyntaxError, NameError, ...): the user's code
        raise ConfigError(f"rollout.reward_fn: importing {spec.partition(':')[0]!r} raised {first_line(e)}") from e


def score_sample(cfg: Config, prompt: Any) -> Any:
    """One Outcome: the prompt's reference answer, as a completion that stopped, scored in a reward worker."""
    from actors.rewards import RewardContext, parse_metadata
    from actors.rewards.pool import RewardPool

    ctx = RewardContext(
        completion=prompt.answer, prompt=prompt.text, answer=prompt.answer, metadata=parse_metadata(prompt.metadata), finish_reason="stop"
    )

    async def score() -> Any:
        pool = RewardPool(cfg.rollout.reward_fn, 1, cfg.rollout.reward_timeout_s)
        try:
            await pool.start()
            (outcome,) = await pool.score([ctx])
            return outcome
        finally:
            await pool.close()

    try:
        outcome = asyncio.run(score())
    except ValueError as e:  # the worker could not load the function
        raise ConfigError(str(e)) from e
    if outcome.error is not None:
        raise ConfigError(
            f"rollout.reward_fn: {cfg.rollout.reward_fn} failed on the sample above ({outcome.error}); "
            "the actors would score such completions 0 and count a reward error"
        )
    return outcome


def run_check(cfg: Config, out: TextIO) -> None:
    """Print what loads; ConfigError at the first failure."""

    def show(what: str, text: str) -> None:
        print(f"{what:<8}{text}", file=out, flush=True)

    model = check_model(cfg)
    c, tok = model.config, model.tokenizer
    # Added special tokens past the embeddings are common and harmless (they never occur in text); a regular
    # token id past them means the tokenizer belongs to another model.
    added = set(getattr(tok, "added_tokens_decoder", {}))
    vocab, top = getattr(c, "vocab_size", None), max(i for i in tok.get_vocab().values() if i not in added)
    show(
        "model",
        f"{cfg.model.path}: {getattr(c, 'model_type', '?')}, {getattr(c, 'num_hidden_layers', '?')} layers, "
        f"hidden {getattr(c, 'hidden_size', '?')}, vocabulary {getattr(c, 'vocab_size', '?')}; tokenizer "
        f"{type(tok).__name__} with {len(tok)} tokens, eos {tok.eos_token!r}, chat template "
        f"{'yes' if getattr(tok, 'chat_template', None) else 'no'}",
    )
    if vocab is not None and top >= vocab:
        raise ConfigError(
            f"model.path: the tokenizer's ids reach {top} but the model's vocabulary is {vocab} "
            f"({cfg.model.path}/config.json vocab_size): the tokenizer comes from another model"
        )
    if cfg.algo.advantage == "gae" and cfg.algo.critic_path:
        show("critic", f"{cfg.algo.critic_path}: config.json found")
    data = check_data(cfg, tok)
    sets = {"train": data.train, **data.eval_sets()}
    source = "the built-in addition task" if cfg.data.task == "addition" else cfg.data.path
    show(
        "data",
        f"{source}: "
        + ", ".join(f"{name} {len(s)} prompts" + (f" ({s.dropped} too long, dropped)" if s.dropped else "") for name, s in sets.items()),
    )
    first = data.train[0]
    show("", f"the first training prompt as the model sees it ({len(first.tokens)} tokens):")
    for line in _clip(first.text).splitlines() or [""]:
        show("", f"  | {line}")
    show("", f"answer {first.answer!r}; metadata {_clip(first.metadata, 300)}")
    reward = check_reward_import(cfg)
    form = "RewardContext" if reward.takes_context else "(completion, answer)"
    outcome = score_sample(cfg, first)
    parts = f", parts {json.dumps(outcome.parts)}" if outcome.parts else ""
    show("reward", f"{cfg.rollout.reward_fn} ({form} form): the answer above as a stopped completion scores {outcome.score:g}{parts}")
    print("ok: model, tokenizer, data and reward load; nothing was started", file=out)


def _clip(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
