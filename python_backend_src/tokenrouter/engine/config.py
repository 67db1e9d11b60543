"""The settings of one model's engine (:class:`EngineConfig`) and decode loop (:class:`SubserverConfig`).

Each setting is declared once, on its field (:func:`~tokenrouter.engine.parameters.param`): doc,
unit, range, default and config parameter.  The Triton adapter reads a model's ``config.pbtxt``
into these objects from the declarations (:class:`tokenrouter.triton.settings.LLMSettings`), and
docs/configuration.md is checked against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .host_memory import MAX_MMAP_THRESHOLD_BYTES
from .parameters import check_ranges, documented, param

__all__ = ["EngineConfig", "SubserverConfig", "DTYPES", "DEVICES", "CPU_LINEAR_WEIGHTS"]

#: values of ``dtype``
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: values of ``device``
DEVICES = ("auto", "cuda", "cpu")
#: values of ``cpu_linear_weights``
CPU_LINEAR_WEIGHTS = ("dual", "packed", "rowmajor")


@documented
@dataclass
class EngineConfig:
    """Configuration of one model's engine (:class:`~tokenrouter.engine.sglang_engine.SGLangEngine`).

    Raises:
        ValueError: a value out of its declared range (naming the field).
    """

    model_path: str = param(doc="Hugging Face checkpoint folder (config.json, weights, tokenizer)")
    dtype: str = param("float32", choices=DTYPES, doc=(
        "the weights' dtype; ``auto``: bfloat16 on GPUs and on CPUs with native bf16 dot products "
        "(``avx512_bf16``, AMX), else float32 (:func:`tokenrouter.engine.device.resolve_dtype`)"))
    kv_pool_tokens: int = param(16384, unit="tokens", ge=1, doc="size of the model's private KV pool")
    max_running_requests: int = param(32, unit="requests", ge=1, doc="request rows in the pool (running + pending)")
    context_length: Optional[int] = param(None, unit="tokens", ge=1, unset=0, shown="the checkpoint's",
                                          doc="longest sequence (prompt + output); None (0): the model's own")
    torch_threads: int = param(0, unit="threads", ge=0,
                               doc="intra-op threads of this model's process; 0 leaves torch's")
    load_format: str = param("auto", doc=(
        "``auto`` for real weights, ``dummy`` for random weights of the checkpoint's shape "
        "(size-realistic benchmarks only)"))
    random_seed: int = param(0, doc="seed of dummy weights")
    attention_backend: Optional[str] = param(None, unset="", doc=(
        "SGLang's attention backend; None (empty): ``torch_native`` on the CPU, SGLang's default on GPUs"))
    capture_hidden: bool = param(False, doc=(
        "also return the last hidden state of every step (the learned routers read model 0's)"))
    one_forward_per_step: bool = param(True, key=None, doc=(
        "a step with both sequences to extend and sequences to decode runs them all as one extend "
        "batch instead of two forwards"))
    cpu_linear_weights: str = param("dual", choices=CPU_LINEAR_WEIGHTS, doc=(
        "CPU only (:func:`tokenrouter.engine.cpu.prepack_linear_weights`): ``dual`` packs the linear "
        "weights for oneDNN at load and, in float32, keeps the row-major ones too for steps of 1-3 rows "
        "(weights stored twice); ``packed`` keeps only the packed ones; ``rowmajor`` leaves SGLang's "
        "``F.linear``"))
    device: str = param("auto", choices=DEVICES, doc=(
        "``auto`` (CUDA when torch sees a GPU, else the CPU), ``cuda`` (refuse to start without a GPU) "
        "or ``cpu``"))
    gpu_id: int = param(0, key=None, ge=0, doc=(
        "CUDA device index (GPU only; Triton's ``model_instance_device_id`` for a ``KIND_GPU`` instance)"))
    cuda_graph: bool = param(True, doc="decode steps replay captured CUDA graphs (GPU only; never on the CPU)")
    cuda_graph_max_bs: int = param(0, unit="requests", ge=0, doc=(
        "largest decode batch captured as a CUDA graph; 0: SGLang's default"))
    mem_fraction_static: float = param(0.0, ge=0, doc=(
        "share of the GPU's memory for weights and KV pool; 0: SGLang's default (0.95 on a CPU, where "
        "the pool's size is ``kv_pool_tokens``); lower it when several models share a GPU"))
    prefix_cache: bool = param(True, doc=(
        "reuse KV across requests (:mod:`tokenrouter.engine.prefix_cache`): a new sequence extends only "
        "past its longest cached prefix, and a released one's tokens stay cached until the pool needs "
        "the slots (LRU eviction of unreferenced prefixes)"))
    cpu_kernel_cache_entries: int = param(256, unit="entries", ge=0, doc=(
        "CPU only: capacity of PyTorch's and oneDNN's per-shape primitive caches "
        "(:func:`tokenrouter.engine.cpu.kernel_caches.bound_kernel_caches`); each new step shape adds an "
        "entry, so with the libraries' default (1,024 each; 0 here) a server's memory creeps up for hours"))
    cpu_linear_row_buckets: bool = param(True, doc=(
        "CPU only, packed linear weights: a step's rows are padded to one of about 50 sizes "
        "(:func:`tokenrouter.engine.cpu.linear.row_bucket`) so that those caches keep each shape's "
        "kernel; false computes every row count as it comes (new kernels for most routed steps)"))
    kernel_cache_warmup_tokens: int = param(0, unit="tokens", ge=0, doc=(
        "CPU only: at load, one step of each length 1..n tokens fills those caches, so that a model's "
        "memory when it turns ready is the memory it keeps (load time grows by about n short steps); "
        "0: no warm-up"))

    def __post_init__(self) -> None:
        check_ranges(self)


@documented
@dataclass
class SubserverConfig:
    """Scheduling settings of one model's decode loop (:class:`~tokenrouter.engine.subserver.Subserver`).

    ``lockstep`` is the lock-step baseline's :class:`~tokenrouter.engine.lockstep.TurnRing` this
    model steps in turn with its peers (the loop's strategy is then
    :class:`~tokenrouter.engine.lockstep.LockStep`), or None (own pace:
    :class:`~tokenrouter.engine.strategy.Autonomous`); the model process opens it from its
    ``lockstep_group`` parameter.

    Raises:
        ValueError: a value out of its declared range (naming the field).
    """

    delayed_batch_size: int = param(1, unit="requests", ge=1, clamp=True, doc=(
        "B_i: a step starts once this many requests are ready, or when every request the model holds "
        "is ready, or when the oldest ready one has waited ``max_wait_s``"))
    max_wait_s: float = param(0.005, unit="s", ge=0, key="delayed_batch_max_wait_us", kind=int, scale=1e6,
                              doc="bound on the delayed-batching wait (the parameter is in µs)")
    stream_interval: int = param(1, unit="tokens", ge=1, clamp=True, doc=(
        "committed tokens per streamed chunk; a request's first output token goes out at once (TTFT), "
        "as with SGLang's ``stream_interval``"))
    max_batch: int = param(64, unit="requests", ge=1, key=None, doc="most requests in one forward step")
    readmit_on_resume: bool = param(False, doc=(
        "std-serving baseline: a returning request is re-admitted as new, its KV freed and its whole "
        "context re-prefilled (no pending state)"))
    lockstep: Optional[Any] = None
    prefill_chunk_tokens: int = param(512, unit="tokens", ge=0, doc=(
        "chunked prefill: the most new tokens of prefills and extends in one step (SGLang's "
        "``chunked_prefill_size``; decode rows are not counted); extends take the budget shortest "
        "first, so a resume never waits behind a long prompt; 0: no chunking"))
    queue_timeout_s: float = param(60.0, unit="s", ge=0, doc=(
        "a new request may wait this long for KV here, then ends as busy; a PeerReq's "
        "``extras['queue_timeout_s']`` (the router's) lowers it; 0: no limit"))
    max_queued_requests: int = param(256, unit="requests", ge=0, doc=(
        "most requests waiting for KV; one more is refused at once as busy"))
    malloc_trim_interval_s: float = param(30.0, unit="s", ge=0, doc=(
        "the decode loop gives the memory its C library keeps freed back to the system (glibc's "
        "``malloc_trim``, between steps) at most this often, so that the process's resident size "
        "does not creep up with traffic (:mod:`tokenrouter.engine.host_memory`); 0: never"))
    malloc_mmap_threshold_bytes: int = param(0, unit="bytes", ge=0, le=MAX_MMAP_THRESHOLD_BYTES, doc=(
        "host buffers at least this large are mapped afresh and unmapped when freed (glibc's "
        "``M_MMAP_THRESHOLD``, set in the model's process when it loads), so that a step's large "
        "activation buffers do not stay inside the heap between steps; 0: the C library's own "
        "(dynamic) threshold, or, where the process inherited a fixed one (``MALLOC_MMAP_THRESHOLD_``, "
        "which ``deploy/serve`` sets for tritonserver), 32 MiB, where the dynamic one ends up"))

    def __post_init__(self) -> None:
        check_ranges(self)
