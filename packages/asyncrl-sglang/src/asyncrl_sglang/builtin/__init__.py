"""The built-in engine: a small PyTorch inference server speaking SGLang's HTTP routes.

`python -m asyncrl_sglang.builtin --model-path DIR` starts it. The modules: `model` (the Llama/Qwen2 decoder),
`engine` (continuous batching, sampling, pause modes, weight versions), `server` (the aiohttp routes) and
`testing` (start a server subprocess on a free loopback port). See the package README.
"""

DEFAULT_MAX_N = 256
"""Default of `--max-n`: the largest `sampling_params.n` a request may ask for."""
DEFAULT_MAX_QUEUED_REQUESTS = 65536
"""Default of `--max-queued-requests`: the most requests the waiting queue holds (SGLang's flag, unbounded by
default there; bounded here so that no call can queue more work than the engine could ever get through)."""
