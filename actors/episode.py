"""One multi-turn episode, token in and token out: the model acts, the environment answers, until it is done.

    prompt ids --engine (from ids)--> turn ids + logprobs (mask 1) --env.step(turn text)--> Step
        --observation rendered and tokenized once--> observation ids (mask 0) --> the next turn, from all the ids

The trajectory is kept as token ids only. The engine's sampled ids are appended as they are and the next turn is
generated from the ids (a vLLM token prompt), so the learner trains on exactly what the engine sampled: no text
is ever re-tokenized. An observation is tokenized once, on its own: text as it is; chat messages through the
tokenizer's chat template as the continuation of the conversation (`chat_continuation`), earlier turns never
rendered again. Budgets: rollout.max_turns model turns, rollout.max_tokens per turn, and the episode's tokens
after the prompt (model and observation) within rollout.max_episode_tokens and the context (protocol/budget.py).
An episode that runs out of turns or tokens ends with finish reason "length".

The environment is user code: every call runs under rollout.env_timeout_s, and anything it raises or returns
wrong ends the episode with `error` set (finish reason "env_error"), never the actor.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engine import Completion, Sampling
from actors.env.base import EnvError, EpisodeRow, Step
from protocol.budget import episode_budget
from protocol.config import Config
from protocol.logs import first_line
from protocol.messages import ENV_ERROR


@dataclass(kw_only=True, slots=True)
class Episode:
    token_ids: list[int] = field(default_factory=list)  # after the prompt: turns and observations
    logprobs: list[float] = field(default_factory=list)  # per token; 0.0 at observation tokens
    mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: an observation's
    text: list[tuple[str, str]] = field(default_factory=list)  # ("model" | "env", text) in order: the whole episode
    reward: float | None = None  # the sum of the steps' rewards; None when no step gave one
    finish_reason: str = "stop"  # "stop" | "length" | ENV_ERROR
    turns: int = 0  # model turns
    tool_calls: int = 0
    env_s: float = 0.0  # seconds inside the environment
    error: str | None = None  # what ended it, when the environment failed
    timed_out: bool = False  # the failure was rollout.env_timeout_s

    def add(self, ids: list[int], logprobs: list[float] | None, role: str, text: str) -> None:
        self.token_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.text.append((role, text))

    @property
    def completion_text(self) -> str:
        return "".join(t for _, t in self.text)


def chat_continuation(tokenizer: Any, messages: list[dict[str, str]], model_eos_emitted: bool) -> str:
    """The text that follows a finished assistant turn when `messages` are appended: the template's end of that
    turn (less the end token the model sampled itself) and the messages, up to the next assistant prompt.

    Rendered against a fixed two-turn conversation, so earlier turns are never rendered again; the template must
    render a conversation as a prefix of its extension (the usual chat templates do)."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise EnvError("the chat template renders earlier turns differently once messages are added: use text observations")
    tail = before[before.rindex("a") + 1 :]  # the assistant turn's end, as the template writes it
    eos = tokenizer.eos_token or ""
    if model_eos_emitted and eos and tail.startswith(eos):
        tail = tail[len(eos) :]
    return tail + after[len(before) :]


def turn_sampling(s: Sampling) -> Sampling:
    """A turn's text keeps the stop string that ended it (a tool call's closing tag), whatever the config says."""
    return Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop=s.stop, include_stop_str=True)


class EpisodeRunner:
    """Runs episodes on one engine with one environment class; many at once (each a task of the actor's loop)."""

    def __init__(self, cfg: Config, engine: Any, env_cls: type, sampling: Sampling):
        self.cfg, self.engine, self.env_cls = cfg, engine, env_cls
        r = cfg.rollout
        self.sampling = turn_sampling(sampling)
        self.timeout_s, self.max_turns, self.turn_tokens = r.env_timeout_s, r.max_turns, r.max_tokens

    async def run(self, prompt_tokens: np.ndarray, row: EpisodeRow, sampling: Sampling | None = None) -> Episode:
        """One episode; `sampling` (default rollout's) for an evaluation's."""
        ep = Episode()
        turns = turn_sampling(sampling) if sampling is not None else self.sampling
        budget = episode_budget(len(prompt_tokens), self.cfg.rollout.max_episode_tokens, self.cfg.actor.max_model_len)
        prompt = [int(t) for t in prompt_tokens]
        env = None
        try:
            while True:
                room = budget - len(ep.token_ids)
                turn = await self._generate(prompt + ep.token_ids, min(self.turn_tokens, room), turns)
                ep.add(turn.token_ids.tolist(), turn.logprobs.tolist(), "model", turn.text)
                ep.turns += 1
                # Built after the first turn: an episode its constructor ends still has a token, which the hub
                # needs to count it as the environment's failure (a 0-token completion is refused as the actor's).
                if env is None:
                    env = await self._call(ep, self.env_cls, row)
                step = await self._call(ep, env.step, turn.text)
                if not isinstance(step, Step):
                    raise EnvError(f"step returned {type(step).__name__}, not a Step")
                ep.tool_calls += int(step.tool_calls)
                if step.reward is not None:
                    ep.reward = (ep.reward or 0.0) + float(step.reward)
                if step.done:
                    ep.finish_reason = turn.finish_reason
                    return ep
                if ep.turns >= self.max_turns or len(ep.token_ids) >= budget:
                    ep.finish_reason = "length"
                    return ep
                text = self._render(step.observation, turn)
                ids = self._tokenize(text)
                if len(ep.token_ids) + len(ids) >= budget:  # no room for the observation and another turn
                    ep.finish_reason = "length"
                    return ep
                ep.add(ids, None, "env", text)
        except TimeoutError:
            ep.finish_reason, ep.timed_out = ENV_ERROR, True
            ep.error = f"the environment took longer than rollout.env_timeout_s = {self.timeout_s:g} s"
        except Exception as e:  # the user's environment: any exception ends this episode only
            ep.finish_reason, ep.error = ENV_ERROR, first_line(e)
        return ep

    async def _generate(self, ids: list[int], max_tokens: int, sampling: Sampling) -> Completion:
        (turn,) = await self.engine.generate_group(np.asarray(ids, np.int32), 1, sampling=sampling, max_tokens=max_tokens)
        return turn

    async def _call(self, ep: Episode, fn: Any, *args: Any) -> Any:
        """`fn(*args)` (the env's constructor or step) under the timeout: on the loop when it is a coroutine
        function, else in a thread (a plain `def` that hangs keeps its thread, but not the episode)."""
        t0 = time.perf_counter()
        try:

            async def call() -> Any:
                out = fn(*args) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, *args)
                return await out if inspect.isawaitable(out) else out

            return await asyncio.wait_for(call(), self.timeout_s)
        finally:
            ep.env_s += time.perf_counter() - t0

    def _render(self, observation: Any, turn: Completion) -> str:
        if isinstance(observation, str):
            return observation
        if isinstance(observation, list) and all(isinstance(x, dict) and "role" in x and "content" in x for x in observation):
            eos = getattr(self.engine.tokenizer, "eos_token_id", None)
            emitted = turn.finish_reason == "stop" and len(turn.token_ids) > 0 and int(turn.token_ids[-1]) == eos
            return chat_continuation(self.engine.tokenizer, observation, emitted)
        raise EnvError(f"observation is {type(observation).__name__}: it must be text or a list of chat messages")

    def _tokenize(self, text: str) -> list[int]:
        ids = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids and text:
            raise EnvError(f"observation {text[:40]!r} tokenizes to no tokens")
        return [int(t) for t in ids]
