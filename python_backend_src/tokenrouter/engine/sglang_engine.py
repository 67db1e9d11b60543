"""One LLM's execution engine: an SGLang ``ModelRunner`` with a private KV pool.

This is the per-model half of TokenRouter's *model-centric execution*
(paper §Design, "Execution"): every model owns its weights, its KV pool and its
batches.  The engine exposes exactly what the decode loop needs:

* :meth:`SGLangEngine.forward` advances a set of :class:`Sequence` objects by one
  forward step.  Sequences whose KV lags their token list by exactly one token
  and that stayed in the running batch are *decoded*; every other one (new,
  resumed after a handoff, or with several appended tokens) is *extended* from
  its KV position, reusing its KV row (no prefix matching, no re-allocation of
  what is already there).
* A sequence that is not passed to ``forward`` is simply taken out of the
  running batch (``ScheduleBatch.filter_batch``) — its KV rows stay allocated.
  That is the *pending* state of the paper's handoff–resume.
* :meth:`SGLangEngine.release` frees its KV row and token slots.

The engine is not thread-safe: one decode-loop thread owns it.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence as Seq

from . import sglang_cpu_compat

logger = logging.getLogger(__name__)

sglang_cpu_compat.install()

import torch  # noqa: E402

__all__ = ["EngineConfig", "Sequence", "ForwardOutput", "SGLangEngine", "KVCapacityError", "resolve_device",
           "server_args_kwargs"]


class KVCapacityError(RuntimeError):
    """Raised when a sequence does not fit into the model's KV pool (tokens)."""


@dataclass
class EngineConfig:
    """Configuration of one model's engine.

    Attributes:
        model_path: HF checkpoint folder (config.json, weights, tokenizer).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"``
            (:func:`resolve_dtype`: bfloat16 on GPUs and on CPUs with native bf16
            dot products, float32 on other CPUs).
        kv_pool_tokens: size of the private KV pool in tokens.
        max_running_requests: request rows in the pool (running + pending).
        context_length: maximum sequence length in tokens (prompt + output);
            ``None`` takes the model's own.
        torch_threads: intra-op threads for this engine's process (0: leave as is).
        load_format: ``"auto"`` for real weights, ``"dummy"`` for random weights
            of the checkpoint's shape (size-realistic benchmarks only).
        random_seed: seed for dummy weights.
        attention_backend: SGLang attention backend; ``None`` chooses
            ``torch_native`` on the CPU and SGLang's default on GPUs.
        capture_hidden: also return the last hidden state of every step
            (needed by learned routers).
        one_forward_per_step: when a step has both sequences to extend (new or
            resumed) and sequences to decode, run them all as one extend batch
            instead of two forwards.
        cpu_linear_weights: CPU hosts only (see
            :func:`tokenrouter.engine.sglang_cpu_compat.prepack_linear_weights`):
            ``"dual"`` packs the linear weights for oneDNN once at load time and,
            for float32 weights, keeps the row-major ones for steps of 1-3 rows
            (batched steps then cost little more than single ones; linear weights
            stored twice; bfloat16 keeps only the packed ones, faster there at
            1-3 rows too);
            ``"packed"`` keeps only the packed ones; ``"rowmajor"`` leaves
            SGLang's ``F.linear`` as is.
        device: ``"auto"`` (CUDA when torch sees a GPU, else the CPU), ``"cuda"``
            (a GPU is required: :class:`SGLangEngine` raises ``RuntimeError``
            without one) or ``"cpu"``.
        gpu_id: CUDA device index the engine runs on (GPU only; Triton's
            ``model_instance_device_id`` for a ``KIND_GPU`` instance).
        cuda_graph: capture and replay CUDA graphs for decode steps (GPU only;
            SGLang's default, on). The CPU never uses them.
        cuda_graph_max_bs: largest decode batch (rows) captured as a CUDA graph;
            larger steps run eagerly. 0 leaves SGLang's default.
        mem_fraction_static: fraction of the GPU's memory SGLang may take for
            weights and KV pool; 0 leaves SGLang's default on a GPU and 0.95 on a CPU
            (where the pool's size is ``kv_pool_tokens``). Lower it when several models
            share one GPU (each model is its own process and sizes its pool from the
            memory still free when it loads).
        prefix_cache: reuse KV across requests (:mod:`tokenrouter.engine.prefix_cache`): a new
            sequence starts from the longest cached prefix of its tokens and extends only the
            rest; a released sequence's tokens stay cached until the pool needs the slots
            (LRU eviction of unreferenced prefixes).
    """

    model_path: str
    dtype: str = "float32"
    kv_pool_tokens: int = 16384
    max_running_requests: int = 32
    context_length: Optional[int] = None
    torch_threads: int = 0
    load_format: str = "auto"
    random_seed: int = 0
    attention_backend: Optional[str] = None
    capture_hidden: bool = False
    one_forward_per_step: bool = True
    cpu_linear_weights: str = "dual"
    device: str = "auto"
    gpu_id: int = 0
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 0
    mem_fraction_static: float = 0.0
    prefix_cache: bool = False


def resolve_device(device: str) -> str:
    """The device an engine configured with ``device`` runs on: ``"cuda"`` or ``"cpu"``.

    Raises:
        ValueError: ``device`` is not auto, cuda or cpu.
        RuntimeError: ``device`` is ``"cuda"`` and torch sees no GPU.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, not {device!r}")
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise RuntimeError("device 'cuda' was asked for but torch sees no GPU "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    return "cuda" if (device == "cuda" or (device == "auto" and available)) else "cpu"


DTYPES = ("auto", "float32", "bfloat16", "float16")


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 dot products in hardware.

    x86: the ``avx512_bf16`` or ``amx_bf16`` flag; Arm: the ``bf16`` feature. Without them
    torch emulates bf16 matmuls by converting to float32 on the fly: on an AVX2-only
    host (AMD EPYC Zen 3) an 8-row bf16 decode step of SmolLM2-135M took 349 ms against
    217 ms in float32 and a bf16 prefill 5.4× as long (``perf/engine_steps.py``, docs/performance.md
    "Engine step times"), so halving the bytes per step gains nothing there.

    Returns:
        False also where ``cpuinfo_path`` cannot be read (not Linux).
    """
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(dtype: str, device: str) -> str:
    """The weights' dtype for an engine configured with ``dtype`` on ``device`` ("cuda"/"cpu").

    ``"auto"``: bfloat16 on a GPU and on a CPU with native bf16 (:func:`cpu_has_native_bf16`:
    decode is memory-bound and bf16 halves the bytes per step), float32 on other CPUs.
    Any other value is returned as given.

    Raises:
        ValueError: ``dtype`` is not one of :data:`DTYPES`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" or cpu_has_native_bf16() else "float32"


#: SGLang attention backends that cannot be captured in CUDA graphs (0.5.23: ``torch_native``
#: implements none of ``init_cuda_graph_state`` / ``init_forward_metadata_capture_cuda_graph``)
NO_CUDA_GRAPH_BACKENDS = ("torch_native",)


def server_args_kwargs(cfg: EngineConfig, device: str) -> Dict[str, object]:
    """Keyword arguments of SGLang's ``ServerArgs`` for ``cfg`` on ``device`` ("cuda"/"cpu").

    CPU: ``device="cpu"``, CUDA graphs off, ``torch_native`` attention unless
    ``cfg.attention_backend`` names another. GPU: SGLang's own choices except
    where ``cfg`` sets them (attention backend, CUDA graphs off, their largest
    batch, the memory fraction); ``base_gpu_id`` is ``cfg.gpu_id``. CUDA graphs
    are off with a backend of :data:`NO_CUDA_GRAPH_BACKENDS`, whatever ``cfg.cuda_graph``.
    """
    kwargs: Dict[str, object] = dict(
        model_path=cfg.model_path,
        tokenizer_path=cfg.model_path,
        dtype=resolve_dtype(cfg.dtype, device),
        max_total_tokens=cfg.kv_pool_tokens,
        max_running_requests=cfg.max_running_requests,
        load_format=cfg.load_format,
        random_seed=cfg.random_seed,
        disable_radix_cache=True,
        skip_tokenizer_init=False,
    )
    if cfg.context_length:
        kwargs["context_length"] = cfg.context_length
    if device == "cpu":
        # On a CPU SGLang budgets the KV pool from the host's free memory at load: with its
        # default fraction a 1.5B model's load fails on a busy host ("Loaded weights leave no
        # GPU memory for the KV cache") although the pool's size is ours (kv_pool_tokens).
        # 0.95 keeps its check for a host that really lacks the pool's memory.
        kwargs.update(device="cpu", disable_cuda_graph=True,
                      attention_backend=cfg.attention_backend or "torch_native",
                      mem_fraction_static=float(cfg.mem_fraction_static or 0.95))
        return kwargs
    kwargs.update(device="cuda", base_gpu_id=int(cfg.gpu_id))
    if cfg.attention_backend:
        kwargs["attention_backend"] = cfg.attention_backend
    if not cfg.cuda_graph or cfg.attention_backend in NO_CUDA_GRAPH_BACKENDS:
        kwargs["disable_cuda_graph"] = True
    elif cfg.cuda_graph_max_bs > 0:
        kwargs["cuda_graph_max_bs_decode"] = int(cfg.cuda_graph_max_bs)
    if cfg.mem_fraction_static > 0:
        kwargs["mem_fraction_static"] = float(cfg.mem_fraction_static)
    return kwargs


@dataclass
class Sequence:
    """A request's token sequence as seen by one model.

    Attributes:
        rid: request id.
        tokens: every token of the request this model knows (prompt + output),
            int token ids.
        kv_len: number of leading ``tokens`` whose KV is in this model's pool.
        req: the SGLang ``Req`` holding the KV row (``None`` before first forward).
        extend_tokens_total: tokens this model has run through *extend*
            (prefill + resumes); decode steps are not counted.
        cached_tokens: leading tokens whose KV came from the prefix cache at
            :meth:`SGLangEngine.add` (a prefix-cache hit; 0 without one).
        verify_positions: m >= 2 asks the next :meth:`SGLangEngine.forward` for the
            next-token logits at each of the sequence's last m positions (speculative
            verification of m - 1 drafted tokens in one extend, Leviathan et al. 2023 §2.3):
            ``ForwardOutput.position_logits``.  The sequence must have at least m new tokens;
            reset to 0 by the forward.  0 or 1: only the last position's logits.
    """

    rid: str
    tokens: List[int]
    kv_len: int = 0
    req: object = None
    extend_tokens_total: int = 0
    cached_tokens: int = 0
    verify_positions: int = 0
    _in_running: bool = False
    _cache_node: object = None  # locked prefix-cache node (None: none)
    _prefix_slots: object = None  # KV slots of the cached prefix until the first forward

    @property
    def pending_tokens(self) -> int:
        """Tokens appended since the last forward (need KV)."""
        return len(self.tokens) - self.kv_len


@dataclass
class ForwardOutput:
    """Result of one :meth:`SGLangEngine.forward` call.

    Attributes:
        seqs: the sequences, in the order of the rows below.
        logits: float32 tensor ``[B, V]``: next-token logits of each sequence.
        hidden: float32 tensor ``[B, H]`` of last hidden states, or ``None``.
        num_extend: how many of ``seqs`` ran as extend (the rest decoded).
        extend_tokens: tokens run through extend in this step.
        latency_s: wall time of the step (seconds).
        position_logits: per row, float32 ``[m, V]`` next-token logits at the sequence's
            last m positions when it asked for them (``Sequence.verify_positions`` = m >= 2),
            else None; the last of the m rows equals the row's ``logits``.  None when no row asked.
    """

    seqs: List[Sequence]
    logits: torch.Tensor
    hidden: Optional[torch.Tensor]
    num_extend: int
    extend_tokens: int
    latency_s: float
    position_logits: Optional[List[Optional[torch.Tensor]]] = None


class _NoPrefixCache:
    """Minimal tree-cache object for ``ScheduleBatch``: SGLang's own prefix sharing is off.

    TokenRouter keeps a request's KV row for its whole life (pending state), so
    SGLang's per-step prefix matching is work the paper removes.  Prefix reuse
    across requests is the engine's own (:mod:`tokenrouter.engine.prefix_cache`):
    a new request's cached prefix slots are handed to SGLang's allocation through
    :meth:`prefix_device_indices`.
    """

    def __init__(self, page_size, device, allocator):
        self.page_size = page_size
        self.device = device
        self.token_to_kv_pool_allocator = allocator
        self.prefixes: Dict[str, torch.Tensor] = {}  # rid -> cached prefix slots (one extend)

    def prefix_device_indices(self, req) -> torch.Tensor:
        """KV slot ids of ``req``'s cached prefix (``req.prefix_len`` of them), for its first extend."""
        return self.prefixes[req.rid][: req.prefix_len]

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return False

    def evict(self, params) -> None:
        return None

    def maybe_hand_to_session(self, req) -> None:
        return None


def _thread_lock_for_tqdm() -> None:
    """Give tqdm (SGLang's weight-loading progress bar) a thread lock before its first bar.

    Left alone, tqdm creates a ``multiprocessing.RLock``. Under SGLang's ``spawn`` start method
    that is a named POSIX semaphore (``/dev/shm/sem.mp-*``) which only Python's exit handlers
    unlink, and a Triton stub ends without them, so every engine left one behind. The engine
    is one process; a thread lock is all tqdm needs. No-op once tqdm has a lock.
    """
    import threading

    from tqdm import tqdm

    if "_lock" not in vars(tqdm):
        tqdm.set_lock(threading.RLock())


class SGLangEngine:
    """An SGLang ``ModelRunner`` plus the batch bookkeeping for pause/resume.

    Args:
        config: :class:`EngineConfig`.

    Raises:
        FileNotFoundError: ``config.model_path`` has no ``config.json``.
        ValueError: ``config.cpu_linear_weights`` is not dual, packed or rowmajor,
            ``config.dtype`` is not one of :data:`DTYPES`, or ``config.device`` is not
            auto, cuda or cpu.
        RuntimeError: ``config.device`` is ``"cuda"`` and there is no GPU.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        if not os.path.isfile(os.path.join(config.model_path, "config.json")):
            raise FileNotFoundError(f"no config.json in model_path {config.model_path!r}")
        if config.cpu_linear_weights not in ("dual", "packed", "rowmajor"):
            raise ValueError(f"cpu_linear_weights must be dual, packed or rowmajor, not {config.cpu_linear_weights!r}")
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self._load()
        self._running = None  # ScheduleBatch of sequences that decoded last step
        self._running_seqs: List[Sequence] = []
        self._seqs: Dict[str, Sequence] = {}
        self._position_index = None  # see _install_position_logits
        self._position_rows = None
        self._position_logits: Dict[int, torch.Tensor] = {}  # id(seq) -> [m, V] of the last extend

    # ------------------------------------------------------------------ load
    def _load(self) -> None:
        from sglang.benchmark import one_batch as ob
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.runtime_context import SpawnRanks, get_schedule, publish, spawn_world_rank
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import PortArgs, ServerArgs
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self._Req, self._ScheduleBatch, self._ForwardBatch = Req, ScheduleBatch, ForwardBatch
        self._SamplingParams, self._spec_none = SamplingParams, SpeculativeAlgorithm.NONE

        cfg = self.config
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)  # the weights' dtype ("auto" resolved)
        on_gpu = self.device == "cuda"
        if not on_gpu or cfg.attention_backend == "torch_native":
            # the CPU's attention backend; on a GPU only where torch_native is asked for (a host
            # without SGLang's CUDA kernels): the same batched torch attention there
            from .sglang_cpu_compat import patch_torch_native_extend
            patch_torch_native_extend(on_gpu=on_gpu)
        gpu_id = int(cfg.gpu_id) if on_gpu else 0
        server_args = ServerArgs(**server_args_kwargs(cfg, self.device))
        server_args.resolve_once()
        _set_envs_and_config(server_args)
        port_args = PortArgs.init_new(server_args)
        publish(server_args, role="scheduler",
                ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), gpu_id=gpu_id))
        ob._init_process_global_configs()
        _thread_lock_for_tqdm()
        bench_runner, tokenizer = ob.load_model(server_args, port_args, gpu_id, 0)
        self.runner = bench_runner.torch_runner
        self.tokenizer = tokenizer
        self.model_config = self.runner.model_config
        self.vocab_size = int(self.model_config.vocab_size)
        self.context_length = int(self.model_config.context_len)
        self.kv_capacity = int(self.runner.token_to_kv_pool_allocator.available_size())
        if self.kv_capacity < cfg.kv_pool_tokens:  # SGLang sized it down to the memory free at load
            logger.warning("engine %s: KV pool of %d tokens, not kv_pool_tokens=%d: too little memory was "
                           "free when the model loaded", cfg.model_path, self.kv_capacity, cfg.kv_pool_tokens)
        self._tree_cache = _NoPrefixCache(get_schedule().page_size, self.runner.device,
                                          self.runner.token_to_kv_pool_allocator)
        self.prefix_cache = None  # RadixPrefixCache when cfg.prefix_cache
        self.prefix_counters = {"queries": 0, "hits": 0, "evicted": 0}  # tokens (see prefix_cache_stats)
        self.set_prefix_cache(cfg.prefix_cache)
        if cfg.capture_hidden:
            from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
            self._capture_mode = CaptureHiddenMode.LAST
        else:
            self._capture_mode = None
        self._torch_threads = torch.get_num_threads()
        self._free_slots_unsorted = False  # see _sort_free_slots
        self.prepacked_layers = 0
        if not on_gpu and cfg.cpu_linear_weights != "rowmajor":
            from .sglang_cpu_compat import prepack_linear_weights
            self.prepacked_layers = prepack_linear_weights(
                self.runner.model, batch_hint=8, keep_rowmajor=cfg.cpu_linear_weights == "dual")

    # ------------------------------------------------------------- accounting
    def kv_tokens_in_use(self) -> int:
        """KV token slots held for running and pending sequences (including cached prefixes
        they read); prefixes only the prefix cache holds are not counted (see
        :meth:`prefix_cache_stats`), so this is 0 on an idle model."""
        return self.kv_capacity - self.kv_tokens_free()

    def kv_tokens_free(self) -> int:
        """KV token slots a sequence can get: free slots plus those the prefix cache would evict."""
        free = int(self.runner.token_to_kv_pool_allocator.available_size())
        return free + (self.prefix_cache.evictable_tokens if self.prefix_cache is not None else 0)

    def prefix_cache_stats(self) -> Dict[str, int]:
        """The prefix cache's sizes and counters (all in tokens; zeros when it is off).

        Keys: ``prefix_cache_enabled`` (0/1), ``prefix_cache_tokens`` (KV the tree holds),
        ``prefix_cache_evictable_tokens`` (of those, read by no request),
        ``prefix_cache_queries`` (prompt tokens looked up by new sequences),
        ``prefix_cache_hits`` (of those, found cached), ``prefix_cache_evicted_tokens``
        (freed by eviction or flush), ``kv_tokens_allocated`` (every allocated slot:
        ``kv_tokens_in_use`` + ``prefix_cache_evictable_tokens``).
        """
        pc = self.prefix_cache
        return {"prefix_cache_enabled": int(pc is not None),
                "prefix_cache_tokens": pc.total_tokens if pc is not None else 0,
                "prefix_cache_evictable_tokens": pc.evictable_tokens if pc is not None else 0,
                "prefix_cache_queries": self.prefix_counters["queries"],
                "prefix_cache_hits": self.prefix_counters["hits"],
                "prefix_cache_evicted_tokens": self.prefix_counters["evicted"]
                + (pc.evicted_tokens if pc is not None else 0),
                "kv_tokens_allocated": self.kv_capacity
                - int(self.runner.token_to_kv_pool_allocator.available_size())}

    def set_prefix_cache(self, enabled: bool) -> None:
        """Turn the prefix cache on or off at run time (off empties it).

        Raises:
            RuntimeError: turning it off while sequences still read cached prefixes.
        """
        pc = self.prefix_cache
        if enabled and pc is None:
            from .prefix_cache import RadixPrefixCache
            self.prefix_cache = RadixPrefixCache(int(self._tree_cache.page_size or 1), self._free_kv_slots)
        elif not enabled and pc is not None:
            if pc.locked_tokens:
                raise RuntimeError(f"{pc.locked_tokens} cached tokens are read by requests in flight: "
                                   "turn the prefix cache off when the model is idle")
            pc.flush()
            self.prefix_counters["evicted"] += pc.evicted_tokens
            self.prefix_cache = None

    def flush_prefix_cache(self) -> int:
        """Evict every prefix no sequence reads; returns the tokens freed (0 when the cache is off)."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def _free_kv_slots(self, slots: torch.Tensor) -> None:
        if len(slots) > 0:
            self.runner.token_to_kv_pool_allocator.free(slots)
            self._free_slots_unsorted = True

    def _evict_for(self, num_tokens: int) -> None:
        """Evict cached prefixes until ``num_tokens`` slots are free (as far as eviction can)."""
        if self.prefix_cache is None:
            return
        short = num_tokens - int(self.runner.token_to_kv_pool_allocator.available_size())
        if short > 0:
            self.prefix_cache.evict(short)

    def rows_in_use(self) -> int:
        """Request rows held (sequences with a KV row)."""
        return sum(1 for s in self._seqs.values() if s.req is not None and s.req.kv.holds_kv)

    # ------------------------------------------------------------- lifecycle
    def add(self, rid: str, tokens: Seq[int], use_prefix_cache: bool = True) -> Sequence:
        """Register a new sequence (nothing is allocated until its first forward).

        With the prefix cache on (and ``use_prefix_cache``), the sequence starts from the
        longest cached prefix of ``tokens`` (whole pages, at most ``len(tokens) - 1`` tokens,
        so one is left to extend): ``kv_len`` and ``cached_tokens`` are set to its length and
        the prefix is locked (not evicted) until :meth:`release`.

        Raises:
            ValueError: ``rid`` is already registered or ``tokens`` is empty.
        """
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already active on this model")
        if len(tokens) == 0:
            raise ValueError("a sequence needs at least one token")
        seq = Sequence(rid=rid, tokens=list(tokens))
        pc = self.prefix_cache
        if pc is not None and use_prefix_cache:
            self.prefix_counters["queries"] += len(seq.tokens)
            slots, node, n = pc.match(seq.tokens, limit=len(seq.tokens) - 1)
            if n > 0:
                pc.lock(node)
                seq._cache_node, seq._prefix_slots = node, slots
                seq.kv_len = seq.cached_tokens = n
                self.prefix_counters["hits"] += n
        self._seqs[rid] = seq
        return seq

    def get(self, rid: str) -> Optional[Sequence]:
        """The registered sequence with id ``rid``, or ``None``."""
        return self._seqs.get(rid)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Free ``seq``'s KV row and token slots and forget it.  Idempotent.

        With the prefix cache on and ``cache``, the KV of ``seq.tokens[:kv_len]`` (whole pages)
        goes to the prefix cache instead of being freed (where the cache already holds those
        tokens, ``seq``'s duplicate slots are freed); ``seq``'s lock on its cached prefix ends.
        """
        if seq._in_running:
            self._detach([s for s in self._running_seqs if s is not seq])
        req = seq.req
        pc = self.prefix_cache
        if req is not None and req.kv.holds_kv:
            n = int(req.kv.kv_allocated_len)
            pool = self.runner.req_to_token_pool
            if n > 0:
                slots = pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64).clone()
                own = seq.cached_tokens if seq._cache_node is not None else 0  # slots the cache owns
                if pc is not None and cache:
                    keep = pc.page_floor(min(seq.kv_len, n, len(seq.tokens)))
                    if keep > own:
                        had = pc.insert(seq.tokens[:keep], slots[:keep])
                        self._free_kv_slots(slots[own:max(own, had)])  # duplicates of cached tokens
                        own = keep
                self._free_kv_slots(slots[own:])
            pool.free(req)
            req.kv.mark_kv_released()
        if seq._cache_node is not None:
            pc.unlock(seq._cache_node)
            seq._cache_node = seq._prefix_slots = None
            self._tree_cache.prefixes.pop(seq.rid, None)
        seq.req = None
        seq.kv_len = 0
        self._seqs.pop(seq.rid, None)

    def _sort_free_slots(self) -> None:
        """Put the KV pool's free slots back in ascending order (before the next allocation).

        SGLang's token allocator hands out slots from the head of its free list and
        appends freed ones at the tail, so as requests of different lengths end, the
        list becomes a permutation of the pool and a request's new tokens land in
        slots scattered over it. Attention then gathers K/V rows from all over the
        pool instead of a few strided runs. Measured with SmolLM2-135M in bf16 on
        one CPU thread, 24 requests of ~150 tokens: a decode step took 351 ms with a
        shuffled free list and 230 ms with a sorted one (median of 4 alternations),
        and a long-running server slowed down step by step the same way. Sorting
        32k int64 slot ids costs well under a millisecond, at most once per step.
        """
        a = self.runner.token_to_kv_pool_allocator
        if getattr(a, "release_pages", None) is not None and len(a.release_pages) > 0:
            a.merge_and_sort_free()  # SGLang's own deferred frees (need_sort allocators)
        elif isinstance(getattr(a, "free_pages", None), torch.Tensor):
            a.free_pages, _ = torch.sort(a.free_pages)
        self._free_slots_unsorted = False

    # --------------------------------------------------------------- forward
    def _new_req(self, seq: Sequence):
        req = self._Req(
            rid=seq.rid,
            origin_input_text="",
            origin_input_ids=array("q", seq.tokens),
            sampling_params=self._SamplingParams(temperature=0, max_new_tokens=1 << 30),
        )
        req.logprob_start_len = -1
        if self._capture_mode is not None:
            req.return_hidden_states = True
        return req

    def _detach(self, keep: List[Sequence]) -> None:
        """Keep only ``keep`` (a subset, in running order) in the running batch."""
        if self._running is None:
            return
        keep_ids = {id(s) for s in keep}
        idx = [i for i, s in enumerate(self._running_seqs) if id(s) in keep_ids]
        for s in self._running_seqs:
            if id(s) not in keep_ids:
                s._in_running = False
        if not idx:
            self._running = None
            self._running_seqs = []
            return
        if len(idx) != len(self._running_seqs):
            self._running.filter_batch(keep_indices=idx)
            self._running_seqs = [self._running_seqs[i] for i in idx]

    def check_fits(self, seq: Sequence, extra_tokens: int = 0) -> None:
        """Raise :class:`KVCapacityError` if ``seq`` plus ``extra_tokens`` cannot fit."""
        need = len(seq.tokens) + extra_tokens
        if need > self.context_length:
            raise KVCapacityError(
                f"sequence of {need} tokens exceeds the context length {self.context_length}")
        held = seq.req.kv.kv_allocated_len if (seq.req is not None and seq.req.kv.holds_kv) else seq.kv_len
        if need - held > self.kv_tokens_free():
            raise KVCapacityError(
                f"KV pool full: {need - held} more tokens needed, {self.kv_tokens_free()} free")

    @torch.no_grad()
    def forward(self, seqs: List[Sequence]) -> ForwardOutput:
        """Run one forward step for ``seqs``; every sequence gets next-token logits.

        Sequences of the running batch that are not in ``seqs`` become pending
        (KV kept).  Caller appends the chosen token to ``seq.tokens`` afterwards.

        Returns:
            :class:`ForwardOutput` with rows in the order of ``seqs``.

        Raises:
            ValueError: a sequence has no unprocessed token.
            RuntimeError: SGLang could not allocate KV (check :meth:`check_fits` first).
        """
        t0 = time.perf_counter()
        if self.prefix_cache is not None:  # room for this step's new tokens: evict cached prefixes
            page = self.prefix_cache.page_size
            self._evict_for(sum(s.pending_tokens for s in seqs) + (len(seqs) * page if page > 1 else 0))
        if self._free_slots_unsorted:
            self._sort_free_slots()
        decode, extend = [], []
        for s in seqs:
            n = s.pending_tokens
            if n <= 0:
                raise ValueError(f"sequence {s.rid!r} has no new token to run")
            if s.verify_positions > n:
                raise ValueError(f"sequence {s.rid!r} asks for logits at {s.verify_positions} positions "
                                 f"but has {n} new tokens")
            (decode if (s._in_running and n == 1) else extend).append(s)
        if extend and decode and self.config.one_forward_per_step:
            # one extend forward for everybody beats an extend forward plus a decode
            # forward (measured on the CPU: 118 ms vs ~130 ms at batch 4, 1 new token each)
            extend, decode = list(seqs), []
        # drop everything not decoding now from the running batch (-> pending)
        decode_set = {id(s) for s in decode}
        self._detach([s for s in self._running_seqs if id(s) in decode_set])
        rows: Dict[int, int] = {}
        logits_parts, hidden_parts, order = [], [], []
        extend_tokens = 0
        ext_batch = None
        if extend:
            ext_batch, lg, hd = self._run_extend(extend)
            extend_tokens = sum(s.pending_tokens for s in extend)
            for s in extend:
                s.extend_tokens_total += s.pending_tokens
            logits_parts.append(lg)
            hidden_parts.append(hd)
            order.extend(extend)
        if self._running_seqs:
            lg, hd = self._run_decode()
            logits_parts.append(lg)
            hidden_parts.append(hd)
            order.extend(self._running_seqs)
        for s in order:
            s.kv_len = len(s.tokens)
        if ext_batch is not None:
            for s in extend:
                s._in_running = True
            if self._running is None:
                self._running, self._running_seqs = ext_batch, list(extend)
            else:
                self._running.merge_batch(ext_batch)
                self._running_seqs = self._running_seqs + list(extend)
        logits = torch.cat(logits_parts, 0) if len(logits_parts) > 1 else logits_parts[0]
        hidden = None
        if self._capture_mode is not None and all(h is not None for h in hidden_parts):
            hidden = torch.cat(hidden_parts, 0) if len(hidden_parts) > 1 else hidden_parts[0]
        for i, s in enumerate(order):
            rows[id(s)] = i
        perm = [rows[id(s)] for s in seqs]
        if perm != list(range(len(seqs))):
            p = torch.tensor(perm)
            logits = logits[p]
            hidden = hidden[p] if hidden is not None else None
        position_logits = None
        if self._position_logits:
            position_logits = [self._position_logits.pop(id(s), None) for s in seqs]
            self._position_logits = {}
        for s in seqs:
            s.verify_positions = 0
        return ForwardOutput(seqs=list(seqs), logits=logits.float(), hidden=hidden,
                             num_extend=len(extend), extend_tokens=extend_tokens,
                             latency_s=time.perf_counter() - t0, position_logits=position_logits)

    def truncate(self, seq: Sequence, length: int) -> int:
        """Cut ``seq`` back to its first ``length`` tokens and free the KV slots beyond them.

        Speculative decoding's rollback (Leviathan et al. 2023; Chen et al. 2023): a drafted
        token the verifier rejected leaves the sequence together with its KV (and every token
        after it).  The sequence leaves the running batch (its next forward is an extend from
        ``length``).  Cached-prefix slots (prefix cache) are never cut.

        Args:
            seq: a registered sequence.
            length: tokens to keep, ``cached_tokens <= length <= len(seq.tokens)``.
        Returns:
            KV token slots freed (int).
        Raises:
            ValueError: ``length`` out of that range.
        """
        if not seq.cached_tokens <= length <= len(seq.tokens):
            raise ValueError(f"cannot truncate sequence {seq.rid!r} of {len(seq.tokens)} tokens to {length} "
                             f"(cached prefix {seq.cached_tokens})")
        if length == len(seq.tokens):
            return 0
        if seq._in_running:
            self._detach([s for s in self._running_seqs if s is not seq])
        freed = 0
        req = seq.req
        if req is not None and req.kv.holds_kv:
            n = int(req.kv.kv_allocated_len)
            if n > length:
                slots = self.runner.req_to_token_pool.req_to_token[req.kv.req_pool_idx, length:n]
                self._free_kv_slots(slots.to(torch.int64).clone())
                freed = n - length
                req.kv.kv_allocated_len = length
                req.kv.kv_committed_len = min(int(req.kv.kv_committed_len), length)
        del seq.tokens[length:]
        seq.kv_len = min(seq.kv_len, length)
        return freed

    def _install_position_logits(self) -> None:
        """Wrap the model's logits processor so that an extend can also return the next-token
        logits at chosen positions (``self._position_index``: flat indices into the extend's
        tokens) in ``self._position_rows``, computed by SGLang's own LM head (``_get_logits``)."""
        from sglang.srt.layers.logits_processor import LogitsMetadata

        lp = self.runner.model.logits_processor
        orig = lp.forward
        engine = self

        def forward(input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
            idx = engine._position_index
            out = orig(input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
            if idx is not None:
                meta = logits_metadata if isinstance(logits_metadata, LogitsMetadata) \
                    else LogitsMetadata.from_forward_batch(logits_metadata)
                engine._position_rows = lp._get_logits(hidden_states[idx.to(hidden_states.device)], lm_head,
                                                       meta, use_logits_buffer=False)
            return out

        lp.forward = forward
        self._position_wrapped = True

    def _hidden(self, out):
        if self._capture_mode is None:
            return None
        h = getattr(out, "hidden_states", None)
        return h.float() if h is not None else None

    def _run_extend(self, seqs: List[Sequence]):
        for s in seqs:
            if s.req is None:
                s.req = self._new_req(s)
                if s._prefix_slots is not None:  # first extend after a prefix-cache hit
                    self._tree_cache.prefixes[s.rid] = s._prefix_slots
            req = s.req
            req.full_untruncated_fill_ids = array("q", s.tokens)
            req.prefix_len = s.kv_len
            req.extend_end = len(s.tokens)
            req.logprob_start_len = -1
        batch = self._ScheduleBatch.init_new(
            reqs=[s.req for s in seqs],
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool_allocator=self.runner.token_to_kv_pool_allocator,
            tree_cache=self._tree_cache,
            model_config=self.model_config,
            enable_overlap=False,
            spec_algorithm=self._spec_none,
        )
        if self._capture_mode is not None:
            batch.return_hidden_states = True
            batch.return_hidden_states_mode = self._capture_mode
        batch.prepare_for_extend()
        for s in seqs:  # the cached prefix's slots are in the request's row now
            if s._prefix_slots is not None:
                s._prefix_slots = None
                self._tree_cache.prefixes.pop(s.rid, None)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        fb = self._ForwardBatch.init_new(batch, self.runner, return_hidden_states_before_norm=False)
        if self._capture_mode is not None:
            fb.capture_hidden_mode = self._capture_mode
        want = [(s, min(s.verify_positions, s.pending_tokens)) for s in seqs]
        self._position_logits = {}
        if any(m >= 2 for _, m in want):
            if not getattr(self, "_position_wrapped", False):
                self._install_position_logits()
            idx, off = [], 0
            for s, m in want:
                n = s.pending_tokens
                if m >= 2:
                    idx.extend(range(off + n - m, off + n))
                off += n
            self._position_index = torch.tensor(idx, dtype=torch.int64)
            try:
                out = self.runner.forward(fb).logits_output
                rows = self._position_rows.float()
            finally:
                self._position_index, self._position_rows = None, None
            at = 0
            for s, m in want:
                if m >= 2:
                    self._position_logits[id(s)] = rows[at:at + m]
                    at += m
            return batch, out.next_token_logits, self._hidden(out)
        out = self.runner.forward(fb).logits_output
        return batch, out.next_token_logits, self._hidden(out)

    def _run_decode(self):
        batch = self._running
        batch.input_ids = torch.tensor([s.tokens[-1] for s in self._running_seqs],
                                       dtype=torch.int64, device=batch.device)
        batch.prepare_for_decode()
        fb = self._ForwardBatch.init_new(batch, self.runner, return_hidden_states_before_norm=False)
        if self._capture_mode is not None:
            fb.capture_hidden_mode = self._capture_mode
        out = self.runner.forward(fb).logits_output
        return out.next_token_logits, self._hidden(out)

    # ------------------------------------------------------------ calibration
    @torch.no_grad()
    def calibrate(self, batch_sizes: Seq[int], context: int = 256, decode_steps: int = 8,
                  seed: int = 0, prefill_chunk_tokens: int = 4096) -> List[Dict[str, object]]:
        """Time synthetic steps at controlled batch sizes (input of the step-latency model).

        For each b in ``batch_sizes``: b sequences of ``context`` random token ids are
        prefilled (in groups of at most ``prefill_chunk_tokens`` tokens, each group one timed
        extend step), one untimed step joins them into one running batch, ``decode_steps``
        decode steps of b rows are timed, then one *resume* step: one sequence gets 2 new
        tokens (a request back from a peer), the others 1, so the step runs as one extend
        forward of b rows and b + 1 tokens, as a step with a returning request does in
        serving. Every sequence is released afterwards, also on error.

        Args:
            batch_sizes: rows per step, each >= 1.
            context: prompt tokens of each synthetic sequence (>= 1).
            decode_steps: timed decode steps per batch size (>= 1).
            seed: seed of the random token ids.
            prefill_chunk_tokens: largest prefill step in tokens (bounds its memory).
        Returns:
            One dict per batch size, in the order given: ``batch_size``, ``decode_latency_s``
            (list of ``decode_steps`` step times in s), ``decode_median_s``,
            ``resume_latency_s`` (s), ``resume_extend_tokens`` (tokens), ``prefill`` (list of
            {``rows``, ``extend_tokens``, ``latency_s``}).
        Raises:
            ValueError: bad arguments, or the KV pool / request rows / context length cannot
                hold max(batch_sizes) sequences of ``context + decode_steps + 4`` tokens.
        """
        import random

        bs = [int(b) for b in batch_sizes]
        if not bs or any(b < 1 for b in bs) or int(context) < 1 or int(decode_steps) < 1:
            raise ValueError("calibrate needs batch sizes >= 1, context >= 1 and decode_steps >= 1")
        length = int(context) + int(decode_steps) + 4  # + sampled, join, resume tokens
        if length > self.context_length:
            raise ValueError(f"calibration sequences of {length} tokens exceed the context length "
                             f"{self.context_length}")
        b_max = max(bs)
        rows_free = self.config.max_running_requests - self.rows_in_use()
        if b_max > rows_free:
            raise ValueError(f"batch size {b_max} needs {b_max} request rows, {rows_free} are free "
                             f"(max_running_requests {self.config.max_running_requests})")
        if b_max * length > self.kv_tokens_free():
            raise ValueError(f"KV pool too small: batch size {b_max} at context {context} needs "
                             f"{b_max * length} tokens, {self.kv_tokens_free()} are free")
        rng = random.Random(seed)
        vocab = self.vocab_size
        out_rows: List[Dict[str, object]] = []
        for b in bs:
            seqs: List[Sequence] = []
            try:
                for j in range(b):
                    seqs.append(self.add(f"__calibrate-{b}-{j}", [rng.randrange(vocab) for _ in range(int(context))],
                                         use_prefix_cache=False))
                prefill = []
                per = max(1, int(prefill_chunk_tokens) // int(context))
                for lo in range(0, b, per):
                    grp = seqs[lo:lo + per]
                    out = self.forward(grp)
                    prefill.append({"rows": len(grp), "extend_tokens": out.extend_tokens,
                                    "latency_s": out.latency_s})
                    for s in grp:
                        s.tokens.append(rng.randrange(vocab))
                if len(prefill) > 1:  # earlier groups left the running batch: join them (untimed)
                    self.forward(seqs)
                    for s in seqs:
                        s.tokens.append(rng.randrange(vocab))
                decode = []
                for _ in range(int(decode_steps)):
                    out = self.forward(seqs)
                    decode.append(out.latency_s)
                    for s in seqs:
                        s.tokens.append(rng.randrange(vocab))
                seqs[0].tokens.append(rng.randrange(vocab))  # back from a peer: 2 new tokens
                out = self.forward(seqs)
                decode_sorted = sorted(decode)
                out_rows.append({"batch_size": b, "decode_latency_s": decode,
                                 "decode_median_s": decode_sorted[len(decode) // 2],
                                 "resume_latency_s": out.latency_s, "resume_extend_tokens": out.extend_tokens,
                                 "prefill": prefill})
            finally:
                for s in seqs:
                    self.release(s, cache=False)  # synthetic tokens: nothing to keep in the prefix cache
        return out_rows
