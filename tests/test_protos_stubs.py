"""The committed gRPC stubs (`dspark/v1/`) are exactly what protoc makes of `protos/`.

`dspark.serving.protos` only imports the committed stubs, so a .proto edited without regenerating
them would run the old protocol; this test regenerates into a temporary folder with the same
protoc invocation and compares byte for byte.
"""

from __future__ import annotations

from pathlib import Path

from dspark.serving import protos

REGENERATE = "python -m dspark.serving.protos"


def test_committed_stubs_match_the_protos(tmp_path):
    fresh = protos.generate_stubs(tmp_path)
    committed = protos.STUBS_ROOT / protos.PROTO_PACKAGE
    stale = [name for name in protos.stub_names()
             if not (committed / name).exists()
             or (committed / name).read_bytes() != (fresh / name).read_bytes()]
    assert not stale, (f"{', '.join(stale)} in {committed} differ from the stubs protoc makes of "
                       f"{protos.PROTO_ROOT}: run `{REGENERATE}` and commit dspark/v1/")


def test_generated_stubs_hold_no_machine_path(tmp_path):
    """Stubs generated anywhere are identical: protoc sees include-relative source names only."""
    fresh = protos.generate_stubs(tmp_path)
    for name in protos.stub_names():
        text = (fresh / name).read_text()
        assert str(tmp_path) not in text and str(protos.PROTO_ROOT) not in text, name


def test_stub_modules_are_the_committed_files():
    """`pb` and `rpc` import the stubs of the package, one module per .proto."""
    committed = (protos.STUBS_ROOT / protos.PROTO_PACKAGE).resolve()
    for name in protos.PROTO_NAMES:
        for module in (getattr(protos.pb, name), getattr(protos.rpc, name)):
            assert module.__name__.startswith("dspark.v1.")
            assert Path(module.__file__).resolve().parent == committed
