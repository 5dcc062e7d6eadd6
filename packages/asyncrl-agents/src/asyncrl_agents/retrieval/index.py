"""Search indexes over a corpus: BM25 (`bm25s`, the default) and a dense LSA index (numpy only).

An index answers a batch of queries with, per query, `k` (document index, score) pairs, best first. A new
kind of index (a neural embedding model, FAISS) implements `Index` and is added to `INDEXES`.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

Hits = list[list[tuple[int, float]]]
"""Per query, (document index, score) pairs, best first."""


class Index(Protocol):
    """A search index over the texts it was built from."""

    def search(self, queries: Sequence[str], k: int) -> Hits:
        """The `k` best documents of each query (fewer only when the corpus is smaller than `k`)."""
        ...


class BM25Index:
    """Okapi BM25 over word tokens (English stop words removed), built with `bm25s`."""

    def __init__(self, texts: Sequence[str]) -> None:
        bm25s = _import_bm25s()
        self._num_documents = len(texts)
        self._retriever = bm25s.BM25()
        self._retriever.index(
            bm25s.tokenize(list(texts), stopwords="en", show_progress=False), show_progress=False
        )

    def search(self, queries: Sequence[str], k: int) -> Hits:
        bm25s = _import_bm25s()
        if not queries:
            return []
        k = min(k, self._num_documents)
        # Token strings, not ids: the retriever maps them through the corpus vocabulary (unknown ones drop).
        tokens = bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
        # NumPy's top-k: bm25s's default would pick JAX wherever it is installed.
        documents, scores = self._retriever.retrieve(
            tokens, k=k, show_progress=False, backend_selection="numpy"
        )
        return [
            [(int(document), float(score)) for document, score in zip(row_documents, row_scores, strict=True)]
            for row_documents, row_scores in zip(documents, scores, strict=True)
        ]


_WORD = re.compile(r"\w\w+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class LsaIndex:
    """A dense index: TF-IDF vectors reduced to `dim` dimensions by a truncated SVD (latent semantics).

    Documents and queries become unit vectors; the score is their cosine. Built in memory with numpy, so it
    suits corpora of up to some ten thousand passages; it finds passages that share related words, not only
    the query's own.
    """

    def __init__(self, texts: Sequence[str], dim: int = 128) -> None:
        counts = [Counter(_words(text)) for text in texts]
        vocabulary = sorted({word for count in counts for word in count})
        self._columns = {word: column for column, word in enumerate(vocabulary)}
        matrix = np.zeros((len(texts), len(vocabulary)), dtype=np.float32)
        for row, count in enumerate(counts):
            for word, number in count.items():
                matrix[row, self._columns[word]] = 1.0 + np.log(number)
        document_frequency = np.count_nonzero(matrix, axis=0)
        self._idf = (np.log((1 + len(texts)) / (1 + document_frequency)) + 1.0).astype(np.float32)
        matrix *= self._idf
        _, _, right = np.linalg.svd(matrix, full_matrices=False)
        self._projection: npt.NDArray[np.float32] = right[: min(dim, right.shape[0])].T.astype(np.float32)
        self._documents = self._normalise(matrix @ self._projection)

    @staticmethod
    def _normalise(vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)

    def search(self, queries: Sequence[str], k: int) -> Hits:
        if not queries:
            return []
        k = min(k, self._documents.shape[0])
        matrix = np.zeros((len(queries), len(self._columns)), dtype=np.float32)
        for row, query in enumerate(queries):
            for word, number in Counter(_words(query)).items():
                if (column := self._columns.get(word)) is not None:
                    matrix[row, column] = 1.0 + np.log(number)
        scores = self._normalise((matrix * self._idf) @ self._projection) @ self._documents.T
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return [
            [(int(column), float(scores[row, column])) for column in best[row]] for row in range(len(queries))
        ]


INDEXES: dict[str, Callable[[Sequence[str]], Index]] = {"bm25": BM25Index, "lsa": LsaIndex}
"""The index kinds by name, as `--index` selects them."""


def _import_bm25s() -> Any:
    """`bm25s`, imported with JAX kept on the CPU.

    Importing bm25s runs a JAX operation when JAX is installed; on a GPU machine that would start JAX's GPU
    backend, which reserves three quarters of the GPU's memory at once and leaves the engines and the actor
    none. `JAX_PLATFORMS` is left as it is when set, and has no effect when JAX was already imported.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s
