"""The README's GPU install, as written, against PyPI: `pip install --dry-run --report` of each documented command.

- every step but flash-attn's installs from wheels (`--only-binary :all:`), the `gpu` extra included, and vLLM's
  wheel pins the torch this project pins;
- flash-attn is a source archive whose build imports torch: it resolves with `--no-build-isolation` (torch taken
  from this environment) and fails without it, which is why the README says so.
`--no-deps` keeps it quick: each command's own packages are the point. pip runs `--isolated`, against PyPI alone,
so this machine's pip configuration (local wheel folders, constraints) cannot stand in for the index.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT

pytestmark = pytest.mark.network
INDEX = "https://pypi.org/simple"


def _pip(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "--timeout", "20", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def index():
    probe = _pip("index", "versions", "ring-flash-attn", "--retries", "0", "--index-url", INDEX)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no answer"])[-1][:200]
        pytest.skip(f"PyPI unreachable ({INDEX}): pip index versions ring-flash-attn said {why!r}")


def documented() -> list[tuple[dict[str, str], list[str]]]:
    """The README's GPU install: (environment assignments, pip install arguments) of each `pip install` line."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("**GPU.**") :].split("```bash\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if ".venv/bin/pip" not in words:
            continue
        at = words.index(".venv/bin/pip")
        assert words[at + 1] == "install", line
        env = dict(w.split("=", 1) for w in words[:at])
        out.append((env, words[at + 2 :]))
    return out


def resolve(*args: str, env: dict[str, str] | None = None, report: str) -> dict[str, dict]:
    """name -> pip's report entry for what `pip install ARGS` would install (nothing is installed)."""
    proc = _pip("install", "--dry-run", "--no-deps", "--ignore-installed", "--index-url", INDEX, "--report", report, *args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = json.loads(open(report).read())["install"]
    return {re.sub(r"[-_.]+", "-", e["metadata"]["name"]).lower(): e for e in entries}


def _pins() -> tuple[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [d for d in project["dependencies"] if d.startswith("torch")]
    return torch, project["optional-dependencies"]["gpu"]


def test_the_documented_gpu_install_resolves(index, tmp_path):
    torch_pin, gpu_extra = _pins()
    steps = documented()
    wheels: list[str] = []
    source: list[tuple[dict[str, str], list[str]]] = []
    for env, args in steps:
        if args[:2] == ["-e", ".[gpu,dev]"]:
            wheels += gpu_extra  # the extra's own requirements (the project itself is pure Python)
        elif "--no-build-isolation" in args:
            source.append((env, args))
        else:
            wheels += args
    assert torch_pin in wheels and "vllm==0.32.0" in gpu_extra, (wheels, gpu_extra)
    assert not any("flash" in r for r in gpu_extra), f"the gpu extra must install from wheels: {gpu_extra}"

    got = resolve("--only-binary", ":all:", *wheels, report=str(tmp_path / "wheels.json"))
    assert set(got) >= {"torch", "vllm", "ring-flash-attn", "ninja", "psutil"}, sorted(got)
    for name, e in got.items():
        assert e["download_info"]["url"].endswith(".whl"), (name, e["download_info"]["url"])
    assert got["torch"]["metadata"]["version"] == torch_pin.split("==")[1]  # PyPI's build: no +cpu
    assert any(d.startswith(("nvidia-", "cuda-")) for d in got["torch"]["metadata"]["requires_dist"]), "not the CUDA build"
    assert torch_pin in got["vllm"]["metadata"]["requires_dist"], "vLLM's wheel pins another torch"
    assert got["ring-flash-attn"]["download_info"]["url"].endswith("-py3-none-any.whl")

    (env, args), *rest = source
    assert not rest and env.get("MAX_JOBS", "").isdigit(), source
    (flash,) = [a for a in args if a.startswith("flash-attn")]
    # Its metadata step needs CUDA_HOME unless told it will not compile; only the dry run here is told so.
    no_cuda = {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
    got = resolve(*args, env={**env, **no_cuda}, report=str(tmp_path / "flash.json"))
    assert set(got) == {"flash-attn"} and got["flash-attn"]["metadata"]["version"] == flash.split("==")[1]
    assert got["flash-attn"]["download_info"]["url"].endswith(".tar.gz"), "a wheel on PyPI now: the README's step can go"
    isolated = [a for a in args if a != "--no-build-isolation"]
    proc = _pip("install", "--dry-run", "--no-deps", "--index-url", INDEX, *isolated, env=no_cuda)
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr, proc.stderr[-2000:]
