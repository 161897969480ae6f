"""Ray Serve deployment of specdec: ingress, verifier coordinator, draft and target workers."""
