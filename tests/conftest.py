import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    # The Slurm module, the longest file (4-5 minutes), first: make test's other worker (pytest-xdist, --dist
    # loadfile, --no-loadscope-reorder) takes the rest meanwhile. Measured no faster than xdist's own order
    # (docs/testing.md), but the same on every run.
    items.sort(key=lambda item: "tests/slurm/" not in item.nodeid)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    vllm_missing: list[str | None] = []  # imported once, and only if a `vllm` test would otherwise run (it takes seconds)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
        elif "vllm" in item.keywords:
            if not vllm_missing:
                vllm_missing.append(_vllm_import_error())
            if vllm_missing[0] is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs vLLM (its CUDA build for `gpu` tests): {vllm_missing[0]}"))


def _vllm_import_error() -> str | None:
    """Why vLLM cannot be imported here, or None. Its CUDA build is missing where the GPU tests run now
    (../shared/gpu/notes.md): `vllm` tests skip there and run wherever it is installed."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return str(e)
    except RuntimeError as e:  # an install that does not match torch (e.g. "operator torchvision::nms does not exist")
        return f"installed but broken: {e}"
    return None


# torch.distributed's rendezvous variables. A test that builds a DeepSpeed engine in the pytest process
# (learner/distributed.init_distributed, DeepSpeed itself) writes them into os.environ. Left there, every
# learner a later test starts as a subprocess inherits RANK and that MASTER_PORT, takes itself for a
# torchrun rank, and fails to listen on a port the pytest process holds (EADDRINUSE). GLOO_SOCKET_IFNAME too
# (learner/train/distributed.bind_gloo_towards_master): a leaked "lo" made a later Slurm job's learner group, two
# nodes, bind to loopback and fail to connect.
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


@pytest.fixture(autouse=True)
def _no_log_context_leaks():
    """The log context (role, actor_id, policy_version) is process-wide: what one test sets, the next must not see."""
    from protocol import logs

    before = dict(logs._CONTEXT)
    yield
    logs._CONTEXT.clear()
    logs._CONTEXT.update(before)


def _restoring_rendezvous():
    before = {k: os.environ.get(k) for k in _RENDEZVOUS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# Per test, and per module: a module fixture's engine (test_step_failures' DeepSpeed trainer) is built before any
# test's own guard reads the environment, so only the module's guard, set up first, sees it clean. Without it
# the variables outlived the module, and under pytest-xdist (make test) a later module's learners on the same
# worker failed with EADDRINUSE.
@pytest.fixture(autouse=True)
def _no_rendezvous_leaks():
    yield from _restoring_rendezvous()


@pytest.fixture(autouse=True, scope="module")
def _no_rendezvous_leaks_from_the_module():
    yield from _restoring_rendezvous()


def rollout_group(n=3, prompt_len=4, version=0, seed=0, actor="a0", prompt_id=7, epoch=0, prompt_tokens=None):
    """A well-formed group: completions of 1..4 tokens (rollout.max_tokens' default), ids < 20, logprobs in (-1, 0].
    The hub admits it only with the granted prompt's tokens as `prompt_tokens` (a grant's)."""
    from protocol.messages import RolloutGroup

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, size=n).astype(np.int32)
    total = int(lengths.sum())
    random_prompt = rng.integers(0, 20, size=prompt_len).astype(np.int32)
    return RolloutGroup(
        actor_id=actor,
        prompt_id=prompt_id,
        epoch=epoch,
        prompt_tokens=random_prompt if prompt_tokens is None else np.asarray(prompt_tokens, np.int32),
        lengths=lengths,
        completion_tokens=rng.integers(0, 20, size=total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        rewards=rng.random(n).astype(np.float32),
        finish_reasons=["stop"] * n,
        version_min=version,
        version_max=version,
        gen_s=0.5,
        reward_s=0.01,
    )


def sample_messages() -> list:
    """One well-formed message of each type an actor and the hub exchange, with values off their defaults: the
    codec's round trips (tests/unit/test_codec.py) and the decoder's fuzzing (tests/unit/test_decoder_fuzz.py)."""
    from protocol import messages as m

    prompt = np.arange(1, 5, dtype=np.int32)
    return [
        m.Register(actor_id="a", host="h", pid=1, served_version=0, devices=["cuda:GPU-1", ""]),
        m.RegisterAck(actor_id="a", policy_version=3, heartbeat_s=2.0),
        m.Heartbeat(actor_id="a", served_version=2, groups_in_flight=4),
        m.WorkRequest(actor_id="a", max_prompts=8),
        m.WorkGrant(prompt_id=5, epoch=1, prompt_tokens=prompt, answer="7", policy_version=2, lease_s=60.0),
        rollout_group(n=3),
        m.EvalGrant(
            eval_round=2,
            split="val",
            prompt_id=5,
            prompt_tokens=prompt.copy(),
            answer="25",
            policy_version=7,
            n=3,
            temperature=0.7,
            seed=4_000_000_000,
            lease_s=60.0,
        ),
        m.EvalResult(
            actor_id="a",
            eval_round=2,
            split="test",
            prompt_id=5,
            lengths=np.array([1, 2, 3], np.int32),
            rewards=np.array([1, 0, 1], np.float32),
            finish_reasons=["stop"] * 3,
            version_min=7,
            version_max=7,
            gen_s=0.1,
        ),
        m.WeightSync(
            policy_version=1,
            group_epoch=2,
            store_host="127.0.0.1",
            store_port=1234,
            rank=1,
            ranks=2,
            world_size=3,
            backend="nccl",
            timeout_s=30.0,
            names=["w", "b"],
            shapes=[[2, 3], [3]],
            dtype="float32",
            bucket_bytes=1 << 20,
        ),
        m.WeightVersion(actor_id="a", served_version=1, group_epoch=2, load_s=0.1),
        m.Error(code="protocol", detail="x"),
        m.Shutdown(reason="done"),
    ]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A warm-started demo model built once per test session (shared with the demo's cache when present)."""
    from deploy.launch import demo_model
    from protocol.config import load_config

    os.environ.setdefault("FLEETRL_CACHE", str(ROOT / ".cache"))
    return demo_model(load_config())


@pytest.fixture
def keep_logging():
    """The CLI's commands set up structlog process-wide (`check` at warning level): later tests get it back as it was."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def plain_model_dir(tmp_path_factory):
    """A randomly initialised tiny model folder (weights and tokenizer), in seconds: for tests that need a model
    folder but not the demo's warm-started policy (tiny_model_dir, which trains one the first time)."""
    from deploy.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("plain-model"))


@pytest.fixture
def start_hub():
    """`start_hub(*overrides, prompts=None, control_file=None)`: a real Hub, started on a free loopback port
    (`hub.cfg.hub.bind` is its address) over the addition prompts unless `prompts` is given; every hub a test
    starts is stopped at its end."""
    from deploy.tiny import build_tokenizer
    from learner.data.prompts import PromptSet, addition_items
    from learner.hub.server import Hub
    from protocol.config import load_config
    from protocol.net import free_port

    hubs = []

    def start(*overrides, prompts=None, control_file=None):
        cfg = load_config(None, [f"hub.bind=tcp://127.0.0.1:{free_port()}", *overrides])
        hub = Hub(cfg, prompts if prompts is not None else PromptSet(addition_items(), build_tokenizer()), control_file=control_file)
        hubs.append(hub)
        hub.start()
        return hub

    yield start
    for hub in hubs:
        hub.stop()


# torchrun_driver's default limit per run. On a GPU: the tiny model's run, twice in one test (a module fixture's and
# the test's own), must fit the GPU check's 150 s per test (../shared/gpu/check.sh), so a hang is reported here and
# not by pytest-timeout. On the CPU: a multi-rank run on 2 loaded cores, well inside a 10-minute run.
TORCHRUN_LIMIT_S = {"cuda": 70.0, "cpu": 300.0}


def torchrun_driver(driver: str, nproc: int, out: Path, *args: str, accelerator: str = "cpu", timeout: float | None = None) -> dict:
    """Run tests/drivers/`driver` as `nproc` learner ranks under torchrun (a free rendezvous port) and return the
    JSON it wrote to `out`; a failed run fails the test with the end of its stderr, one out of time (`timeout`,
    default TORCHRUN_LIMIT_S) with one line naming the driver and the limit, its ranks killed with it."""
    import json

    from deploy.procs import run_capped
    from protocol.net import free_port

    limit = TORCHRUN_LIMIT_S[accelerator] if timeout is None else timeout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           str(ROOT / "tests" / "drivers" / driver), *args]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": accelerator, "HF_HUB_OFFLINE": "1"}
    if accelerator == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    proc = run_capped(cmd, limit, env=env)
    if proc.returncode is None:
        pytest.fail(f"torchrun {driver} ({nproc} ranks, {accelerator}): out of time, no result within {limit:g} s\n{proc.stderr[-3000:]}")
    if proc.returncode != 0 and out.exists() and GLOO_TEARDOWN_ABORT in proc.stderr:
        # The drivers write their result, then every rank passes a barrier: all of them finished. gloo, now and then,
        # aborts a finished rank as its process ends (learner/train/distributed.py): not what these tests are about.
        print(f"torchrun {driver}: a rank aborted in its teardown after the run finished (exit {proc.returncode})")
        return json.loads(out.read_text())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


# ---- processes and waits shared by the process-level tests ----------------------------------------------------
def alive(p) -> bool:
    """psutil.Process `p` runs (a zombie is dead, waiting for its parent to reap it)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def command(p) -> str:
    """psutil.Process `p`'s name and command line; "" for one that has ended (a zombie has none: psutil raises)."""
    import psutil

    try:
        return p.name() + " " + " ".join(p.cmdline())
    except psutil.Error:
        return ""


def settled(read, what: str, quiet_s: float, timeout_s: float = 10.0):
    """`read()` once it has not changed for `quiet_s` (what was in flight has landed); fails the test, saying `what`
    kept changing, after `timeout_s`."""
    import time

    deadline, last, since = time.monotonic() + timeout_s, read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"{what} kept changing for {timeout_s} s"
        time.sleep(0.05)
        if (now := read()) != last:
            last, since = now, time.monotonic()
    return last


def wait_until(cond, what, timeout_s: float = 60.0, every_s: float = 0.05):
    """`cond()`'s first true value, polled every `every_s`; fails the test after `timeout_s`, saying `what` (a string,
    or a callable read at that moment, so that it tells the state at the deadline)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(every_s)
    return value


def unserved_sync(store_port: int, epoch: int = 1, timeout_s: float = 60.0):
    """A WeightSync into group `epoch` of the rendezvous on 127.0.0.1:`store_port`, whose rank 0 never comes: the
    engine's worker joins it and waits in the receive for `timeout_s`."""
    from protocol import messages as m

    return m.WeightSync(
        policy_version=1,
        group_epoch=epoch,
        store_host="127.0.0.1",
        store_port=store_port,
        rank=1,
        ranks=1,
        world_size=2,
        backend="gloo",
        timeout_s=timeout_s,
        names=["w"],
        shapes=[[4]],
        dtype="float32",
        bucket_bytes=1 << 20,
    )
