"""Structured output: what a request's output must match (a JSON schema, a regex, choices, a
grammar), compiled by llguidance, and the per-request grammar state the loop keeps."""
