"""Generates the gRPC stubs of protos/ into shared/pb with package-relative imports."""

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "shared" / "pb"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    names = [Path(p).stem for p in protos]
    pattern = re.compile(r"^import (" + "|".join(n + "_pb2" for n in names) + r")\b", re.M)
    for path in OUT.glob("*.py*"):
        text = path.read_text()
        fixed = pattern.sub(r"from . import \1", text)
        if fixed != text:
            path.write_text(fixed)
    (OUT / "__init__.py").write_text('"""Generated gRPC stubs (make protos); never edit."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
