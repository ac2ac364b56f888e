"""The peer side of bench/compare.py: chromadb in-process with the project's own ONNX encoder.

Runs under .venv-bench (chromadb's pinned dependencies stay out of .venv) with the project root
on PYTHONPATH. Reads one JSON command a line on stdin, answers one JSON line on stdout, and times
every call inside this process, so the figures hold no pipe or JSON cost.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import chromadb
import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings

from services.embedder.models import MINILM, ModelFiles
from services.embedder.onnx_encoder import OnnxEncoder


class ProjectEncoder(EmbeddingFunction[Documents]):
    """chromadb's view of the project's encoder: same model file, tokenizer and thread count."""

    def __init__(self, encoder: OnnxEncoder) -> None:
        self.encoder = encoder

    def __call__(self, input: Documents) -> Embeddings:
        return list(self.encoder.encode(list(input)))

    @staticmethod
    def name() -> str:
        return "hyatlas-onnx"

    def get_config(self) -> dict[str, Any]:
        return {"model_id": self.encoder.spec.model_id}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> ProjectEncoder:
        raise NotImplementedError("the bench hands its encoder over at get_collection")

    def default_space(self) -> str:  # type: ignore[override]
        return "cosine"


def main() -> int:
    onnx_path, tokenizer_path, threads, persist_dir = sys.argv[1:5]
    encoder = OnnxEncoder(ModelFiles(Path(onnx_path), Path(tokenizer_path), MINILM), int(threads))
    client = chromadb.PersistentClient(path=persist_dir)
    collection = client.create_collection(
        "memories",
        embedding_function=ProjectEncoder(encoder),  # type: ignore[arg-type]
        configuration={"hnsw": {"space": "cosine"}},
    )
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing chromadb prints may end up in the answers
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any]
        if op == "add":
            # Each call is one chromadb add of `batch` documents; seconds is their sum.
            ids, docs, metas, batch = cmd["ids"], cmd["docs"], cmd["metas"], cmd["batch"]
            seconds = 0.0
            for i in range(0, len(ids), batch):
                started = time.perf_counter()
                collection.add(
                    ids=ids[i : i + batch],
                    documents=docs[i : i + batch],
                    metadatas=metas[i : i + batch],
                )
                seconds += time.perf_counter() - started
            reply = {"seconds": seconds, "count": collection.count()}
        elif op == "query":
            where = cmd.get("where")
            started = time.perf_counter()
            found = collection.query(
                query_texts=[cmd["text"]], n_results=cmd["k"], where=where or None
            )
            ms = (time.perf_counter() - started) * 1000.0
            reply = {"ms": ms, "docs": (found["documents"] or [[]])[0]}
        elif op == "embed_one":
            started = time.perf_counter()
            encoder.encode([cmd["text"]])
            reply = {"ms": (time.perf_counter() - started) * 1000.0}
        elif op == "embed":
            # The floor for batched writes: the encoder alone over the texts in big batches.
            texts, batch = cmd["texts"], cmd["batch"]
            seconds = 0.0
            for i in range(0, len(texts), batch):
                started = time.perf_counter()
                encoder.encode(texts[i : i + batch])
                seconds += time.perf_counter() - started
            reply = {"seconds": seconds}
        elif op == "vectors":
            # Unit vectors of texts, for seeding both sides with the same vectors.
            matrix = encoder.encode(cmd["texts"]).astype("<f4")
            reply = {"b64": base64.b64encode(matrix.tobytes()).decode()}
        elif op == "add_vectors":
            # Seeding: documents with given vectors (no embedding), untimed.
            ids, docs, metas, vectors = cmd["ids"], cmd["docs"], cmd["metas"], cmd["b64"]
            matrix = np.frombuffer(base64.b64decode(vectors), dtype="<f4").reshape(len(ids), -1)
            for i in range(0, len(ids), 5000):
                collection.add(
                    ids=ids[i : i + 5000],
                    documents=docs[i : i + 5000],
                    metadatas=metas[i : i + 5000],
                    embeddings=matrix[i : i + 5000],
                )
            reply = {"count": collection.count()}
        elif op == "exit":
            break
        else:
            reply = {"error": f"unknown op {op!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
