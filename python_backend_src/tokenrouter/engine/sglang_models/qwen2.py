from sglang.srt.models.qwen2 import EntryClass  # noqa: F401  (Qwen2ForCausalLM)
