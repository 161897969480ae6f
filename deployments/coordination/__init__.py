"""How the server reaches its workers: gRPC proxies, replica routing, placement, the wire format, event loops."""
