"""The idle predicate every leak check shares (router/client.py): which workers of a
GetStatus answer still hold a request, a block or a transfer."""

from __future__ import annotations

from protos.pdserve.v1 import api_pb2
from router.client import busy_workers, describe_busy


def worker(address: str, **kw: object) -> api_pb2.WorkerStatus:
    fields = {"serving": True, "role": "decode", "total_blocks": 8, "free_blocks": 8, **kw}
    in_flight = fields.pop("in_flight", 0)
    w = api_pb2.WorkerStatus(address=address, **fields)
    w.transfers.in_flight = in_flight
    return w


def test_only_serving_workers_holding_something_are_busy() -> None:
    status = api_pb2.GetStatusResponse(workers=[
        worker("idle:1"),
        worker("block:1", free_blocks=7),
        worker("running:1", running_requests=1),
        worker("waiting:1", waiting_requests=2),
        worker("reserved:1", reserved_requests=1),
        worker("transfer:1", in_flight=1),
        worker("gone:1", serving=False, free_blocks=0, running_requests=3),
    ])
    assert [w.address for w in busy_workers(status)] == [
        "block:1", "running:1", "waiting:1", "reserved:1", "transfer:1"]
    assert busy_workers(api_pb2.GetStatusResponse(workers=[worker("idle:1")])) == []


def test_a_busy_worker_is_described_by_what_it_holds() -> None:
    text = describe_busy(worker("10.0.0.2:50061", free_blocks=5, reserved_requests=1))
    assert text == ("decode worker 10.0.0.2:50061: 3 of 8 blocks held, 0 running, 0 waiting, "
                    "1 reserved, 0 transfers in flight")
