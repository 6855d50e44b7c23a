"""Regenerate orch_pb2.py / orch_pb2_grpc.py from orch.proto.

Run from anywhere: ``python -m orch.proto.generate``. ``--check`` regenerates into a temporary
folder and exits 1 when the committed modules differ (the drift test uses it).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent.parent
GENERATED = ("orch_pb2.py", "orch_pb2_grpc.py", "orch_pb2.pyi")


def generate(out_dir: Path) -> None:
    """Run grpc_tools.protoc on orch/proto/orch.proto, writing into ``out_dir``/orch/proto.

    Raises:
        RuntimeError: protoc failed (its exit code is in the message).
    """
    from grpc_tools import protoc  # test extra; imported only here

    (out_dir / "orch" / "proto").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(PROTO_DIR / "orch.proto")]
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
                   if not filecmp.cmp(Path(tmp) / "orch" / "proto" / n, PROTO_DIR / n,
                                      shallow=False)]
    if drifted:
        print(f"generated modules drifted from orch.proto: {drifted}; "
              "run `python -m orch.proto.generate` and commit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
