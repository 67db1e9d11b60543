"""Triton adapters: the Python-backend models (LLM subserver, BLS router), the Triton transport, metrics, stub guard."""
