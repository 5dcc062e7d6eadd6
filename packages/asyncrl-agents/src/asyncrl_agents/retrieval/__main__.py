"""`python -m asyncrl_agents.retrieval --corpus corpus.jsonl --port 8000`: serve `/retrieve` on loopback."""

from asyncrl_agents.retrieval.cli import main

raise SystemExit(main())
