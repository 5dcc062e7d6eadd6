"""The retrieval server (`POST /retrieve`, Search-R1's API) over a JSONL corpus: BM25 by default, LSA dense.

Run it with `python -m asyncrl_agents.retrieval --corpus corpus.jsonl --port 8000`, or start and stop it
from Python with `RetrievalServer`.
"""

from asyncrl_agents.retrieval.corpus import Corpus, contents_of, split_contents
from asyncrl_agents.retrieval.index import INDEXES, BM25Index, Index, LsaIndex
from asyncrl_agents.retrieval.launcher import RetrievalServer
from asyncrl_agents.retrieval.server import make_app

__all__ = [
    "INDEXES",
    "BM25Index",
    "Corpus",
    "Index",
    "LsaIndex",
    "RetrievalServer",
    "contents_of",
    "make_app",
    "split_contents",
]
