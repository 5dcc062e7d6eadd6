"""The distributed transport against a peer that joins the weight-update group the way SGLang's engines do.

The peer is a separate process speaking line-delimited JSON on its stdin/stdout; the HTTP routes of the
engine are a transport that forwards `/init_weights_update_group`, `/update_weights_from_distributed` and
`/destroy_weights_update_group` to it. The group itself is real (gloo over loopback): the trainer end
(`DistributedTransport`) must meet SGLang's store layout, a `tcp://` rendezvous namespaced by the group name.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Generator
from typing import Any

import httpx
import pytest
import torch

from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.weight_sync import DistributedTransport

PEER = textwrap.dedent(
    """
    import datetime, inspect, json, sys
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=60)
    group = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "init":
            rendezvous = c10d.rendezvous(
                command["init_method"], command["rank"], command["world_size"], timeout=timeout
            )
            store, rank, world_size = next(rendezvous)
            store.set_timeout(timeout)
            store = c10d.PrefixStore(command["group_name"], store)
            helper = c10d._new_process_group_helper
            parameters = inspect.signature(helper).parameters
            options = "backend_options" if "backend_options" in parameters else "pg_options"
            group, _ = helper(
                world_size, rank, [], c10d.Backend("gloo"), store,
                group_name=command["group_name"], timeout=timeout, **{options: None},
            )
            c10d._world.pg_group_ranks[group] = {index: index for index in range(world_size)}
            reply = {"ok": True}
        elif command["op"] == "receive":
            received = []
            options = dist.BroadcastOptions()
            options.rootRank = 0
            for dtype, shape in zip(command["dtypes"], command["shapes"]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                group.broadcast([tensor], options).wait()
                received.append(tensor.float().flatten().tolist())
            reply = {"ok": True, "tensors": received}
        else:
            dist.destroy_process_group(group)
            reply = {"ok": True}
        print(json.dumps(reply), flush=True)
    """
)


@pytest.fixture
def peer() -> Generator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=30)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


async def test_buckets_reach_an_sglang_style_group_member(peer: subprocess.Popen[str]) -> None:
    received: list[list[list[float]]] = []
    bodies: dict[str, Any] = {}

    async def ask(command: dict[str, Any]) -> dict[str, Any]:
        assert peer.stdin is not None
        assert peer.stdout is not None
        peer.stdin.write(json.dumps(command) + "\n")
        peer.stdin.flush()
        line = await asyncio.wait_for(asyncio.to_thread(peer.stdout.readline), 120)
        return json.loads(line)

    async def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies[request.url.path] = body
        if request.url.path == "/init_weights_update_group":
            await ask(
                {
                    "op": "init",
                    "init_method": f"tcp://{body['master_address']}:{body['master_port']}",
                    "rank": body["rank_offset"],
                    "world_size": body["world_size"],
                    "group_name": body["group_name"],
                }
            )
        elif request.url.path == "/update_weights_from_distributed":
            reply = await ask({"op": "receive", "dtypes": body["dtypes"], "shapes": body["shapes"]})
            received.append(reply["tensors"])
        else:
            await ask({"op": "destroy"})
        return httpx.Response(200, json={"success": True, "message": "ok"})

    bucket = [
        ("model.norm.weight", torch.arange(4, dtype=torch.float32)),
        ("model.layers.0.mlp.up_proj.weight", torch.full((2, 3), 1.5, dtype=torch.bfloat16)),
    ]
    transport = DistributedTransport(master_address="127.0.0.1", backend="gloo", device="cpu", timeout_s=60)
    async with EnginePool([SGLangClient("http://engine", transport=httpx.MockTransport(engine))]) as pool:
        await transport.connect(pool)
        assert await transport.push(pool, bucket, weight_version=3, flush_cache=False) == {}
        await transport.close(pool)
    assert transport.master_port > 0  # the port the trainer's store bound
    assert bodies["/init_weights_update_group"] == {
        "master_address": "127.0.0.1",
        "master_port": transport.master_port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_update_group",
        "backend": "gloo",
    }
    update = bodies["/update_weights_from_distributed"]
    assert update["names"] == [name for name, _ in bucket]
    assert update["dtypes"] == ["float32", "bfloat16"]
    assert update["shapes"] == [[4], [2, 3]]
    assert update["weight_version"] == "3"
    assert received == [[[0.0, 1.0, 2.0, 3.0], [1.5] * 6]]
