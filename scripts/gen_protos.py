"""Regenerate jserve/proto/generate_pb2{,_grpc}.py{,i} from protos/jserve/v1/generate.proto.

    python scripts/gen_protos.py           # rewrite the checked-in modules
    python scripts/gen_protos.py --check   # exit 1 if they differ from a fresh generation

Needs grpcio-tools (pinned in the ``test`` extra). protoc names the modules after the proto
path (``jserve/v1/generate_pb2.py``); they are moved to ``jserve/proto/`` and the stub's import
of the messages module is pointed there, so the package is ``jserve.proto``.
"""
from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO = "jserve/v1/generate.proto"
OUT = ROOT / "jserve" / "proto"
FILES = ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py")


def generate() -> dict[str, str]:
    """File name -> contents of a fresh generation."""
    import grpc_tools
    from grpc_tools import protoc

    includes = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{includes}",
                          f"--python_out={tmp}", f"--pyi_out={tmp}",
                          f"--grpc_python_out={tmp}", str(PROTO_ROOT / PROTO)])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        gen = Path(tmp) / Path(PROTO).parent
        out = {name: (gen / name).read_text() for name in FILES}
    old = "from jserve.v1 import generate_pb2 as"
    if old not in out["generate_pb2_grpc.py"]:
        raise SystemExit("unexpected stub layout: the messages import was not found")
    out["generate_pb2_grpc.py"] = out["generate_pb2_grpc.py"].replace(
        old, "from jserve.proto import generate_pb2 as")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="compare with the checked-in modules instead of writing them")
    a = ap.parse_args(argv)
    fresh = generate()
    if a.check:
        stale = []
        for name, text in fresh.items():
            path = OUT / name
            current = path.read_text() if path.exists() else ""
            if current != text:
                stale.append(name)
                sys.stdout.writelines(difflib.unified_diff(
                    current.splitlines(True), text.splitlines(True), f"checked-in/{name}",
                    f"generated/{name}", n=1))
        if stale:
            print(f"stale: {', '.join(stale)}; run python scripts/gen_protos.py", file=sys.stderr)
            return 1
        print("jserve/proto is current")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in fresh.items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(FILES)} to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
