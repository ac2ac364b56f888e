"""Embedder throughput: the gRPC service under 16 concurrent callers against raw onnxruntime."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from services.embedder.models import find_model_files
from services.embedder.onnx_encoder import load_tokenizer
from shared.pb import embedder_pb2, embedder_pb2_grpc
from shared.rpc import open_channel, wait_serving

ROOT = Path(__file__).resolve().parent.parent
LOCOMO = ROOT.parent / "shared" / "data" / "locomo" / "locomo-dev.json"
RESULTS = ROOT / "bench" / "results"

_SUBJECTS = ["I", "My sister", "Priya", "The team", "Our neighbour", "Tomas", "My manager"]
_VERBS = ["finally finished", "started", "talked about", "signed up for", "gave up on", "loved"]
_OBJECTS = [
    "the pottery class",
    "a charity run for the local shelter",
    "the new budgeting spreadsheet",
    "a road trip along the coast",
    "the book club's latest pick about memory and identity",
    "painting sunsets",
]
_TAILS = [
    "",
    " last weekend.",
    " because it helped me relax after long days at work.",
    ", and honestly it was harder than I expected, but the people there made it worth it, so I "
    "think I will keep going every Thursday evening until the end of the season.",
]


def sentences(count: int) -> list[str]:
    """count realistic sentences of varying length: LoCoMo turns when present, else generated."""
    if LOCOMO.is_file():
        turns = [
            turn["text"]
            for conversation in json.loads(LOCOMO.read_text())
            for key, session in conversation["conversation"].items()
            if key.startswith("session_") and isinstance(session, list)
            for turn in session
        ]
        step = max(1, len(turns) // count)
        return turns[::step][:count]
    rng = random.Random(7)
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}"
        for _ in range(count)
    ]


def raw_throughput(texts: list[str], batch: int, threads: int, *, sort: bool = False) -> float:
    """Texts/s of onnxruntime at a fixed batch size: tokenise (pad to longest), run, mean-pool."""
    files = find_model_files(None)
    tokenizer = load_tokenizer(files.tokenizer_path, files.spec.max_tokens)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(
        str(files.onnx_path), options, providers=["CPUExecutionProvider"]
    )
    order = sorted(texts, key=len) if sort else texts

    def run(chunk: list[str]) -> np.ndarray:
        encodings = tokenizer.encode_batch(chunk)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = session.run(["last_hidden_state"], feed)[0]
        pooled = (hidden * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    run(order[:batch])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(order), batch):
        run(order[i : i + batch])
    return len(order) / (time.perf_counter() - start)


async def service_throughput(address: str, texts: list[str], callers: int) -> float:
    """Texts/s of the service when `callers` clients each send one text at a time."""
    async with open_channel(address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        for text in texts[:callers]:  # warm-up
            await stub.Embed(embedder_pb2.EmbedRequest(texts=[text]))
        queue = iter(texts)

        async def caller() -> None:
            for text in queue:
                await stub.Embed(embedder_pb2.EmbedRequest(texts=[text]))

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return len(texts) / (time.perf_counter() - start)


def _batcher_counts(log_path: Path) -> tuple[int, int] | None:
    """(texts, runs) from the service's shutdown log line, warm-up calls included."""
    for line in log_path.read_text(errors="replace").splitlines():
        msg = json.loads(line).get("msg", "") if line.startswith("{") else ""
        if msg.startswith("batcher embedded"):
            words = msg.split()
            return int(words[2]), int(words[5])
    return None


def start_service(
    run_dir: Path, threads: int, max_batch: int
) -> tuple[subprocess.Popen[bytes], str]:
    """The embedder as a subprocess on a unix socket in run_dir."""
    address = f"unix:{run_dir / 'embedder.sock'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYATLAS_")}
    env.update(
        HYATLAS_GO_DATA=str(run_dir),
        HYATLAS_EMBEDDER_ADDR=address,
        HYATLAS_EMBED_THREADS=str(threads),
        HYATLAS_EMBED_MAX_BATCH=str(max_batch),
    )
    log = (run_dir / "embedder.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.embedder"], cwd=ROOT, env=env, stdout=log, stderr=log
    )
    log.close()
    return proc, address


async def measure(args: argparse.Namespace) -> dict[str, object]:
    """Alternates raw and service passes and returns every figure."""
    texts = sentences(args.texts)
    load_before = os.getloadavg()[0]
    raw: list[float] = []
    service: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-embedder-") as tmp:
        proc, address = start_service(Path(tmp), args.threads, args.max_batch)
        try:
            await wait_serving(address, timeout_s=60)
            for _ in range(args.rounds):
                raw.append(await asyncio.to_thread(raw_throughput, texts, 32, args.threads))
                service.append(await service_throughput(address, texts, args.callers))
            raw_sorted = await asyncio.to_thread(raw_throughput, texts, 32, args.threads, sort=True)
            raw_single = await asyncio.to_thread(raw_throughput, texts, 1, args.threads)
        finally:
            proc.terminate()
            proc.wait(30)
        runs = _batcher_counts(Path(tmp) / "embedder.log")
    raw_mean = sum(raw) / len(raw)
    service_mean = sum(service) / len(service)
    return {
        "texts": len(texts),
        "mean_chars": round(sum(map(len, texts)) / len(texts), 1),
        "source": "locomo-dev turns" if LOCOMO.is_file() else "generated",
        "threads": args.threads,
        "max_batch": args.max_batch,
        "callers": args.callers,
        "rounds": args.rounds,
        "raw_batch32_texts_per_s": [round(x, 1) for x in raw],
        "service_texts_per_s": [round(x, 1) for x in service],
        "raw_batch32_sorted_texts_per_s": round(raw_sorted, 1),
        "raw_batch1_texts_per_s": round(raw_single, 1),
        "service_texts_per_run": round(runs[0] / runs[1], 2) if runs and runs[1] else None,
        "raw_mean": round(raw_mean, 1),
        "service_mean": round(service_mean, 1),
        "ratio_service_over_raw": round(service_mean / raw_mean, 3),
        "ratio_service_over_raw_sorted": round(service_mean / raw_sorted, 3),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, onnxruntime {ort.__version__}",
        # Other work on the machine skews every figure; the ratio is what stays comparable.
        "load_avg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    """Runs the benchmark, prints a table and writes bench/results/embedder.json."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--texts", type=int, default=400)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(
        f"{result['texts']} texts ({result['source']}, mean {result['mean_chars']} chars), "
        f"{result['threads']} threads"
    )
    print(f"{'setup':<44} {'texts/s':>9}")
    print(f"{'raw onnxruntime, batch 32, corpus order':<44} {result['raw_mean']:>9}")
    print(
        f"{'raw onnxruntime, batch 32, sorted by length':<44} "
        f"{result['raw_batch32_sorted_texts_per_s']:>9}"
    )
    print(f"{'raw onnxruntime, batch 1':<44} {result['raw_batch1_texts_per_s']:>9}")
    print(f"{'service, 16 concurrent single-text callers':<44} {result['service_mean']:>9}")
    print(f"service texts per model run: {result['service_texts_per_run']}")
    print(f"load average (1 min) before/after: {result['load_avg_1m_before_after']}")
    print(
        f"ratio service/raw: {result['ratio_service_over_raw']} "
        f"(against sorted raw: {result['ratio_service_over_raw_sorted']})"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "embedder.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
