"""Errors at the boundary: a user mistake is one line on the screen naming the field and the fix, exit 2, and its
traceback goes to the log file. Here as subprocesses for the learner's own loading (one rank, and two under torchrun)
and the hub's bind, and bad addresses (a host name looked up through the system's resolver). The errors that come
before anything starts: tests/unit/test_cli.py."""

import socket
import subprocess
import sys

import pytest

from deploy.cli import main
from protocol.net import free_port
from tests.conftest import ROOT
from tests.unit.test_cli import one_line, tracebacks

DEMO = str(ROOT / "configs" / "demo.toml")


pytestmark = pytest.mark.usefixtures("keep_logging")  # the commands set up structlog process-wide


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
