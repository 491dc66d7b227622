"""Serving: engine gRPC services, the OpenAI-compatible gateway and `crescent up`."""
