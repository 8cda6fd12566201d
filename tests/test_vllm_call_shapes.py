"""Every queue call vLLM 0.33.0's executor and ``parallel_state`` make,
against vLLM's own ``MessageQueue`` and fastmq alike, across two nodes.

The same script (``_call_shapes``) runs with vLLM's class
(``FASTMQ_VLLM=0``) and with fastmq's (the import hook, as in a
deployment): rank 0 on this node, rank 1 on a second node (its own
``/dev/shm``, see ``_nodes``), a gloo group over 127.0.0.1.  Whatever vLLM's
queue accepts, fastmq must accept; what fastmq refuses, vLLM's queue must
break on too.
"""
from __future__ import annotations

import json

import pytest

import _nodes

IMPLS = {"vllm": ("0", "vllm.distributed.device_communicators.shm_broadcast"),
         "fastmq": ("1", "fastmq.queue")}
UNSET = ("FASTMQ_VLLM", "VLLM_PLUGINS", "FASTMQ_ARENA", "FASTMQ_MAX_CHUNK_MB",
         "FASTMQ_MAX_CHUNKS", "VLLM_MQ_MAX_CHUNK_BYTES_MB")

pytestmark = pytest.mark.skipif(not _nodes.can_unshare(),
                                reason="a second node needs unshare -m (root)")


def _result(node: _nodes.Node) -> dict:
    lines = [ln for ln in node.output().splitlines() if ln.startswith("RESULT ")]
    assert lines, node.output()[-6000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module", params=sorted(IMPLS))
def run(request, tmp_path_factory):
    """Both ranks of ``_call_shapes`` with one implementation; their results."""
    impl = request.param
    flag, _ = IMPLS[impl]
    port = _nodes.free_port()
    nodes = []
    try:
        for rank in (0, 1):
            tmp = tmp_path_factory.mktemp(f"{impl}-node{rank}")
            env = _nodes.node_env(str(tmp), FASTMQ_VLLM=flag, VLLM_TARGET_DEVICE="cpu")
            for k in UNSET:
                if k != "FASTMQ_VLLM":
                    env.pop(k, None)
            nodes.append(_nodes.Node(f"import _call_shapes as c; c.main({rank}, {port})", env,
                                     str(tmp / "log"), own_shm=rank == 1, cwd=str(tmp)))
        for node in nodes:
            rc = node.wait(300)
            assert rc == 0, f"node exited with {rc}:\n{node.output()[-6000:]}"
        return impl, [_result(n) for n in nodes]
    finally:
        for node in nodes:
            node.kill()


def test_the_class_in_use_is_the_one_asked_for(run):
    impl, results = run
    assert [r["class"] for r in results] == [IMPLS[impl][1]] * 2


def test_executor_and_group_call_shapes_deliver_every_message(run):
    """MessageQueue(1, 1) + create_from_handle(h, 0); create_mq_broadcaster
    (blocking, rank 1 remote); the multi-node executor's scheduler broadcast
    joined with external_writer_handle and blocking=False; and
    create_single_reader_mq_broadcasters, whose remote handle the engine
    attaches with create_from_handle(h, -1).  The workers take the
    scheduler's messages with dequeue(indefinite=True), a large in-band one
    among them (unpickled by fastmq's remote worker as it arrives)."""
    _, (r0, r1) = run
    assert r0["single_node_response"] == [True] * 3
    assert r0["group_broadcast"] == r1["group_broadcast"] == [True] * 3
    assert r1["group_broadcast_remote"] is True
    assert r1["rpc_remote"] is True
    assert r0["peer_handles_remote"] == [False, True]
    assert r0["executor_round_trips"] == [True] * 4
    assert r0["large_path"] == ([0, 1] if run[0] == "fastmq" else [None, None])


def test_ranks_not_listed_as_local_are_remote_readers(run):
    """On a queue with a remote reader, every rank not in
    local_reader_ranks attaches as a remote reader, -1 included."""
    _, (r0, _) = run
    assert r0["refusals"]["mixed"] == {"-1": "remote", "1": "remote", "2": "remote",
                                       "5": "remote", "99": "remote"}


def test_what_fastmq_refuses_breaks_vllms_queue_too(run):
    """On a queue with no remote readers, a rank that is not an integer or
    not listed has nothing to attach to: vLLM's queue fails (connecting to
    ``None``), fastmq raises ValueError naming the rank and the valid ones."""
    impl, (r0, _) = run
    got = r0["refusals"]["local_only"]
    assert sorted(got) == sorted(["None", "'0'", "1.5", "2", "5", "-1"])
    for rank, outcome in got.items():
        assert outcome != "attached", (rank, outcome)
        if impl == "fastmq":
            assert outcome.startswith("ValueError: fastmq: reader rank "), outcome
            assert "local reader ranks [0, 1]" in outcome, outcome
