"""Serving text generation over HTTP (Megatron's text generation server): request validation,
the Flask app, and the engine that runs generation in step on every rank."""
