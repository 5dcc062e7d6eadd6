"""Helpers shared by the built-in engine's tests: start engines, run a batch of greedy requests, run a
check under Triton's interpreter, and an engine served over both fronts (`Served`, from the `make_served`
fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp.test_utils import TestClient
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from asyncrl_engine.engine import Engine
from asyncrl_engine.model import EngineModel
from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request
from asyncrl_engine.server import BuiltinServer

WAIT_S = 120.0
INTERPRETER_TIMEOUT_S = 600.0


@dataclass
class Served:
    client: TestClient[Any, Any]
    server: BuiltinServer
    stub: pb_grpc.SglangSchedulerStub
    grpc_target: str

    @property
    def engine(self) -> Engine:
        return self.server.engine


def start_engine(engines: list[Engine], model: EngineModel, **kwargs: Any) -> Engine:
    """An engine over `model`, started and appended to `engines` (the `engines` fixture stops them)."""
    engine = Engine(model, **kwargs)
    engine.start()
    engines.append(engine)
    return engine


def generate_together(
    engine: Engine,
    prompts: Sequence[list[int]],
    max_new_tokens: int | Sequence[int] = 8,
    *,
    num_prompt_logprobs: int = 0,
    options: Sequence[SamplingOptions] | None = None,
) -> list[Request]:
    """Greedy requests with logprobs, one a prompt, submitted at once (one prefill batch); waits for every
    one. `max_new_tokens`: for every request, or one a prompt (requests of different lengths leave the batch
    one by one); EOS does not stop them. `num_prompt_logprobs`: also the logprobs of each prompt's last that
    many tokens (`input_logprobs`). `options`: each request's instead (`max_new_tokens` is then unused)."""
    lengths = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if options is None:
        options = [SamplingOptions(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    remaining = [len(prompts)]
    done = threading.Event()

    def on_update(_request: Request, finished: bool) -> None:
        # Called on the scheduler thread only: no lock needed.
        if finished:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    requests = [
        Request(
            rid=f"r{index}-{time.monotonic_ns()}",
            prompt_ids=prompt,
            options=request_options,
            return_logprob=True,
            logprob_start_len=len(prompt) - num_prompt_logprobs if num_prompt_logprobs else -1,
            on_update=on_update,
        )
        for index, (prompt, request_options) in enumerate(zip(prompts, options, strict=True))
    ]
    engine.call(lambda: [engine.add_request(r) for r in requests], timeout_s=WAIT_S)
    assert done.wait(WAIT_S), "generation did not finish"
    return requests


def run_interpreted(script: str) -> None:
    """Run `script` (Python source that prints `ok` when its checks pass) in a process of its own under
    Triton's interpreter, which must be chosen before Triton is first imported; fails with its output."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=INTERPRETER_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok", result.stdout + result.stderr
