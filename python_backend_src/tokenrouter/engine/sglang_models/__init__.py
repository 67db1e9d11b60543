"""The model architectures SGLang's registry imports when an engine loads: those the pairs here serve.

SGLang 0.5.23 imports every module of ``sglang.srt.models`` (262 of them) the first time its model
registry is imported, to learn which class serves which architecture: 2.2-2.5 s of imports on a
2-vCPU Zen 4 host (0.02 s narrowed), in every model process, of an engine load of 9-12 s.  Given a package in
``SGLANG_EXTERNAL_MODEL_PACKAGE``, the registry imports only that package's modules (each re-exports
one SGLang model module's ``EntryClass``) and resolves an architecture outside it by importing all
the others after all (``_ModelRegistry.resolve_model_cls`` and ``is_arch_supported``): a model of
another architecture loads as before, only not faster.

Modules: ``llama`` (``LlamaForCausalLM``: SmolLM2, the size-realistic pair) and ``qwen2``
(``Qwen2ForCausalLM``: Qwen2.5-Coder).
"""

from __future__ import annotations

import os

ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"


def narrow_model_registry() -> bool:
    """Point SGLang's model registry at this package, unless the user set ``SGLANG_EXTERNAL_MODEL_PACKAGE``.

    Call it before SGLang's registry is first imported (the engine does, before its first SGLang
    import); afterwards it changes nothing.

    Returns:
        True if this call set the variable, False if it was set already.
    """
    if os.environ.get(ENV):
        return False
    os.environ[ENV] = __name__
    return True
