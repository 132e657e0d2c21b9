"""The typed messages of the actor's collective_rpc calls into its vLLM workers (protocol/worker_rpc.py): they
survive each hop as vLLM makes it, and what arrives malformed is refused by name. The real engine carries them in
tests/integration/test_weight_sync.py, with the worker in the engine core and in a process of its own."""

import dataclasses
import pickle

import pytest

from actors.engine import merge_results
from protocol.messages import ProtocolError, WeightSync
from protocol.worker_rpc import GemmLayers, ReceiveWeights, WeightsReceived, arrived

SYNC = WeightSync(
    policy_version=3,
    group_epoch=2,
    store_host="10.0.0.1",
    store_port=29500,
    rank=1,
    ranks=2,
    world_size=3,
    backend="gloo",
    timeout_s=30.0,
    names=["a.weight", "b.bias"],
    shapes=[[4, 8], [8]],
    dtype="bfloat16",
    bucket_bytes=1 << 20,
)
OK = WeightsReceived(join_s=0.5, recv_load_s=1.5, repacked=4, repack_s=0.01)
TORN = WeightsReceived.failure("peer gone", 3, 0.5)


@pytest.mark.vllm
def test_each_hop_of_vllm_delivers_what_was_sent():
    """actor -> engine core: vLLM's MsgpackEncoder of a utility call, decoded untyped as the engine core does
    (vllm/v1/engine/core.py); engine core -> worker process and back: pickle (its shared-memory MessageQueue);
    engine core -> actor: the utility result inside EngineCoreOutputs, decoded as AsyncMPClient does."""
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    request = ReceiveWeights(sync=SYNC, leave_group=True)
    encoder = MsgpackEncoder()
    _, _, method, (rpc, _, args, _) = MsgpackDecoder().decode(
        encoder.encode((0, 7, "collective_rpc", ("fleetrl_receive", 60.0, (request,), None)))
    )
    assert (method, rpc) == ("collective_rpc", "fleetrl_receive")
    (sent,) = args
    assert type(sent) is dict  # what the worker gets: the map of its fields, not the dataclass
    assert arrived(ReceiveWeights, sent) == request
    assert arrived(ReceiveWeights, pickle.loads(pickle.dumps(sent))) == request  # on to a worker process
    for answers in ([OK, TORN], [GemmLayers(plain=3, packed=0)]):
        in_core = pickle.loads(pickle.dumps(answers))  # a worker process's answers reach the engine core as they were
        assert in_core == answers
        out = EngineCoreOutputs(utility_output=UtilityOutput(call_id=7, result=UtilityResult(in_core)))
        result = MsgpackDecoder(EngineCoreOutputs).decode(encoder.encode(out)).utility_output.result.result
        assert all(type(r) is dict for r in result)
        assert [arrived(type(a), r) for a, r in zip(answers, result, strict=True)] == answers


def test_what_arrives_malformed_is_refused_by_name():
    fields = {"sync": {f.name: getattr(SYNC, f.name) for f in dataclasses.fields(SYNC)}, "leave_group": False}
    assert arrived(ReceiveWeights, fields) == ReceiveWeights(sync=SYNC)
    with pytest.raises(ProtocolError, match=r"^ReceiveWeights.sync.store_port: expected int, got str"):
        arrived(ReceiveWeights, {**fields, "sync": {**fields["sync"], "store_port": "29500"}})
    with pytest.raises(ProtocolError, match=r"^ReceiveWeights.sync.shapes\[1\]\[0\]: expected int, got float"):
        arrived(ReceiveWeights, {**fields, "sync": {**fields["sync"], "shapes": [[4, 8], [8.0]]}})
    with pytest.raises(ProtocolError, match=r"^ReceiveWeights.leave_group: expected bool, got int"):
        arrived(ReceiveWeights, {**fields, "leave_group": 1})
    with pytest.raises(ProtocolError, match=r"missing field\(s\) \['leave_group'\], unknown field\(s\) \['leave'\]"):
        arrived(ReceiveWeights, {"sync": fields["sync"], "leave": True})
    with pytest.raises(ProtocolError, match=r"^ReceiveWeights.sync: expected WeightSync or the map of its fields, got list"):
        arrived(ReceiveWeights, {**fields, "sync": []})
    with pytest.raises(ProtocolError, match=r"WeightSync.rank"):  # the message's own check() runs too
        arrived(ReceiveWeights, {**fields, "sync": {**fields["sync"], "rank": 0}})
    answer = {
        "join_s": 1,
        "recv_load_s": 0.5,
        "repacked": 0,
        "repack_s": 0.0,
        "error": None,
        "buckets_loaded": None,
        "failed_after_s": None,
    }
    assert arrived(WeightsReceived, answer).join_s == 1.0  # msgpack may carry a whole float as an int
    with pytest.raises(ProtocolError, match=r"error, buckets_loaded and failed_after_s are set together"):
        arrived(WeightsReceived, {**answer, "error": "peer gone"})


def test_worker_answers_merge_into_one_report():
    """The slowest worker's times; one torn worker makes the engine torn (it holds parts of two versions)."""
    merged = merge_results([OK, WeightsReceived(join_s=3.0, recv_load_s=1.0, repacked=4, repack_s=0.02)])
    assert merged == WeightsReceived(join_s=3.0, recv_load_s=1.5, repacked=4, repack_s=0.02) and not merged.failed
    assert merged.log_fields() == {"join_s": 3.0, "recv_load_s": 1.5, "repacked": 4, "repack_s": 0.02}
    torn = merge_results([OK, TORN, WeightsReceived.failure("timeout", 0, 2.0)])
    assert torn.failed and torn.torn
    assert torn.log_fields() == {"error": "peer gone; timeout", "buckets_loaded": 3, "failed_after_s": 2.0}
    clean_failure = merge_results([OK, WeightsReceived.failure("timeout", 0, 2.0)])
    assert clean_failure.failed and not clean_failure.torn  # nothing loaded: the engine may resume on the old weights
