"""The gRPC wire of generation: sampling fields both ways, the trailing metadata of versions, and the spans a
client derives from its own syncs when a server does not report them."""

from __future__ import annotations

import pytest

from asyncrl_core.types import SamplingParams, VersionSpan
from asyncrl_sglang.grpc_client import GrpcSGLangClient
from asyncrl_sglang.grpc_wire import (
    NUM_RETRACTIONS_KEY,
    WEIGHT_VERSIONS_KEY,
    TrailerError,
    decode_trailer,
    encode_trailer,
    sampling_fields,
    sampling_message,
)


def test_sampling_survives_the_round_trip_with_sglang_defaults_written_out() -> None:
    sampling = SamplingParams(
        max_new_tokens=7,
        temperature=0.0,
        top_p=0.9,
        top_k=5,
        stop=("</s>",),
        stop_token_ids=(2,),
        ignore_eos=True,
    )
    fields = sampling_fields(sampling_message(sampling))
    assert fields["max_new_tokens"] == 7
    assert fields["temperature"] == 0.0
    assert fields["top_p"] == pytest.approx(0.9)
    assert fields["top_k"] == 5
    assert fields["stop"] == ["</s>"]
    assert fields["stop_token_ids"] == [2]
    assert fields["ignore_eos"] is True
    assert fields["n"] == 1
    assert fields["repetition_penalty"] == 1.0
    assert fields["skip_special_tokens"] is True


def test_unset_optional_fields_stay_absent_and_zeros_stay_zeros() -> None:
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    fields = sampling_fields(pb.SamplingParams())
    assert fields["max_new_tokens"] is None  # no limit but the context, as SGLang's servicer reads it
    # The zeros no client means are unset, as SGLang 0.5.23's servicer reads them; the others are literal.
    assert (fields["top_p"], fields["top_k"], fields["repetition_penalty"], fields["n"]) == (1.0, -1, 1.0, 1)
    assert (fields["temperature"], fields["min_p"], fields["min_new_tokens"]) == (0.0, 0.0, 0)
    assert "stream_interval" not in fields
    assert "regex" not in fields
    assert sampling_fields(pb.SamplingParams(regex="a+"))["regex"] == "a+"
    assert sampling_fields(pb.SamplingParams(ebnf_grammar="g"))["ebnf"] == "g"


def test_trailer_round_trip() -> None:
    spans = [[("3", 0, 4), ("4", 4, 9)], [("4", 0, 0)]]
    metadata = encode_trailer(spans, [1, 0])
    assert dict(metadata).keys() == {WEIGHT_VERSIONS_KEY, NUM_RETRACTIONS_KEY}
    assert decode_trailer(metadata) == (spans, [1, 0])
    assert decode_trailer(()) == (None, None)
    assert decode_trailer(None) == (None, None)


@pytest.mark.parametrize(
    "metadata",
    [
        ((WEIGHT_VERSIONS_KEY, "not json"),),
        ((WEIGHT_VERSIONS_KEY, '{"version": "1"}'),),
        ((WEIGHT_VERSIONS_KEY, '[[{"version": 1, "start": 0, "end": 1}]]'),),
        ((WEIGHT_VERSIONS_KEY, '[[{"version": "1", "start": true, "end": 1}]]'),),
        ((WEIGHT_VERSIONS_KEY, '[[{"version": "1", "start": 0}]]'),),
        ((NUM_RETRACTIONS_KEY, '["1"]'),),
        ((NUM_RETRACTIONS_KEY, "[1.5]"),),
        ((NUM_RETRACTIONS_KEY, "[true]"),),
    ],
)
def test_malformed_trailers_are_refused_by_name(metadata: tuple[tuple[str, str], ...]) -> None:
    with pytest.raises(TrailerError, match=metadata[0][0]):
        decode_trailer(metadata)


async def test_derived_spans_follow_the_clients_own_syncs() -> None:
    """Chunks that arrive while the client's pause is open belong to the version before it; after the
    continue, to the version its update set."""
    client = GrpcSGLangClient("http://127.0.0.1:9", "127.0.0.1:9")
    try:
        syncs = client.syncs
        syncs.version = 3
        labels = [(2, syncs.label())]
        syncs.held, syncs.num_pauses = syncs.version, 1  # what `pause` records before it is sent
        syncs.set_version(4)  # an update carrying weight_version 4, while paused
        labels.append((5, syncs.label()))  # sampled before the pause, delivered during it
        syncs.num_pauses = 0  # `continue_generation`
        labels.append((9, syncs.label()))
        assert client._derived_spans(labels, 9) == (  # pyright: ignore[reportPrivateUsage]
            VersionSpan(3, 0, 5),
            VersionSpan(4, 5, 9),
        )
        assert client._derived_spans([], 0) == (VersionSpan(4, 0, 0),)  # pyright: ignore[reportPrivateUsage]
    finally:
        await client.aclose()


@pytest.mark.parametrize("field", ["top_p", "top_k"])
def test_a_zero_the_server_would_read_as_unset_is_refused_by_the_client(field: str) -> None:
    from asyncrl_core.errors import GenerationError
    from asyncrl_core.types import SamplingParams

    with pytest.raises(GenerationError, match=field):
        sampling_message(SamplingParams(**{field: 0}))  # pyright: ignore[reportArgumentType]
