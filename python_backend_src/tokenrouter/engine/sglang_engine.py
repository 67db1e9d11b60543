"""One LLM's execution engine: an SGLang ``ModelRunner`` with a private KV pool.

This is the per-model half of TokenRouter's *model-centric execution*
(paper §Design, "Execution"): every model owns its weights, its KV pool and its
batches.  The engine exposes exactly what the decode loop needs:

* :meth:`SGLangEngine.forward` advances a set of :class:`~tokenrouter.engine.sequence.Sequence`
  objects by one forward step.  Sequences whose KV lags their token list by exactly one token
  and that stayed in the running batch are *decoded*; every other one (new,
  resumed after a handoff, or with several appended tokens) is *extended* from
  its KV position, reusing its KV row (no prefix matching, no re-allocation of
  what is already there).
* A sequence that is not passed to ``forward`` is simply taken out of the
  running batch (``ScheduleBatch.filter_batch``) — its KV rows stay allocated.
  That is the *pending* state of the paper's handoff–resume.
* Its KV slots and rows (add, release, truncate, accounting, the prefix cache) are kept by its
  base class :class:`~tokenrouter.engine.kv_slots.KVSlots`; its configuration is
  :class:`~tokenrouter.engine.config.EngineConfig` (device and dtype:
  :mod:`tokenrouter.engine.device`); :meth:`SGLangEngine.calibrate` times synthetic steps
  (:mod:`tokenrouter.engine.calibration`).

The engine is not thread-safe: one decode-loop thread owns it.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from typing import Dict, List

import torch

from . import cpu
from .calibration import calibrate
from .config import EngineConfig
from .device import resolve_device, resolve_dtype, server_args_kwargs
from .kv_slots import KVSlots
from .sglang_models import narrow_model_registry
from .sequence import ForwardOutput, Sequence

logger = logging.getLogger(__name__)

__all__ = ["SGLangEngine"]


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


class SGLangEngine(KVSlots):
    """An SGLang ``ModelRunner`` plus the batch bookkeeping for pause/resume.

    Args:
        config: :class:`~tokenrouter.engine.config.EngineConfig` (checked when it was built).

    Raises:
        FileNotFoundError: ``config.model_path`` has no ``config.json``.
        RuntimeError: ``config.device`` is ``"cuda"`` and there is no GPU.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        if not os.path.isfile(os.path.join(config.model_path, "config.json")):
            raise FileNotFoundError(f"no config.json in model_path {config.model_path!r}")
        cpu.install()  # before SGLang's first import; no-op with a GPU
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        cpu.bound_kernel_caches(config.cpu_kernel_cache_entries)  # before the first oneDNN primitive
        self._load()
        self._running = None  # ScheduleBatch of sequences that decoded last step
        self._running_seqs: List[Sequence] = []
        self._position_index = None  # see _install_position_logits
        self._position_rows = None
        self._position_logits: Dict[int, torch.Tensor] = {}  # id(seq) -> [m, V] of the last extend
        if self.device != "cuda" and config.kernel_cache_warmup_tokens > 0:
            t0 = time.perf_counter()
            n = cpu.warm_kernel_caches(self, min(config.kernel_cache_warmup_tokens, self.kv_capacity - 1))
            logger.info("engine %s: kernel caches filled with %d steps in %.1f s", config.model_path, n,
                        time.perf_counter() - t0)

    # ------------------------------------------------------------------ load
    def _load(self) -> None:
        narrow_model_registry()  # before SGLang's registry is imported: only the architectures served here
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
            cpu.patch_torch_native_extend(on_gpu=on_gpu)
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
        self._init_kv_slots(get_schedule().page_size, cfg.prefix_cache)
        if self.kv_capacity < cfg.kv_pool_tokens:  # SGLang sized it down to the memory free at load
            logger.warning("engine %s: KV pool of %d tokens, not kv_pool_tokens=%d: too little memory was "
                           "free when the model loaded", cfg.model_path, self.kv_capacity, cfg.kv_pool_tokens)
        if cfg.capture_hidden:
            from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
            self._capture_mode = CaptureHiddenMode.LAST
        else:
            self._capture_mode = None
        self._torch_threads = torch.get_num_threads()
        self.prepacked_layers = 0
        if not on_gpu and cfg.cpu_linear_weights != "rowmajor":
            self.prepacked_layers = cpu.prepack_linear_weights(
                self.runner.model, batch_hint=8, keep_rowmajor=cfg.cpu_linear_weights == "dual",
                row_buckets=cfg.cpu_linear_row_buckets)


    # --------------------------------------------------------------- forward
    def _leave_running(self, seq: Sequence) -> None:
        if seq._in_running:
            self._detach([s for s in self._running_seqs if s is not seq])

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
        self._make_room(seqs)
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

    calibrate = calibrate  # calibration.calibrate(engine, ...) as a method
