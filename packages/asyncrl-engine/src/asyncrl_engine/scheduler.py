"""The scheduler: the table of requests and the rules of a step, as a state machine without torch.

It holds every live request, in exactly one place: the running batch (`running`, row i in KV slot i), the
waiting queue (`waiting`, FIFO), or the one request being prefilled in chunks (`chunked`, in the last slot).
Its rules decide, from that state alone, what the engine's next step does: whether waiting requests are
admitted now and which (`admission_due`, `take_admitted`, within the prefill budget and the free slots),
whether the next decode step may launch before the last one's tokens are read (`continues`), where each
running request decodes next (`decode_positions`), and when a request ends (`finish_reason`: EOS, stop ids
and strings, `max_new_tokens`, the context). The engine's scheduler thread is its only caller; the device
work of a step is the step runner's (`step_runner.py`), and the batch and the engine tie the two together
(`batch.py`, `engine.py`).

Chunked prefill (SGLang's `--chunked-prefill-size`, the token budget of one prefill batch): a request with
more tokens still to prefill than the budget leaves the queue on its own (`chunked`, one at a time, in
neither the waiting queue nor the running batch, as SGLang's `chunked_req`) into the last slot, which the
running requests then leave free. Each step prefills its next chunk (`chunk_next` tokens; filling the rest of
the step's budget at its first, behind the requests admitted before it; a whole budget after), and the
running requests decode one token between two chunks. Its last chunk is an ordinary admission: it joins the
batch with the requests admitted beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrl_engine import DEFAULT_CHUNKED_PREFILL_SIZE
from asyncrl_engine.request import Request, RequestTable

STOP_TEXT_MAX_PENDING_TOKENS = 16
"""Output tokens whose text may stay undecided (ending in an incomplete UTF-8 character) before the stop
string matcher takes their text as it decodes now (a character has at most 4 bytes)."""


class Scheduler:
    """The request table and the step rules of one engine (see the module's docstring).

    `cached_length(sequence, limit)`: how many of the first `limit` tokens of `sequence` the prefix cache
    holds (None: no prefix cache), so that a cached prefix does not count against the prefill budget.
    `decode_text`: token ids -> text, for stop strings (None: stop strings are refused at validation)."""

    def __init__(
        self,
        *,
        max_running_requests: int,
        context_length: int,
        prefill_interval: int,
        chunked_prefill_size: int | None,
        eos_token_ids: frozenset[int],
        decode_text: Callable[[list[int]], str] | None = None,
        cached_length: Callable[[list[int], int], int] | None = None,
    ) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.max_running_requests = max_running_requests
        self.context_length = context_length
        self.prefill_interval = prefill_interval
        """Decode steps between two admissions of waiting requests while others run (1: every step)."""
        self.chunked_prefill_size = (
            chunked_prefill_size if chunked_prefill_size is not None and chunked_prefill_size > 0 else None
        )
        """The token budget of one prefill batch, and of one chunk of a longer request (None: chunking
        disabled, as SGLang reads -1 or 0; then a batch holds `DEFAULT_CHUNKED_PREFILL_SIZE` and a longer
        prompt goes alone)."""
        self.eos_token_ids = eos_token_ids
        self.decode_text = decode_text
        self.cached_length = cached_length
        self.table = RequestTable(max_running_requests)
        self.steps_since_prefill = 0
        self.admission_cut_short = False
        """The last admission left requests waiting that a slot was free for but its prefill budget was not:
        the next step admits again, as a chunked prefill goes on every step. (The interval gathers turns
        into a prefill worth its launches; a backlog that filled one budget is worth another at once.)"""
        self._token_text_lengths: dict[int, int] = {}
        """`len(decode_text([id]))` by id, for the stop-string matcher (decoded once per id)."""

    # ---------------------------------------------------------------------------------------------- admission
    def admission_due(self) -> bool:
        """Whether this step admits waiting requests (see `prefill_interval`); every step while a request is
        prefilled in chunks (one chunk a step) or the last admission was cut short by its prefill budget."""
        if not self.table.waiting:
            return self.table.chunked is not None
        return (
            self.table.chunked is not None
            or self.admission_cut_short
            or not self.table.running
            or self.steps_since_prefill + 1 >= self.prefill_interval
            or 4 * len(self.table.waiting) >= self.max_running_requests
        )

    def take_admitted(self, free: int, simple_only: bool = False) -> list[Request]:
        """Pop the requests that join now: FIFO, at most `free`, within `chunked_prefill_size` tokens to
        prefill (`tokens_to_prefill`: a prefix the cache holds is not prefilled, so it does not count). The
        request prefilled in chunks goes first: its next chunk alone (`chunk_next`) while the rest exceeds
        the budget, else its last chunk, admitted. A longer waiting request then starts its chunks with the
        rest of the budget (`chunked`) and ends the admission (chunking disabled: a longer one joins
        alone). `simple_only`: stop before the first one whose prefill needs the host at once
        (prompt logprobs to read, `max_new_tokens` 0: finished at its prefill, or a chunk)."""
        admitted: list[Request] = []
        size_limit = self.chunked_prefill_size
        budget = size_limit or DEFAULT_CHUNKED_PREFILL_SIZE
        chunked = self.table.chunked
        if chunked is not None:
            remaining = chunked.num_tokens - self.table.chunk_prefilled
            if remaining > budget:
                self.table.chunk_next = budget
                return admitted
            admitted.append(chunked)  # its last chunk (its slot is counted in `free`)
            budget -= remaining
        while self.table.waiting and len(admitted) < free:
            head = self.table.waiting[0]
            if simple_only and (
                head.options.max_new_tokens == 0
                or (not head.was_running and head.return_logprob and head.logprob_start_len >= 0)
            ):
                break
            size = self.tokens_to_prefill(head)
            if size > budget:
                if size_limit is None:
                    if admitted:
                        break
                elif simple_only or self.table.chunked is not None or budget <= 0:
                    break
                else:
                    # Its slot is the last one, which the running and admitted requests leave free.
                    self.table.chunked = self.table.waiting.popleft()
                    self.table.chunk_prefilled = 0
                    self.table.chunk_next = budget
                    break
            admitted.append(self.table.waiting.popleft())
            budget -= size
        self.admission_cut_short = bool(self.table.waiting) and len(admitted) < free
        return admitted

    def tokens_to_prefill(self, request: Request) -> int:
        """The tokens a prefill of `request` computes now: its sequence less the prefix that the prefix cache
        holds (what counts against the prefill budget, as SGLang counts a request's extend tokens)."""
        size = request.num_tokens
        if self.cached_length is None:
            return size
        sequence = request.prompt_ids + request.output_ids
        return size - self.cached_length(sequence, cacheable_prefix(request, size))

    # ---------------------------------------------------------------------------------------------- decoding
    def decode_positions(self, pending: int) -> list[int]:
        """Each running request's position in the next decode step: its last token's, plus `pending` (the
        steps launched whose tokens the host has not read). A finished request whose slot is still decoded
        keeps its last position (what it writes there is never read)."""
        return [
            len(r.prompt_ids) + len(r.output_ids) - (1 if r.finish_reason is not None else 1 - pending)
            for r in self.table.running
        ]

    def continues(self, launched: Sequence[Request], positions: list[int], kv_capacity: int) -> bool:
        """Whether the next decode step may launch from the ids of the step in flight (which decoded
        `launched`) before the host reads them: the running batch stays that step's (no admission due that a
        slot could take), the KV cache (`kv_capacity` positions a slot, 0: none yet) holds one more position
        for every row (the next step's `positions`, `decode_positions(pending=1)`), fewer than a quarter of
        the rows are finished requests (decoded for nothing until a sync frees them), and some request goes
        on after the step in flight's token (when every one ends there by length, the next step would be
        wasted whole: a batch of equal lengths ends as without overlap)."""
        running = self.table.running
        if running != launched:  # requests compare by identity
            return False
        live = [r for r in running if not r.finished]
        if 4 * (len(running) - len(live)) >= len(running):
            return False
        if len(live) < self.max_running_requests and self.admission_due():
            return False
        if all(self.ends_by_length(r, len(r.output_ids) + 1) for r in live):
            return False
        return kv_capacity >= min(max(positions) + 2, self.context_length)

    # ---------------------------------------------------------------------------------------------- finishing
    def ends_by_length(self, request: Request, num_output: int) -> bool:
        """Whether `num_output` output tokens end `request` by `max_new_tokens` or the context length."""
        limit = request.options.max_new_tokens
        return (limit is not None and num_output >= limit) or (
            len(request.prompt_ids) + num_output >= self.context_length
        )

    def finish_reason(self, request: Request, token: int) -> dict[str, object] | None:
        """Why `request` ends with its latest output token `token` (SGLang's finish reason), or None."""
        options = request.options
        num_output = len(request.output_ids)
        # The stop-string matcher reads every token's text, also before min_new_tokens, to keep its tail.
        matched = self.match_stop_string(request) if options.stop and self.decode_text is not None else None
        if num_output >= options.min_new_tokens:
            if token in options.stop_token_ids or (not options.ignore_eos and token in self.eos_token_ids):
                return {"type": "stop", "matched": token}
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if self.ends_by_length(request, num_output):
            return {"type": "length", "length": num_output}
        return None

    def match_stop_string(self, request: Request) -> str | None:
        """The stop string the latest token completes (the earliest in the text when several do), or None.

        Decodes incrementally: only the tokens since the last match (from `stop_prefix_offset`, one token
        of context before them) and matches over the new text plus the `stop_tail` a stop string may start in,
        so a step costs the same at any output length (`decode_text` must be a pure function: the length of
        one token's text is decoded once per id). Text that ends in an incomplete character is matched
        without it and read again at the next token (for at most `STOP_TEXT_MAX_PENDING_TOKENS`)."""
        decode = self.decode_text
        assert decode is not None
        ids = request.output_ids
        prefix, read = request.stop_prefix_offset, request.stop_read_offset
        text = decode(ids[prefix:])
        if read - prefix == 1:  # the usual case: the matched text is the previous token's
            known = self._token_text_lengths.get(ids[prefix])
            if known is None:
                known = self._token_text_lengths[ids[prefix]] = len(decode(ids[prefix:read]))
        else:
            known = len(decode(ids[prefix:read])) if read > prefix else 0
        if text[-1:] == "\ufffd" and len(ids) - read < STOP_TEXT_MAX_PENDING_TOKENS:
            # An incomplete character at the end: match the text before it, and decide it at a later token.
            window = request.stop_tail + text.rstrip("\ufffd")[known:]
        else:
            window = request.stop_tail + text[known:]
            request.stop_prefix_offset, request.stop_read_offset = read, len(ids)
            request.stop_tail = window[max(0, len(window) - request.options.longest_stop + 1) :]
        found = request.options.stop_pattern.search(window)
        return None if found is None else found.group()


def cacheable_prefix(request: Request, length: int) -> int:
    """How much of a request's `length` tokens may come from the prefix cache: all but the last (whose hidden
    state samples the next token), and none of the prompt positions whose logprobs it asked for."""
    limit = length - 1
    if not request.was_running and request.return_logprob and request.logprob_start_len >= 0:
        limit = min(limit, max(0, min(request.logprob_start_len, len(request.prompt_ids)) - 1))
    return limit
