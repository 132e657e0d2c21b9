"""The command line in-process, where nothing is started: `fleetrl --version`, `config --list`, `config`, `plan --config`,
and errors at the boundary: a user mistake is one line on the screen naming the field and the fix, exit 2, and its
traceback goes to the log file. What starts a process (`fleetrl check`'s reward worker, the learner under torchrun,
the hub's bind, a host name's lookup): tests/integration/test_cli_commands.py and test_cli_errors.py."""

import dataclasses
import json
import re
import tomllib

import pytest

from deploy.cli import main
from deploy.config_list import field_docs, render, sections
from protocol.config import load_config
from protocol.messages import PROTOCOL_VERSION
from tests.conftest import ROOT

DEMO = str(ROOT / "configs" / "demo.toml")


pytestmark = pytest.mark.usefixtures("keep_logging")  # the commands set up structlog process-wide


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def tracebacks(log) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "fleetrl.error"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"fleetrl 0.1.0 (wire protocol {PROTOCOL_VERSION})\n"


def test_config_list_documents_every_field(tmp_path, capsys):
    docs = field_docs()
    every = [(name, f.name) for name, cls in sections() for f in dataclasses.fields(cls)]
    assert [(d.section, d.name) for d in docs] == every and len(every) > 100
    undocumented = [f"{d.section}.{d.name}" for d in docs if not d.doc or not all(d.doc)]
    assert not undocumented
    by_name = {f"{d.section}.{d.name}": d for d in docs}
    assert by_name["train.lr"].doc == ["AdamW peak learning rate"]
    assert by_name["actor.cpu_gemm"].doc[0] == "How the CPU build runs linear layers (no effect on GPUs):"  # a block above
    assert by_name["rollout.stop"].doc[0].startswith("stop strings")  # a comment after a default_factory
    # The listing is a TOML file of the defaults: loaded back, it is the default config.
    assert main(["config", "--list"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "listed.toml").write_text(text)
    assert load_config(tmp_path / "listed.toml") == load_config()
    assert "lr = 0.0005  # AdamW peak learning rate" in text.splitlines()
    assert render("log.wandb").splitlines() == [
        "[log]",
        "# What the learner records beside metrics.jsonl: sample completions, and Weights & Biases (learner/record/metrics.py).",
        "wandb = false  # also send each metrics row to Weights & Biases (needs `pip install 'fleetrl[wandb]'`)",
        'wandb_project = "fleetrl"  # W&B project',
        'wandb_run_name = ""  # W&B run name ("" = the run directory\'s name)',
        'wandb_mode = "online"  # online | offline: write RUN_DIR/wandb only, no network (`wandb sync` uploads it later)',
    ]


def test_config_resolved(capsys):
    assert main(["config", DEMO, "train.lr=0.01"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["train"]["lr"] == 0.01


def test_plan_takes_config_like_the_other_commands(capsys):
    assert main(["plan", DEMO, "train.total_steps=7"]) == 0
    positional = capsys.readouterr().out
    assert main(["plan", "--config", DEMO, "train.total_steps=7"]) == 0
    assert capsys.readouterr().out == positional and re.search(r"\n  updates +7  rollout batches \(train.total_steps\)\n", positional)
    assert main(["plan", "train.total_steps=7", "--config", DEMO]) == 0
    assert capsys.readouterr().out == positional


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


def test_model_folder_without_tokenizer(tmp_path, plain_model_dir, capsys):
    """transformers loads such a folder as a one-token tokenizer; the run then failed with 'tokenizes to no tokens'."""
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((plain_model_dir / name).read_bytes())
    assert main(["check", DEMO, f"run.dir={tmp_path}", f"model.path={folder}"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"fleetrl: config error: model.path: {folder} has no tokenizer (tokenizer.json / tokenizer.model / vocab.json / "
        "spiece.model / vocab.txt); save the model's tokenizer there too: "
        f"AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained('{folder}')"
    )
    (folder / "config.json").unlink()
    assert main(["check", DEMO, f"run.dir={tmp_path}", f"model.path={folder}"]) == 2
    assert "has no config.json, so it is not a Hugging Face model folder" in one_line(capsys.readouterr().err)


def test_reward_import_errors(tmp_path, plain_model_dir, capsys, monkeypatch):
    run, base = tmp_path / "run", ["actor", "--learner", "tcp://127.0.0.1:5555", "--config", DEMO, "--id", "a1"]
    overrides = [f"run.dir={run}", f"model.path={plain_model_dir}"]
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


def test_usage_errors(capsys):
    assert main(["check"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "fleetrl check: a config file is required: fleetrl check CONFIG [section.field=value ...] (or --config CONFIG)"
    )
    assert main(["plan", "train.lr=0.1"]) == 2  # an override where the file should be
    assert one_line(capsys.readouterr().err).startswith("fleetrl plan: a config file is required")


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
    assert collect(errors) == ([f"fleetrl learner: rank 1: RuntimeError: peer gone; traceback in {tmp_path / 'r1.jsonl'}"], False, {1})
    for rank in ("0", "2"):
        monkeypatch.setenv("RANK", rank)
        assert report("learner", raised(ConfigError("data.path: x not found")), None) == 2
    assert capsys.readouterr().err == ""
    assert collect(errors) == (["fleetrl: config error: data.path: x not found"], True, {0, 1, 2})


# What gloo's TCP pair raises in a collective whose peer rank was SIGKILLed (a Slurm job's learner on two nodes),
# raised again while the rank's stop ran a second collective.
GLOO_PEER_GONE = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.213.229.2]:53931: Connection reset by "
    "peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def test_a_rank_that_lost_a_peer_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """Rank 0's collective fails because rank 1 was killed: that is rank 1's story (the launcher names it), so rank 0
    shows one line and keeps its traceback to its log file; a bug of rank 0's own still shows its traceback."""
    from deploy.errors import ERROR_DIR, launcher_lines, peer_gone, report

    def raised_while_handling(first, second):
        try:
            try:
                raise first
            except RuntimeError:
                raise second  # noqa: B904 (implicitly chained, as the learner's stop did)
        except Exception as caught:
            return caught

    lost = raised_while_handling(RuntimeError(GLOO_PEER_GONE), RuntimeError(GLOO_PEER_GONE))
    assert peer_gone(lost) and peer_gone(raised_while_handling(RuntimeError(GLOO_PEER_GONE), RuntimeError("scatter")))
    assert not peer_gone(raised_while_handling(RuntimeError("boom"), RuntimeError("bang")))
    assert not peer_gone(raised_while_handling(RuntimeError(GLOO_PEER_GONE), KeyError("step")))  # a bug, while handling
    assert not peer_gone(BrokenPipeError(32, "Broken pipe"))  # this process's own pipe, not a collective's

    errors = tmp_path / "errors"
    errors.mkdir()
    monkeypatch.setenv(ERROR_DIR, str(errors))
    monkeypatch.setenv("RANK", "0")
    log = tmp_path / "learner.jsonl"
    assert report("learner", lost, log) == 1
    assert capsys.readouterr().err == ""  # no traceback on the screen: it is in the log file
    assert tracebacks(log)[-1]["error"].endswith("This is typically caused by a remote worker hanging or bugs in the application.")
    said = f"fleetrl learner: rank 0: lost a peer rank in a collective (RuntimeError: {GLOO_PEER_GONE}); traceback in {log}"
    died = "fleetrl learner: rank 1 died (signal SIGKILL) without an error; see its log in RUN_DIR/logs"
    # The cause first, then what followed from it; a stopped launcher (srun ending the step) still says the latter.
    assert launcher_lines(errors, {0: "exit code 1", 1: "signal SIGKILL"}) == ([died, said], False)
    assert launcher_lines(errors, {}) == ([said], False)
    # torchrun stopped rank 2 (SIGTERM) once rank 1 had died: not a cause. With no line from any rank, it is named.
    assert launcher_lines(errors, {1: "signal SIGKILL", 2: "signal SIGTERM"}) == ([died, said], False)
    assert launcher_lines(tmp_path, {2: "signal SIGTERM"})[0] == [died.replace("rank 1", "rank 2").replace("SIGKILL", "SIGTERM")]

    assert report("learner", raised_while_handling(RuntimeError("boom"), RuntimeError("bang")), log) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err  # a bug of its own: on the screen too


def test_demo_checks_before_starting_anything(tmp_path, plain_model_dir, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1=", "answer": "2"}\n')
    assert main(["demo", f"run.dir={tmp_path / 'run'}", f"model.path={plain_model_dir}", "data.task=file", f"data.path={rows}"]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"fleetrl: config error: data.path: {rows}: no columns 'prompt'")
    assert not (tmp_path / "run" / "config.toml").exists()  # no learner, no actor: nothing was started
    assert tracebacks(tmp_path / "run" / "logs" / "launcher.jsonl")[0]["command"] == "demo"
