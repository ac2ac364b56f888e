"""RPCs one write, one search and one forget cost: every service's answered calls, counted
around each one.

Runs the services each mode runs (real embedder, store, search, in pro the extractor, and the
gateway) on a temp dir; pro mode gets a scripted chat-completions server (extraction is
synchronous, so the write returns only after its extraction). Prints a table and writes
bench/results/rpc_counts.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from shared.pb import introspect_pb2, introspect_pb2_grpc
from shared.rpc import open_channel
from shared.settings import MODE_SERVICES
from tests.llm_fake import fake_llm_in_thread
from tests.support import Stack, running_stack

RESULTS = Path(__file__).resolve().parent / "results" / "rpc_counts.json"
FACTS = {"facts": [{"text": "Noor lives in Porto"}, {"text": "Noor prefers tea over coffee",
                                                     "label": "user_preferences"}]}


async def counts(stack: Stack) -> collections.Counter[str]:
    """Calls answered so far by every gRPC service of the stack, by method."""
    total: collections.Counter[str] = collections.Counter()
    for service in MODE_SERVICES[stack.env["HYATLAS_MODE"]]:
        async with open_channel(stack.address(service)) as channel:
            reply = await introspect_pb2_grpc.IntrospectStub(channel).GetRpcCounts(
                introspect_pb2.GetRpcCountsRequest(), timeout=30
            )
        total.update(dict(reply.counts))
    return total


async def cost(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, int]:
    """The RPCs behind one REST call: counts after minus counts before."""
    before = await counts(stack)
    async with aiohttp.ClientSession() as session, session.post(
        stack.base_url + path, json=body
    ) as reply:
        assert reply.status == 200, await reply.text()
    after = await counts(stack)
    return {m.rsplit(".", 1)[-1]: n for m, n in sorted((after - before).items())}


@contextmanager
def stack_in(mode: str, tmp: Path) -> Iterator[Stack]:
    """The whole stack in one mode; pro talks to a scripted LLM that finds two facts."""
    with ExitStack() as stack:
        env = {"HYATLAS_MODE": mode}
        if mode != "lite":
            fake = stack.enter_context(fake_llm_in_thread())
            fake.on("Porto", FACTS)
            fake.default = {}
            env |= {"HYATLAS_LLM_BASE": fake.url, "HYATLAS_LLM_MODEL": "scripted",
                    "HYATLAS_LLM_KEY": "k", "HYATLAS_SYNC_EXTRACT": "on"}
        services = [*MODE_SERVICES[mode], "gateway"]
        yield stack.enter_context(running_stack(tmp / mode, services, **env))


async def measure(tmp: Path) -> dict[str, dict[str, int]]:
    """The RPCs of a write, a search and a forget in lite and pro, each after a warm-up of the
    same owner (an owner's first write in pro also rebuilds its Now page, at most once per 15
    minutes)."""
    turn = {"text": "I moved to Porto last spring and I drink tea, never coffee.",
            "user_id": "bench"}
    search = {"query": "where do I live?", "user_id": "bench", "limit": 5}
    forget = {"text": "I read a lot of history books.", "user_id": "bench"}
    found: dict[str, dict[str, int]] = {}
    for mode in ("lite", "pro"):
        with stack_in(mode, tmp) as stack:
            await cost(stack, "/api/v1/add", {**turn, "text": "I read a lot of history books."})
            found[f"{mode} write"] = await cost(stack, "/api/v1/add", turn)
            await cost(stack, "/api/v1/search", {**search, "query": "books"})
            found[f"{mode} search"] = await cost(stack, "/api/v1/search", search)
            found[f"{mode} forget"] = await cost(stack, "/api/v1/forget", forget)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = asyncio.run(measure(Path(tmp)))
    print(f"{'operation':<14} {'RPCs':>4}  by method")
    for operation, methods in found.items():
        detail = ", ".join(f"{name} {n}" for name, n in methods.items())
        print(f"{operation:<14} {sum(methods.values()):>4}  {detail}")
    args.out.write_text(json.dumps(found, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
