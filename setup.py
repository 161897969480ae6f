"""The gRPC stubs are build outputs: every install (wheel or editable) generates them from
protos/specdec.proto, so `pip install` alone gives a working `specdec serve`."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self):
        from grpc_tools import protoc

        proto = str(ROOT / "protos" / "specdec.proto")
        # -I. keeps the package path in the stubs' imports (`from protos import specdec_pb2`)
        status = protoc.main(["protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--grpc_python_out={ROOT}", proto])
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {status})")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
