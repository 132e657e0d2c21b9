"""Errors at the boundary: a user mistake is one line on the screen naming the field and the fix, exit 2, and its
traceback goes to the log file. In-process where the error comes before any process starts; as subprocesses for
the learner's own loading (one rank, and two under torchrun) and the hub's bind."""

import json
import socket
import subprocess
import sys

import pytest
import structlog

from deploy.cli import main
from protocol.net import free_port
from tests.conftest import ROOT

DEMO = str(ROOT / "configs" / "demo.toml")


@pytest.fixture(autouse=True)
def _keep_logging():
    """The commands set up structlog process-wide (`check` at warning level): later tests get it back as it was."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def tracebacks(log) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "fleetrl.error"]


def test_missing_model_path_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    for command in (["learner", "--config", DEMO], ["actor", "--learner", "tcp://127.0.0.1:5555", "--config", DEMO]):
        assert main([*command, f"run.dir={run}", f"model.path={tmp_path}/nope"]) == 2
        assert one_line(capsys.readouterr().err) == (
            f"fleetrl: config error: model.path: {tmp_path}/nope: no such folder (from {ROOT}); point it at a local "
            "Hugging Face model folder (save_pretrained's output; deploy/tiny.py writes a tiny one)"
        )
    # A hub-style relative path says how to get the model there.
    assert main(["learner", "--config", DEMO, f"run.dir={run}", "model.path=models/Qwen2.5-0.5B"]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        "or download the hub model there first: huggingface-cli download ORG/NAME --local-dir models/Qwen2.5-0.5B"
    )
    (entry, *_) = tracebacks(run / "logs" / "learner.jsonl")
    assert entry["command"] == "learner" and "Traceback (most recent call last)" in entry["exception"]
    assert "check_model_dir" in entry["exception"]


def test_model_folder_without_tokenizer(tmp_path, tiny_model_dir, capsys):
    """transformers loads such a folder as a one-token tokenizer; the run then failed with 'tokenizes to no tokens'."""
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert main(["check", DEMO, f"run.dir={tmp_path}", f"model.path={folder}"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"fleetrl: config error: model.path: {folder} has no tokenizer (tokenizer.json / tokenizer.model / vocab.json / "
        "spiece.model / vocab.txt); save the model's tokenizer there too: "
        f"AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained('{folder}')"
    )
    (folder / "config.json").unlink()
    assert main(["check", DEMO, f"run.dir={tmp_path}", f"model.path={folder}"]) == 2
    assert "has no config.json, so it is not a Hugging Face model folder" in one_line(capsys.readouterr().err)


def test_reward_import_errors(tmp_path, tiny_model_dir, capsys, monkeypatch):
    run, base = tmp_path / "run", ["actor", "--learner", "tcp://127.0.0.1:5555", "--config", DEMO, "--id", "a1"]
    overrides = [f"run.dir={run}", f"model.path={tiny_model_dir}"]
    assert main([*base, *overrides, "rollout.reward_fn=no_such_module:f"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "fleetrl: config error: rollout.reward_fn: cannot import 'no_such_module' (No module named 'no_such_module'); "
        "set rollout.reward_fn to a package.module:function importable here (installed, or its folder on PYTHONPATH)"
    )
    assert main([*base, *overrides, "rollout.reward_fn=actors.rewards:nothing"]) == 2
    assert "rollout.reward_fn: 'actors.rewards' has no function 'nothing'" in one_line(capsys.readouterr().err)
    # The user's module raises as it is imported: one line, and the log file holds where.
    (tmp_path / "broken_reward.py").write_text("def f(completion, answer):\n    return 1.0\n\nx = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main([*base, *overrides, "rollout.reward_fn=broken_reward:f"]) == 2
    log = run / "logs" / "actor-a1.jsonl"
    assert one_line(capsys.readouterr().err) == (
        "fleetrl: config error: rollout.reward_fn: importing 'broken_reward' raised NameError: name 'undefined_name' "
        f"is not defined (traceback in {log})"
    )
    assert 'broken_reward.py", line 4' in tracebacks(log)[-1]["exception"]


def test_bad_addresses(tmp_path, capsys):
    for command in (["actor", "--config", DEMO, f"run.dir={tmp_path}"], ["status", "--once"], ["ctl", "set", "max_staleness", "1"]):
        assert main([command[0], "--learner", "127.0.0.1:5555", *command[1:]]) == 2
        assert one_line(capsys.readouterr().err) == (
            f"fleetrl {command[0]}: --learner '127.0.0.1:5555': expected tcp://HOST:PORT with PORT in 1-65535, e.g. tcp://10.0.0.1:5555"
        )
    assert main(["status", "--learner", "tcp://no-such-host.invalid:5555", "--once"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        "fleetrl status: --learner tcp://no-such-host.invalid:5555: host 'no-such-host.invalid' does not resolve ("
    ) and line.endswith("); give the learner node's name or IP address")
    # ZeroMQ itself would bind port 99999 (somewhere else) without a word.
    assert main(["plan", DEMO, "hub.bind=tcp://127.0.0.1:99999"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "fleetrl: config error: hub.bind: 'tcp://127.0.0.1:99999' must be tcp://HOST:PORT, PORT in 1-65535"
    )


def test_usage_errors(capsys):
    assert main(["check"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "fleetrl check: a config file is required: fleetrl check CONFIG [section.field=value ...] (or --config CONFIG)"
    )
    assert main(["plan", "train.lr=0.1"]) == 2  # an override where the file should be
    assert one_line(capsys.readouterr().err).startswith("fleetrl plan: a config file is required")


def learner(tmp_path, *overrides, timeout=180):
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "learner",
        "--config",
        DEMO,
        f"run.dir={tmp_path / 'run'}",
        f"hub.bind=tcp://127.0.0.1:{free_port()}",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("ranks", [1, 2])
def test_learner_data_error_is_one_line_per_run(tmp_path, tiny_model_dir, ranks):
    """Only rank 0 loads the data: the error comes from inside the learner, after DeepSpeed and torchrun started.
    Two ranks print it once (deploy/torchrun.py), not twice with [rankN] prefixes and torchrun's own report."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n')
    proc = learner(
        tmp_path,
        f"model.path={tiny_model_dir}",
        "data.task=file",
        f"data.path={data}",
        f"cluster.debug_gpus={ranks}" if ranks > 1 else "cluster.debug_gpus=0",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_line(proc.stderr + proc.stdout) == (
        f"fleetrl: config error: data.path: {data}: no columns 'prompt' and 'answer' for data.format = 'plain' "
        "(has: 'question', 'answer'); set data.format, or data.prompt_key and data.answer_key"
    )
    (entry,) = tracebacks(tmp_path / "run" / "logs" / "learner.jsonl")
    assert "load_datasets" in entry["exception"] and entry["rank"] == 0


def test_hub_port_in_use(tmp_path, tiny_model_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = learner(tmp_path, f"model.path={tiny_model_dir}", f"hub.bind=tcp://127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout  # the learner's info lines come first: it had started
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fleetrl: config error: hub.bind tcp://127.0.0.1:{port}: Address already in use (addr='tcp://127.0.0.1:{port}'): "
        "choose a free port on an address of this host (tcp://0.0.0.0:PORT binds them all)"
    )


def test_report_and_collect(tmp_path, capsys, monkeypatch):
    """A bug (not a user mistake) keeps its traceback on the screen; under deploy/torchrun.py ranks write their line
    to FLEETRL_ERROR_DIR, and a user mistake on any rank is what the launcher prints."""
    from deploy.errors import ERROR_DIR, collect, report
    from protocol.config import ConfigError

    def raised(e):
        try:
            raise e
        except Exception as caught:
            return caught

    log = tmp_path / "logs" / "learner.jsonl"
    monkeypatch.delenv("RANK", raising=False)
    assert report("learner", raised(RuntimeError("boom")), log) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1] == f"fleetrl learner: RuntimeError: boom; traceback in {log}"
    assert tracebacks(log)[0]["error"] == "RuntimeError: boom"

    errors = tmp_path / "errors"
    errors.mkdir()
    monkeypatch.setenv(ERROR_DIR, str(errors))
    monkeypatch.setenv("RANK", "1")
    assert report("learner", raised(RuntimeError("peer gone")), tmp_path / "r1.jsonl") == 1
    assert capsys.readouterr().err == ""  # rank 1: its log file has the traceback, the launcher prints its line
    assert collect(errors) == ([f"fleetrl learner: rank 1: RuntimeError: peer gone; traceback in {tmp_path / 'r1.jsonl'}"], False)
    for rank in ("0", "2"):
        monkeypatch.setenv("RANK", rank)
        assert report("learner", raised(ConfigError("data.path: x not found")), None) == 2
    assert capsys.readouterr().err == ""
    assert collect(errors) == (["fleetrl: config error: data.path: x not found"], True)


def test_demo_checks_before_starting_anything(tmp_path, tiny_model_dir, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1=", "answer": "2"}\n')
    assert main(["demo", f"run.dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "data.task=file", f"data.path={rows}"]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"fleetrl: config error: data.path: {rows}: no columns 'prompt'")
    assert not (tmp_path / "run" / "config.toml").exists()  # no learner, no actor: nothing was started
    assert tracebacks(tmp_path / "run" / "logs" / "launcher.jsonl")[0]["command"] == "demo"
