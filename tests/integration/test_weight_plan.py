"""Which backend and device a weight group uses, and who holds which ranks: decided once, by the learner.

CPU-checkable pieces of the GPU weight path: the decision for every case (all CPU; every rank on a GPU
of its own; a GPU shared between the learner and an actor, or two actors; tensor-parallel members), the
messages that carry it, the actor's engine settings on CUDA, and a tensor-parallel member's ranks end
to end over a real gloo group, through the worker extension vLLM's workers run.
"""

import dataclasses
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from protocol import messages as m
from protocol import weights as wg
from protocol.config import ConfigError, load_config
from protocol.worker_rpc import ReceiveWeights, WeightsReceived
from tests.fake_hub import RecordingHub

A, B, L = "cuda:GPU-aaaa", "cuda:GPU-bbbb", "cuda:GPU-1111"  # device identities: two actors' GPUs, the learner's


def test_all_cpu_is_gloo_and_no_fallback():
    plan = wg.plan_group(wg.CPU, [("a", [""]), ("b", [""])])
    assert (plan.backend, plan.world_size, plan.first, plan.counts, plan.fallback) == ("gloo", 3, (1, 2), (1, 1), "")
    assert wg.group_device(plan.backend, torch.device("cpu")) == torch.device("cpu")


def test_distinct_gpus_are_nccl_on_each_ranks_gpu():
    plan = wg.plan_group(L, [("a", [A]), ("b", [B])])
    assert (plan.backend, plan.world_size, plan.fallback) == ("nccl", 3, "")
    here = torch.device("cuda", 1)
    assert wg.group_device("nccl", here) == here  # each rank's own GPU, never the CPU: NCCL refuses host tensors
    with pytest.raises(RuntimeError, match="NCCL but this rank has no GPU"):
        wg.group_device("nccl", torch.device("cpu"))


def test_learner_and_actor_on_one_gpu_fall_back_to_gloo():
    plan = wg.plan_group(L, [("a", [L]), ("b", [B])])
    assert plan.backend == "gloo" and plan.world_size == 3
    assert "the learner and a share GPU " + L in plan.fallback
    assert wg.group_device(plan.backend, torch.device("cuda", 0)) == torch.device("cpu")  # host memory, pinned beside a GPU


def test_two_actors_on_one_gpu_fall_back_to_gloo():
    plan = wg.plan_group(L, [("a", [A]), ("b", [A])])
    assert plan.backend == "gloo" and "a and b share GPU " + A in plan.fallback


def test_gpus_mixed_with_cpus_are_gloo_and_say_so():
    assert wg.plan_group(L, [("a", [""])]).fallback == "1 of 2 ranks are on the CPU"
    plan = wg.plan_group(wg.CPU, [("a", [A])])  # a CPU learner feeding a GPU actor: its worker receives in host memory
    assert plan.backend == "gloo" and plan.fallback == "1 of 2 ranks are on the CPU"


def test_tensor_parallel_members_hold_consecutive_ranks():
    plan = wg.plan_group(L, [("tp4", [A, B, "cuda:GPU-c", "cuda:GPU-d"]), ("solo", ["cuda:GPU-e"]), ("tp2", ["cuda:GPU-f", "cuda:GPU-g"])])
    assert plan.backend == "nccl" and plan.world_size == 8
    assert plan.first == (1, 5, 6) and plan.counts == (4, 1, 2)
    shared = wg.plan_group(L, [("tp2", [A, B]), ("other", [B])])  # one worker's GPU is another actor's
    assert shared.backend == "gloo" and "tp2 worker 1 and other share GPU " + B in shared.fallback


def test_a_large_gloo_group_connects_lazily_and_nccl_never_does():
    cpu = [(f"a{i}", [""]) for i in range(40)]
    assert not wg.plan_group(wg.CPU, cpu[:31]).lazy  # 32 ranks: every pair, as before
    assert wg.plan_group(wg.CPU, cpu[:32]).lazy  # 33 ranks (the default weights.gloo_mesh_ranks is 32)
    assert not wg.plan_group(wg.CPU, cpu, mesh_ranks=41).lazy and wg.plan_group(wg.CPU, cpu[:1], mesh_ranks=0).lazy
    gpus = [(f"g{i}", [f"cuda:GPU-{i}"]) for i in range(40)]
    assert not wg.plan_group(L, gpus, mesh_ranks=0).lazy  # NCCL connects its own rings and trees


def _rank_threads(port: int, ranks: list[int], size: int, lazy: bool, out) -> None:
    """Ranks of one gloo group, a thread each: their result, and the sockets this process holds at the end."""

    got: dict[int, float] = {}
    keep = []

    def rank(r: int) -> None:
        store = wg.open_store("127.0.0.1", port, is_master=False, timeout_s=60)
        group = wg.open_group(store, "127.0.0.1", 1, r, size, 60, lazy=lazy)
        x = torch.full((1000,), 7.0 if r == 0 else -1.0)
        wg.broadcast(group, x)
        got[r] = float(x.sum())
        keep.append(group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sockets = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    out.put((got, sockets))


def _group_sockets(size: int, lazy: bool) -> int:
    import multiprocessing as mp

    spawn = mp.get_context("spawn")
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    out = spawn.Queue()
    procs = [spawn.Process(target=_rank_threads, args=(store.port, list(range(size))[i::2], size, lazy, out)) for i in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    got = {r: v for res in results for r, v in res[0].items()}
    assert got == {r: 7000.0 for r in range(size)}  # every rank holds rank 0's bytes
    return sum(res[1] for res in results)


def test_a_lazy_gloo_group_holds_only_its_broadcast_trees_connections():
    """40 ranks in 2 processes: connected every pair to every pair, the processes hold 40 x 39 sockets for the
    group; lazily, the 39 edges of gloo's binomial broadcast tree (2 sockets each) plus each rank's listener and
    store client. The broadcast delivers the same bytes either way."""
    size = 40
    mesh, lazy = _group_sockets(size, lazy=False), _group_sockets(size, lazy=True)
    assert mesh >= size * (size - 1), mesh
    assert lazy <= 2 * (size - 1) + 3 * size, lazy  # tree edges, plus a listener, a store client and slack per rank
    print(f"{size} ranks: {mesh} sockets connected every pair, {lazy} lazily")


def test_landing_buffer_for_gloo_is_host_memory():
    buf = wg.landing_buffer(10, torch.bfloat16, "gloo", torch.device("cpu"))
    assert buf.device.type == "cpu" and buf.dtype == torch.bfloat16 and buf.numel() == 10 and not buf.is_pinned()


def test_messages_carry_ranks_and_backend_and_refuse_bad_ones():
    def sync(**kw):
        base = dict(
            policy_version=1,
            group_epoch=1,
            store_host="h",
            store_port=1,
            rank=1,
            ranks=2,
            world_size=3,
            backend="nccl",
            timeout_s=1.0,
            names=[],
            shapes=[],
            dtype="float32",
            bucket_bytes=1,
        )
        return m.WeightSync(**{**base, **kw})

    sync().check()
    with pytest.raises(m.ProtocolError, match="ranks 2..3 not within 1..2"):
        sync(rank=2).check()
    with pytest.raises(m.ProtocolError, match="WeightSync.rank"):
        sync(ranks=0).check()
    with pytest.raises(m.ProtocolError, match="WeightSync.backend: 'mpi'"):
        sync(backend="mpi").check()
    reg = dict(actor_id="a", host="h", pid=1, served_version=0)
    assert m.Register(**reg).devices == [""]  # a member that says nothing is one CPU rank
    with pytest.raises(m.ProtocolError, match="Register.devices: 0 ranks"):
        m.Register(**reg, devices=[]).check()
    with pytest.raises(m.ProtocolError, match="Register.devices"):
        m.Register(**reg, devices=[""] * (m.MAX_RANKS_PER_ACTOR + 1)).check()


def test_hub_keeps_the_devices_each_actor_registered():
    import zmq

    from deploy.tiny import build_tokenizer
    from learner.data.prompts import PromptSet, addition_items
    from learner.hub.server import Hub
    from protocol.codec import decode, encode
    from protocol.net import free_port

    port = free_port()
    hub = Hub(load_config(None, [f"hub.bind=tcp://127.0.0.1:{port}"]), PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(encode(m.Register(actor_id="tp", host="h", pid=1, served_version=0, devices=[A, B])))
        assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), m.RegisterAck)
        assert hub.devices(["tp", "gone"]) == [[A, B], [""]]
    finally:
        sock.close(linger=0)
        ctx.term()
        hub.stop(tell_actors=False)


def test_engine_on_cuda_gets_gpu_arguments_and_no_cpu_knobs(monkeypatch):
    from actors.engine import engine_args, engine_env

    cfg = load_config(None, ["cluster.tensor_parallel_size=2", "actor.gpu_memory_utilization=0.5", "actor.kvcache_gib=7"])
    cpu, gpu = engine_args(cfg, on_cuda=False), engine_args(cfg, on_cuda=True)
    assert cpu["enforce_eager"] is True and "gpu_memory_utilization" not in cpu
    assert gpu["enforce_eager"] is False and gpu["gpu_memory_utilization"] == 0.5  # CUDA graphs on
    assert cpu["tensor_parallel_size"] == gpu["tensor_parallel_size"] == 2
    assert gpu["enable_prefix_caching"] is True and cpu["enable_prefix_caching"] is False  # "auto": salted, on with CUDA
    assert "block_size" not in gpu  # vLLM's choice
    off = engine_args(load_config(None, ["actor.prefix_caching=off", "actor.block_size=32"]), on_cuda=True)
    assert off["enable_prefix_caching"] is False and off["block_size"] == 32
    with pytest.raises(ConfigError, match=r"actor\.prefix_caching"):
        load_config(None, ["actor.prefix_caching=yes"])
    cpu_vars = (
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "OMP_NUM_THREADS",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "FLEETRL_CPU_GEMM",
    )
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in cpu_vars})
    engine_env(cfg, on_cuda=True)
    assert not [k for k in cpu_vars if k in os.environ]
    engine_env(cfg, on_cuda=False)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7" and all(k in os.environ for k in cpu_vars)


def test_cpu_only_fields_are_not_checked_for_a_cuda_actor():
    bad_on_cpu = ["actor.cpu_bind=auto", "actor.worker_in_engine=true", "actor.cpu_gemm=onednn"]
    assert load_config(None, ["actor.device=cuda", *bad_on_cpu]).actor.on_cuda()
    with pytest.raises(ConfigError, match=r"actor\.worker_in_engine"):
        load_config(None, ["actor.device=cpu", *bad_on_cpu])
    with pytest.raises(ConfigError, match=r"actor\.cpu_gemm"):
        load_config(None, ["actor.device=cpu", "actor.cpu_gemm=onednn"])
    with pytest.raises(ConfigError, match=r"actor\.device"):
        load_config(None, ["actor.device=tpu"])
    with pytest.raises(ConfigError, match=r"actor\.gpu_memory_utilization"):
        load_config(None, ["actor.gpu_memory_utilization=0"])
    assert load_config(None, ["actor.device=auto"]).actor.on_cuda() == torch.cuda.is_available()


class _Loaded(torch.nn.Module):
    """Stands in for vLLM's model: load_weights keeps a copy of what it is handed."""

    def __init__(self):
        super().__init__()
        self.got: dict[str, torch.Tensor] = {}

    def load_weights(self, pairs):
        self.got.update({name: t.clone() for name, t in pairs})


class _Worker:
    """The attributes of vLLM's worker that the extension reads: its rank in the engine and its model runner."""

    def __init__(self, rank: int):
        from actors.worker_ext import FleetWeightReceiver

        self.ext = type("Worker", (FleetWeightReceiver,), {})()
        self.ext.rank = rank
        self.model = _Loaded()
        self.ext.model_runner = SimpleNamespace(get_model=lambda: self.model)


def test_a_tensor_parallel_member_receives_on_every_worker_rank():
    """A two-worker engine ("tp") and a one-worker one ("zz") over real gloo: the sender gives tp ranks 1-2 and
    zz rank 3 of 4; each of tp's workers joins as its own rank (first + its vLLM rank) and gets every bucket."""
    from learner.weights.sync import WeightSender
    from protocol.config import WeightsConfig

    torch.manual_seed(0)
    named = [(f"p{i}", torch.randn(64, 64)) for i in range(6)]
    sender = WeightSender.for_params(WeightsConfig(bucket_mb=1, timeout_s=60), named, "bfloat16")
    hub = RecordingHub({"tp": ["", ""], "zz": [""]})
    workers = [_Worker(0), _Worker(1), _Worker(0)]  # before the sync: importing vLLM here may outlast its join deadline
    sender.sync(1, hub)
    by_actor = dict(zip(["tp", "zz"], hub.sent, strict=True))
    assert [(s.rank, s.ranks, s.world_size, s.backend) for s in hub.sent] == [(1, 2, 4, "gloo"), (3, 1, 4, "gloo")]
    # Worker 0 as the engine core's own (the request as vLLM's msgpack hop delivers it: the map of its fields),
    # the others as worker processes (pickle keeps the dataclass).
    requests = [
        dataclasses.asdict(ReceiveWeights(sync=by_actor["tp"])),
        ReceiveWeights(sync=by_actor["tp"]),
        ReceiveWeights(sync=by_actor["zz"]),
    ]
    results: list[WeightsReceived | None] = [None] * 3

    def run(i):
        results[i] = workers[i].ext.fleetrl_receive(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    report = sender.wait()
    assert all(r is not None and not r.failed for r in results) and "weights/failed" not in report, (results, report)
    for w in workers:
        assert list(w.model.got) == [n for n, _ in named]
        for name, p in named:
            got = w.model.got[name]
            assert got.dtype == torch.bfloat16 and got.device.type == "cpu" and torch.equal(got, p.to(torch.bfloat16)), name
    # A worker beyond the ranks its actor registered refuses instead of joining as someone else's rank.
    stray = _Worker(2).ext.fleetrl_receive(ReceiveWeights(sync=by_actor["tp"]))
    assert stray.error is not None and "outside the 2 ranks" in stray.error and stray.buckets_loaded == 0


def test_a_build_store_client_is_reused_only_once_its_build_returned():
    master = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=10)
    stores = wg.BuildStore()
    at = ("127.0.0.1", master.port, 10)
    with stores.client(*at) as first:
        with stores.client(*at) as second:  # the first is still in a build: a client of its own
            assert second is not first
    with stores.client(*at) as again:
        assert again is first  # its build returned (the last to): its client is reused
    with pytest.raises(RuntimeError), stores.client(*at) as failed:  # a build that fails keeps its client
        assert failed is first
        raise RuntimeError("the build failed")
    with stores.client(*at) as after:
        assert after is not first
    other = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=10)  # a restarted learner's store
    with stores.client("127.0.0.1", other.port, 10) as elsewhere:
        assert elsewhere is not after
    after.set("k", "v")  # the reused client works
    assert master.get("k") == b"v"
