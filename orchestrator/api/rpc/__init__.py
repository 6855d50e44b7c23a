"""gRPC stubs generated from proto/orch.proto (see generate.py); never edited by hand."""
