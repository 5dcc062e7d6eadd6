"""The built-in engine: a small PyTorch inference server speaking SGLang's HTTP routes.

`python -m asyncrl_sglang.builtin --model-path DIR` starts it. The modules: `model` (the Llama/Qwen2 decoder),
`engine` (continuous batching, sampling, pause modes, weight versions), `server` (the aiohttp routes) and
`testing` (start a server subprocess on a free loopback port). See the package README.
"""
