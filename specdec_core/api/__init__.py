"""What a caller sends and gets back: the request, sampling, errors, output, log-probs and metrics."""
