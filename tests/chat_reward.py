"""The reward for tests/integration/test_e2e_chat_data.py: exact match, and a JSON line per call of what the reward saw
(prompt, answer, metadata) in the file $FLEETRL_TEST_REWARD_LOG, so the test can check what crossed the wire."""

import json
import os


def exact_match_logged(ctx):
    with open(os.environ["FLEETRL_TEST_REWARD_LOG"], "a") as f:  # one short write per line: appends do not interleave
        f.write(json.dumps({"prompt": ctx.prompt, "answer": ctx.answer, "metadata": ctx.metadata}) + "\n")
    return 1.0 if ctx.completion.strip() == ctx.answer.strip() else 0.0
