"""Builds all-MiniLM-L6-v2 in half precision from the packaged int8 build (a second model to
re-embed with): python -m services.embedder.derive OUT_DIR."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from services.embedder.models import MINILM_FP16, default_model_files


def _half_weights(model: onnx.ModelProto) -> int:
    """Folds each int8 weight's Cast and scale Mul into one float16 weight cast to float32;
    returns how many weights it folded."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    dropped: set[str] = set()
    folded = 0
    for cast in list(graph.node):
        quantized = inits.get(cast.input[0]) if cast.op_type == "Cast" else None
        scale_mul = users.get(cast.output[0], [])
        if quantized is None or len(scale_mul) != 1 or scale_mul[0].op_type != "Mul":
            continue
        mul = scale_mul[0]
        scale = inits.get(mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0])
        if scale is None:
            continue
        weight = numpy_helper.to_array(quantized).astype(np.float32) * numpy_helper.to_array(scale)
        half = numpy_helper.from_array(weight.astype(np.float16), quantized.name + "_half")
        graph.initializer.append(half)
        cast.CopyFrom(
            helper.make_node(
                "Cast", [half.name], [mul.output[0]], to=onnx.TensorProto.FLOAT, name=cast.name
            )
        )
        graph.node.remove(mul)
        dropped.update({quantized.name, scale.name})
        folded += 1
    still_used = {name for node in graph.node for name in node.input}
    for init in list(graph.initializer):
        if init.name in dropped and init.name not in still_used:
            graph.initializer.remove(init)
    return folded


def derive_fp16(out_dir: Path) -> Path:
    """Writes the half-precision model and its tokenizer into out_dir; returns the folder."""
    files = default_model_files()
    model = onnx.load(str(files.onnx_path))
    if _half_weights(model) == 0:
        raise ValueError(f"{files.onnx_path} has no int8 weights to fold")
    onnx.checker.check_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out_dir / MINILM_FP16.file_names[0]))
    shutil.copyfile(files.tokenizer_path, out_dir / "tokenizer.json")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Derives the model into the folder the command line names, and prints the folder."""
    parser = argparse.ArgumentParser(prog="python -m services.embedder.derive", description=__doc__)
    parser.add_argument("out_dir", type=Path, help="the folder to write the model into")
    print(derive_fp16(parser.parse_args(argv).out_dir))


if __name__ == "__main__":
    main()
