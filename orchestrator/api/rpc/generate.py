"""Regenerate the gRPC stubs (orch_pb2.py, orch_pb2_grpc.py, orch_pb2.pyi) from proto/orch.proto.

The service definition lives at the repository's top level (``proto/orch.proto``, language
neutral); the Python stubs live here, inside ``orchestrator``, so they can never shadow another
distribution's top-level ``proto`` package. protoc sees the file under the virtual path
``orchestrator/api/rpc/orch.proto``, so the generated imports read ``from orchestrator.api.rpc import
orch_pb2``.

Run from anywhere: ``python -m orchestrator.api.rpc.generate``. ``--check`` regenerates into a
temporary folder and exits 1 when the committed modules differ (the drift test uses it).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

RPC_DIR = Path(__file__).resolve().parent
ROOT = RPC_DIR.parents[2]
PROTO_FILE = ROOT / "proto" / "orch.proto"
VIRTUAL_DIR = "orchestrator/api/rpc"
GENERATED = ("orch_pb2.py", "orch_pb2_grpc.py", "orch_pb2.pyi")


def generate(out_dir: Path) -> None:
    """Run grpc_tools.protoc on proto/orch.proto, writing into ``out_dir``/orchestrator/api/rpc.

    Raises:
        FileNotFoundError: proto/orch.proto is missing (not a source checkout).
        RuntimeError: protoc failed (its exit code is in the message).
    """
    from grpc_tools import protoc  # test extra; imported only here

    if not PROTO_FILE.is_file():
        raise FileNotFoundError(f"{PROTO_FILE} not found: run this from a source checkout")
    (out_dir / VIRTUAL_DIR).mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{VIRTUAL_DIR}={PROTO_FILE.parent}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(PROTO_FILE)]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc exited with {code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code drifted")
    ns = parser.parse_args(argv)
    if not ns.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        drifted = [n for n in GENERATED
                   if not filecmp.cmp(Path(tmp) / VIRTUAL_DIR / n, RPC_DIR / n, shallow=False)]
    if drifted:
        print(f"generated modules drifted from proto/orch.proto: {drifted}; "
              "run `python -m orchestrator.api.rpc.generate` and commit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
