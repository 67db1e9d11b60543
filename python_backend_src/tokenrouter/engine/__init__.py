"""One LLM's execution: the SGLang engine, its subserver (scheduler, decode loop, KV pool), sampling, detokenisation."""
