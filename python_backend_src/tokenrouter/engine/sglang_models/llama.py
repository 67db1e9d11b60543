from sglang.srt.models.llama import EntryClass  # noqa: F401  (LlamaForCausalLM and its variants)
