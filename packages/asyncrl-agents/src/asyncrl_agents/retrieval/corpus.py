"""A retrieval corpus: JSONL rows in the Search-R1 / FlashRAG shape, `{"id": ..., "contents": ...}`.

`contents` is the title in double quotes on the first line, then the passage text (`"Paris"\nParis is the
capital of France.`). Rows with `title` and `text` instead of `contents` are accepted and given a
`contents` of that shape; a row without `id` gets its line number. Rows are returned by the server as they
are, so extra fields (a URL, a source) reach the client unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl_agents.jsonl import read_jsonl
from asyncrl_core.errors import AsyncRLError

JsonObject = dict[str, object]


def contents_of(title: str, text: str) -> str:
    """The Search-R1 `contents` string of a passage: quoted title, newline, text."""
    return f'"{title}"\n{text}'


def split_contents(contents: str) -> tuple[str, str]:
    """(title, text) of a `contents` string; the title keeps its quotes, as Search-R1 shows it."""
    title, _, text = contents.partition("\n")
    return title, text


@dataclass(frozen=True, slots=True)
class Corpus:
    """Documents in index order; `documents[i]["contents"]` is a str for every i."""

    documents: Sequence[Mapping[str, object]]

    def __len__(self) -> int:
        return len(self.documents)

    def texts(self) -> list[str]:
        """The text each document is indexed by (its `contents`)."""
        return [str(document["contents"]) for document in self.documents]

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, object]], *, source: str = "corpus") -> Corpus:
        documents: list[JsonObject] = []
        for number, row in enumerate(rows):
            document: JsonObject = dict(row)
            contents = document.get("contents")
            if contents is None:
                title, text = document.get("title"), document.get("text")
                if not isinstance(text, str):
                    raise AsyncRLError(
                        f"{source}: row {number} has neither a `contents` string nor a `text` string"
                    )
                document["contents"] = contents_of(title if isinstance(title, str) else "", text)
            elif not isinstance(contents, str):
                raise AsyncRLError(
                    f"{source}: row {number}: `contents` is {type(contents).__name__}, not str"
                )
            document.setdefault("id", str(number))
            documents.append(document)
        if not documents:
            raise AsyncRLError(f"{source}: the corpus is empty")
        return cls(documents)

    @classmethod
    def load(cls, path: str | Path) -> Corpus:
        """Read a JSONL corpus; raises `AsyncRLError` naming the file and line of a bad row."""
        path = Path(path)
        if not path.is_file():
            raise AsyncRLError(f"corpus file {path} does not exist")

        return cls.from_rows((row for _, row in read_jsonl(path)), source=str(path))
