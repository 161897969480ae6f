"""Ray Serve deployment of specdec: the SpecdecServer deployment (HTTP and gRPC ingress, the
weight-free RemoteEngine) and the draft and target worker actors (docs/architecture.md)."""
