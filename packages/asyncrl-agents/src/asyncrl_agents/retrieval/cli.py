"""The retrieval server's command line: load a corpus, build the index, serve until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from asyncrl_agents.retrieval.corpus import Corpus
from asyncrl_agents.retrieval.index import INDEXES
from asyncrl_agents.retrieval.server import make_app
from asyncrl_core.errors import AsyncRLError
from asyncrl_core.server_process import bound_port, write_port_file

PARENT_POLL_S = 1.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl_agents.retrieval",
        description="Serve a corpus on POST /retrieve (the Search-R1 retrieval server's API).",
    )
    parser.add_argument("--corpus", type=Path, required=True, help='JSONL rows {"id", "contents"}')
    parser.add_argument(
        "--index", choices=sorted(INDEXES), default="bm25", help="search index (default bm25)"
    )
    parser.add_argument("--topk", type=int, default=3, help="documents per query when a request omits topk")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    parser.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started this one exits"
    )
    args = parser.parse_args(argv)
    if args.topk < 1:
        parser.error(f"--topk must be at least 1, got {args.topk}")
    return args


async def serve(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    corpus = Corpus.load(args.corpus)
    index = INDEXES[args.index](corpus.texts())
    app = make_app(corpus, index, index_name=args.index, default_topk=args.topk)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = bound_port(runner, int(args.port))
        if args.port_file is not None:
            write_port_file(args.port_file, port)
        print(
            f"retrieval server: {len(corpus)} documents, {args.index} index built in "
            f"{time.perf_counter() - started:.1f} s, serving http://{args.host}:{port}/retrieve",
            file=sys.stderr,
            flush=True,
        )
        parent = os.getppid()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PARENT_POLL_S)
            if args.exit_with_parent and os.getppid() != parent:
                break
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except AsyncRLError as error:
        print(f"retrieval server: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"retrieval server: cannot serve on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 2
    return 0
