"""What clients reach: the server deployment, its HTTP (OpenAI) and gRPC APIs, auth, error replies, metrics."""
