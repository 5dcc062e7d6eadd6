"""The built-in engine: a small PyTorch inference server speaking SGLang's HTTP routes and gRPC service.

`python -m asyncrl_engine --model-path DIR` starts it (asyncrl-sglang's launcher runs it as a process). The
modules: `flags` (the command line, parsed before torch loads), `model` (the Llama/Qwen2 decoder), `engine`
(continuous batching, sampling, pause modes, weight versions), `server` (the aiohttp routes) and
`grpc_service` (SGLang's scheduler service). See the package README.
"""

DEFAULT_CHUNKED_PREFILL_SIZE = 8192
"""Default of `--chunked-prefill-size` (SGLang's default on an 80 GB GPU): at most this many tokens are
prefilled in one batch, and a request with more still to prefill is prefilled in chunks of at most this many,
one per step (see `engine.Engine`). With chunking disabled (-1 or 0, as SGLang reads them) a batch still holds
at most this many, and a longer prompt goes alone in one prefill."""
DEFAULT_MAX_N = 256
"""Default of `--max-n`: the largest `sampling_params.n` a request may ask for."""
DEFAULT_MAX_REQUEST_BODY_BYTES = 64 << 20
"""Default of `--max-request-body-bytes`: the largest body of any route but `/update_weights_from_tensor` (64
MiB: a batch of long prompts fits many times over; a body that could not be tokenised and checked in time is
refused before it is read whole)."""
DEFAULT_MAX_QUEUED_REQUESTS = 65536
"""Default of `--max-queued-requests`: the most requests the waiting queue holds (SGLang's flag, unbounded by
default there; bounded here so that no call can queue more work than the engine could ever get through)."""
