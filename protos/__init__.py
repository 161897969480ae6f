"""Generated gRPC/protobuf stubs for specdec.proto (built by `make protos`)."""
