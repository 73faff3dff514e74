"""Serving K3: continuous-batching engine, hybrid cache, KDA-aware prefix cache, OpenAI-compatible server."""
