"""`python -m asyncrl_engine` as a process: port file, readiness, a generation, a SIGTERM stop, and
`--disable-radix-cache` (the same prompt twice takes nothing from the prefix cache)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from engine_process import serve_builtin


@pytest.mark.integration
def test_server_process_serves_and_stops_cleanly(tiny_llama_path: Path) -> None:
    with serve_builtin(
        tiny_llama_path,
        "--enable-metrics",
        "--api-key",
        "k",
        "--disable-radix-cache",
        max_running_requests=2,
        weight_version="v0",
    ) as server:
        assert server.url.startswith("http://127.0.0.1:")
        headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
        body = json.dumps(
            {
                "text": "hi there, a prompt of a few blocks",
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            }
        ).encode()
        for _ in range(2):
            request = urllib.request.Request(f"{server.url}/generate", data=body, headers=headers)
            with urllib.request.urlopen(request, timeout=60) as response:
                result = json.loads(response.read())
            assert len(result["output_ids"]) == 4
            assert result["meta_info"]["weight_version"] == "v0"
            assert result["meta_info"]["cached_tokens"] == 0
        request = urllib.request.Request(f"{server.url}/server_info", headers=headers)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["disable_radix_cache"] is True
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=60) as response:
            assert b"sglang:num_running_reqs" in response.read()
        process = server.process
    assert process.returncode == 0, server.log()
