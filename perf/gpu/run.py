"""The serving engine's GPU figures: the no-Triton matrix at the paper's R2R sizes, in one call.

Runs on a CUDA host (one H200) that has torch, transformers and Triton but neither
SGLang nor network: the packages it lacks travel as wheels (``perf/gpu/build_bundle.py``)
and are installed here into ``--site`` first (``pip install --no-index --no-deps
--target``).  SGLang runs without ``sgl_kernel`` and flashinfer
(``perf/gpu/sglang_gpu_compat.py``): torch reference ops, the ``torch_native``
attention backend with TokenRouter's batched attention (``tokenrouter.engine.cpu``'s, device
agnostic), no CUDA graphs (SGLang has none for that backend).

What it measures, per pair of random-weight models (``load_format="dummy"``, bf16,
Qwen2-shaped; :data:`PAIRS`: the paper's R2R sizes 1.5B/32B and a 0.5B/7B pair), each model
in its own process on the one GPU, driven without Triton (TokenRouter's engines,
decode loops, ZeroMQ channel and router logic: ``tokenrouter.tools.direct``):

1. each model's step times at batch 1-64 (``Subserver.calibrate``: decode, resume and
   prefill steps at a 256-token context), one model at a time;
2. the cells mode x N (N = 8, 32): ``llm-only`` (the LLM writes every token),
   ``lock-step`` (the models step in turn: the official implementations' loop),
   ``eager-async`` (each model at its own pace, B = 1) and ``tokenrouter`` (the same
   with delayed batching at ``--tokenrouter-b``), all routed by the ``random`` algorithm
   (each output token to the LLM with probability ``--p``, 0.1: about the paper's LLM
   share), N clients sending one request each of ``--max-tokens`` (512) output tokens,
   EOS ignored; throughput (output tokens over the cell's wall time), TPOT (per request:
   time from its first to its last token over its tokens - 1; p50/p90), TTFT, LLM share;
3. GPU memory: each model's peak allocated and reserved bytes, the device's used bytes.

Every cell is capped in time so that the whole run keeps within ``--budget-s`` (480 s
by default): requests still running at a cell's cap are cancelled (their tokens so far
count; ``capped`` in the row) and cells that no longer fit are listed as skipped.
Under ``--out`` ($OUT; at most 7 files): ``gpu_matrix.json`` (rewritten after every stage),
``calibration-<pair>.json`` (the step times in ``python -m scheduler_model``'s calibration
format) and ``events-<pair>-N<n>.jsonl`` (both models' routing events of the eager-async cell,
for ``scheduler_model profile --events``: the DTMC's B* from the measured GPU step times).

``--dry-run`` runs the same script path on the CPU with tiny shapes, 8 output tokens and
a 300 s budget: bundle install (when ``--bundle`` is given), configs and tokenizer,
workers, calibration, every mode, JSON.  ``--check-imports`` only imports the engine path.

    python perf/gpu/run.py --bundle build/gpu-bundle --out "$OUT"     # on the GPU host
    python perf/gpu/run.py --dry-run --out /tmp/gpu-dry               # here
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(ROOT, "python_backend_src")
for _p in (HERE, SRC):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MODELS = ["slm", "llm"]
MODES = ["llm-only", "lock-step", "eager-async", "tokenrouter"]
#: one vocabulary for both models of a pair (Qwen2.5's 7B/32B size; the 0.5B/1.5B have 151936)
VOCAB = 152064

#: Qwen2 shapes (config.json fields): hidden, intermediate, layers, heads, kv heads, tied embeddings
SHAPES: Dict[str, Dict[str, Any]] = {
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                      num_key_value_heads=8, tie_word_embeddings=False),
    "tiny-a": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=True),
    "tiny-b": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False),
}
#: pair name -> (SLM shape, LLM shape); the first is the paper's R2R pair (R2R: 1.5B -> 32B)
PAIRS: Dict[str, Tuple[str, str]] = {"r2r-1.5b-32b": ("qwen2-1.5b", "qwen2-32b"),
                                     "small-0.5b-7b": ("qwen2-0.5b", "qwen2-7b")}
DRY_PAIRS: Dict[str, Tuple[str, str]] = {"dry-tiny": ("tiny-a", "tiny-b")}

#: the paper's R2R figures at N = 8 (throughput, ratio over its lock-step ablation)
PAPER_R2R_N8 = {"throughput_tok_s": 372.5, "ratio_over_lockstep": 1.61}


def param_count(shape: Dict[str, Any], vocab: int = VOCAB) -> int:
    """Parameters of a Qwen2 decoder of ``shape`` (embeddings, attention with q/k/v biases, MLP, norms)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    emb = vocab * h * (1 if shape["tie_word_embeddings"] else 2)
    return n * layer + emb + h


def qwen2_config(shape: Dict[str, Any], vocab: int = VOCAB, context: int = 4096) -> Dict[str, Any]:
    """config.json of a Qwen2ForCausalLM of ``shape`` (bfloat16, rope theta 1e6, ``context`` positions)."""
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "max_position_embeddings": context, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "torch_dtype": "bfloat16", "vocab_size": vocab, "bos_token_id": 256, "eos_token_id": 256,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 0,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, **shape}


def write_tokenizer(path: str, vocab: int) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab`` tokens, no merges, into ``path``.

    Random-weight models need no real vocabulary, only one whose ids cover the model's
    rows (every sampled id must decode) and that the Qwen2 tokenizer class loads: ids
    0-255 are the byte-level alphabet (text encodes one token per byte), then
    ``<|endoftext|>`` and fillers ``x<i>``. Built with the ``tokenizers`` library, no download.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = {ch: i for i, ch in enumerate(alphabet)}
    words["<|endoftext|>"] = len(words)
    words.update({f"x{i}": i for i in range(len(words), vocab)})
    tok = Tokenizer(models.BPE(vocab=words, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "unk_token": None, "bos_token": None, "model_max_length": 1 << 20}, f)


def write_model_dir(path: str, shape: Dict[str, Any], vocab: int, context: int) -> str:
    """A checkpoint folder without weights (config, generation config, tokenizer) for ``load_format=dummy``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qwen2_config(shape, vocab, context), f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 256, "eos_token_id": 256}, f)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        write_tokenizer(path, vocab)
    return path


# ------------------------------------------------------------------ planning
def plan_cells(pairs: List[str], concurrency: List[int], modes: List[str]) -> List[Dict[str, Any]]:
    """The cells in run order: pair by pair, N by N, ``modes`` in the given order."""
    return [{"pair": p, "N": n, "mode": m} for p in pairs for n in concurrency for m in modes]


def cell_cap_s(left_s: float, cells_left: int, reserve_s: float, floor_s: float, ceiling_s: float) -> float:
    """Time cap of the next cell: an equal share of what is left after ``reserve_s`` (later pairs' start-up),
    within [``floor_s``, ``ceiling_s``]; 0 when not even ``floor_s`` is left (the cell is skipped)."""
    avail = left_s - reserve_s
    if cells_left <= 0 or avail < floor_s:
        return 0.0
    return max(floor_s, min(ceiling_s, avail / cells_left))


class Budget:
    """Wall-clock budget of the whole run (seconds from construction)."""

    def __init__(self, total_s: float):
        self.total_s, self.t0 = float(total_s), time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total_s - self.used()


def save(results: Dict[str, Any], out_dir: str) -> str:
    """Write ``results`` to ``out_dir/gpu_matrix.json`` atomically; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "gpu_matrix.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)
    return path


def summarize_requests(recs: List[Dict[str, Any]], wall_s: float) -> Dict[str, Any]:
    """A cell's figures from its requests' records (``t0``, ``t_first``, ``t_last``, ``n``, ``llm``).

    Throughput: all output tokens over ``wall_s``; TPOT of a request: (t_last - t_first) / (n - 1)
    (requests with at least 2 tokens; t_first: its first text, t_last: its end); TTFT: t_first - t0;
    percentiles by nearest rank.
    """
    def pct(xs: List[float], q: float) -> float:
        if not xs:
            return float("nan")
        s = sorted(xs)
        return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]

    tokens = sum(r["n"] for r in recs)
    tpot = [(r["t_last"] - r["t_first"]) / (r["n"] - 1) for r in recs if r["n"] >= 2]
    ttft = [r["t_first"] - r["t0"] for r in recs if r["n"] >= 1]
    llm = sum(r.get("llm", 0) for r in recs)
    return {"requests": len(recs), "output_tokens": tokens, "wall_s": wall_s,
            "throughput_tok_s": tokens / wall_s if wall_s > 0 else float("nan"),
            "tpot_p50_s": pct(tpot, 50), "tpot_p90_s": pct(tpot, 90),
            "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "llm_share": llm / tokens if tokens else float("nan")}


# ------------------------------------------------------------------ environment
def install_bundle(bundle: str, site: str) -> Dict[str, Any]:
    """Install the wheels of ``bundle`` into ``site`` (once) and put ``site`` first on the import path.

    ``site`` also goes to ``PYTHONPATH`` so that the model worker processes see it.
    """
    t0 = time.perf_counter()
    wheels = sorted(glob.glob(os.path.join(bundle, "*.whl")))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {bundle!r}: build them with perf/gpu/build_bundle.py")
    stamp = os.path.join(site, ".bundle")
    key = "\n".join(os.path.basename(w) for w in wheels)
    if not (os.path.exists(stamp) and open(stamp).read() == key):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", site, *wheels],
                       check=True)
        with open(stamp, "w") as f:
            f.write(key)
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, HERE, SRC, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"bundle": bundle, "site": site, "wheels": len(wheels), "seconds": time.perf_counter() - t0}


def prepare_process(dry_run: bool) -> Dict[str, Any]:
    """Import shims and environment of this process and of the workers it spawns (call before sglang).

    GPU: ``sgl_kernel`` stand-ins where it is missing (``sglang_gpu_compat.install``); CPU
    (dry run): TokenRouter's CPU layer (``SGLANG_USE_CPU_ENGINE=1``).
    """
    import sglang_gpu_compat

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sglang_gpu_compat.install_import_shims()
    import torch

    cuda = torch.cuda.is_available()
    info = {"cuda": cuda, "torch": torch.__version__, "python": platform.python_version()}
    if cuda and not dry_run:
        os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
        info["sgl_kernel_stubbed"] = sglang_gpu_compat.install()
        info["gpu"] = torch.cuda.get_device_name(0)
    else:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        from tokenrouter.engine import cpu

        cpu.install()
    return info


def check_imports() -> Dict[str, Any]:
    """Import the engine path (what the workers and the router import); the versions found."""
    import importlib

    mods = ["zmq", "sglang", "sglang.benchmark.one_batch", "sglang.srt.model_executor.model_runner",
            "sglang.srt.models.qwen2", "sglang.srt.layers.attention.torch_native_backend",
            "tokenrouter.engine.sglang_engine", "tokenrouter.engine.subserver", "tokenrouter.routing.peer",
            "tokenrouter.tools.direct", "tokenrouter.algorithms", "transformers"]
    for m in mods:
        importlib.import_module(m)
    _peer("PeerServer")
    import sglang
    import transformers
    import zmq
    from tokenrouter.algorithms import ALGORITHMS

    return {"sglang": sglang.__version__, "transformers": transformers.__version__, "pyzmq": zmq.__version__,
            "algorithms": sorted(ALGORITHMS), "sglang_file": sglang.__file__}


# ------------------------------------------------------------------ workers
def _peer(name: str):
    """``PeerServer`` / ``PeerClient`` of the ZeroMQ channel (``tokenrouter.routing.peer``; older trees:
    ``tokenrouter.routing.peer_channel``)."""
    try:
        from tokenrouter.routing import peer
    except ImportError:
        from tokenrouter.routing import peer_channel as peer
    return getattr(peer, name)


def _worker(name: str, engine_kwargs: Dict[str, Any], sched_kwargs: Dict[str, Any], ring: Tuple[str, int, int],
            dry_run: bool, cmd_q, out_q) -> None:
    """One model's process: engine + subserver + ZeroMQ server (as ``tokenrouter.tools.direct``'s worker),
    with lock-step switchable at run time (``configure`` key ``lockstep``: bool) and commands
    ``calibrate`` and ``memory`` on ``cmd_q``."""
    try:
        host = prepare_process(dry_run)
        if host.get("sgl_kernel_stubbed"):
            import sglang_gpu_compat

            sglang_gpu_compat.patch_loaded_sglang()
        from tokenrouter.engine.lockstep import TurnRing
        from tokenrouter.engine.config import EngineConfig, SubserverConfig
        from tokenrouter.engine.op_dispatch import OpDispatcher
        from tokenrouter.engine.sglang_engine import SGLangEngine
        from tokenrouter.engine.subserver import Subserver
        from tokenrouter.routing.peer import PeerServer

        t0 = time.perf_counter()
        engine = SGLangEngine(EngineConfig(**engine_kwargs))
        import inspect

        extra = {}
        if "configure_algorithm" in inspect.signature(Subserver).parameters:  # the per-segment algorithm check
            from tokenrouter.algorithms import configure as configure_algorithm

            extra["configure_algorithm"] = configure_algorithm
        log = {"f": None}  # routing events (scheduler_model's format), appended while a path is set

        def sink(event: Dict[str, Any]) -> None:
            f = log["f"]
            if f is not None:
                f.write(json.dumps(event) + "\n")  # one write per line: O_APPEND keeps the two models' lines whole
                f.flush()

        sub = Subserver(engine, name, SubserverConfig(**sched_kwargs), event_sink=sink, **extra)
        load_s = time.perf_counter() - t0

        def configure(settings: Dict[str, Any]) -> None:
            s = dict(settings)
            if "lockstep" in s:
                s["lockstep"] = TurnRing(*ring) if s["lockstep"] else None
            if "event_log" in s:
                path = s.pop("event_log")
                if log["f"] is not None:
                    log["f"].close()
                log["f"] = open(path, "a", buffering=1) if path else None
            if s:
                sub.reconfigure(**s)

        server = PeerServer(OpDispatcher(sub, configure=configure))
        out_q.put(("up", name, {"endpoint": server.endpoint, "load_s": load_s, "device": engine.device,
                                "dtype": engine.dtype, "kv_capacity_tokens": engine.kv_capacity}))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        import traceback

        out_q.put(("error", name, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}))
        return
    while True:
        cmd, arg = cmd_q.get()
        if cmd == "stop":
            break
        try:
            if cmd == "calibrate":
                res = sub.calibrate(**arg)
            elif cmd == "memory":
                res = _memory()
            else:
                raise ValueError(f"unknown command {cmd!r}")
            out_q.put((cmd, name, res))
        except Exception as e:  # noqa: BLE001
            out_q.put((cmd, name, {"error": f"{type(e).__name__}: {e}"}))
    server.close()
    sub.stop()


def _memory() -> Dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    free, total = torch.cuda.mem_get_info()
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved(),
            "device_used_bytes": total - free, "device_total_bytes": total}


class Cluster:
    """The pair's two model processes (spawned), a :class:`tokenrouter.tools.direct.DirectRouter`-compatible
    ``segment`` / ``release`` / ``configure``, and the driver-side commands."""

    def __init__(self, models: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]], ring_path: str, dry_run: bool,
                 timeout_s: float):
        import multiprocessing as mp

        from tokenrouter.routing.peer import PeerClient

        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.cmd: Dict[str, Any] = {}
        self.procs = []
        self.info: Dict[str, Any] = {}
        self.peers = None
        for i, (name, (ek, sk)) in enumerate(models.items()):
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(name, ek, sk, (ring_path, i, len(models)), dry_run, q, self.out),
                            daemon=True, name=f"gpu-{name}")
            p.start()
            self.cmd[name] = q
            self.procs.append(p)
        deadline = time.monotonic() + timeout_s
        while len(self.info) < len(models):
            kind, name, res = self._get(deadline)
            if kind == "error":
                self.close()
                raise RuntimeError(f"model {name} did not start: {res['error']}\n{res['traceback']}")
            self.info[name] = res
        endpoints = {n: r["endpoint"] for n, r in self.info.items()}
        self.peers = PeerClient(endpoints.__getitem__, tick_s=1.0)

    def _get(self, deadline: float):
        import queue

        try:
            return self.out.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("a model process did not answer in time") from None

    def command(self, name: str, cmd: str, arg: Any = None, timeout_s: float = 300) -> Dict[str, Any]:
        """Run ``cmd`` (calibrate, memory) in model ``name``'s process; its answer."""
        self.cmd[name].put((cmd, arg))
        kind, who, res = self._get(time.monotonic() + timeout_s)
        if (kind, who) != (cmd, name):
            raise RuntimeError(f"unexpected answer {kind}/{who} to {cmd}/{name}")
        return res

    def segment(self, model, peer_req):
        return self.peers.segment(model, peer_req)

    def release(self, model, rid):
        self.peers.release(model, rid)

    def configure(self, model: str, **settings: Any) -> None:
        from tokenrouter.protocol import Configure

        self.peers.call(model, Configure(args=settings))

    def stats(self, model: str) -> Dict[str, Any]:
        from tokenrouter.protocol import Stats

        return self.peers.call(model, Stats())

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        for q in self.cmd.values():
            q.put(("stop", None))
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()


# ------------------------------------------------------------------ cells
def set_mode(cluster: Cluster, mode: str, B: Dict[str, int], wait_s: float) -> Tuple[str, Dict[str, Any]]:
    """Put both models into ``mode``'s settings; the routing algorithm and parameters its requests use."""
    for m in MODELS:
        b = int(B.get(m, 1)) if mode == "tokenrouter" else 1
        cluster.configure(m, delayed_batch_size=b, max_wait_s=wait_s if b > 1 else 0.0, lockstep=mode == "lock-step")
    return ("none", {"model": 1}) if mode == "llm-only" else ("random", None)


def run_cell(router_for, cluster: Cluster, mode: str, N: int, max_tokens: int, p: float, cap_s: float,
             B: Dict[str, int], wait_s: float, prompts: List[str], event_log: str = "") -> Dict[str, Any]:
    """One cell: N clients, one request each, capped at ``cap_s`` seconds (then cancelled).

    ``event_log``: both models append their routing events (scheduler_model's format) to this
    file during the cell (``python -m scheduler_model profile --events``)."""
    algo, params = set_mode(cluster, mode, B, wait_s)
    if event_log:
        for m in MODELS:
            cluster.configure(m, event_log=event_log)
    router = router_for(algo, params if params is not None else {"p": p, "seed": 0})
    recs: List[Dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    sampling = {"max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": True}

    def client(i: int) -> None:
        rec = {"t0": time.perf_counter(), "t_first": None, "t_last": None, "n": 0, "llm": 0}

        def on_text(_delta: str) -> None:
            t = time.perf_counter()
            rec["t_first"] = rec["t_first"] or t
            rec["t_last"] = t

        try:
            out = router.generate(prompts[i % len(prompts)], sampling, chat=False, on_text=on_text,
                                  cancelled=stop.is_set)
            rec["n"] = int(out["num_output_tokens"])
            rec["llm"] = int(out["routing_summary"]["tokens_by_model"].get("llm", 0))
            rec["finish"] = out["finish_reason"]
        except Exception as e:  # noqa: BLE001 - one request's failure is recorded, not fatal
            rec["error"] = f"{type(e).__name__}: {e}"
        # the last token's time is the request's end: text arrives in chunks (a token whose text is
        # incomplete, as a lone UTF-8 byte, waits for the next), the request ends with its last token
        rec["t_end"] = rec["t_last"] = time.perf_counter()
        if rec["t_first"] is None:
            rec["t_first"] = rec["t_end"]
        with lock:
            recs.append(rec)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, cap_s - (time.perf_counter() - t0)))
    capped = any(t.is_alive() for t in threads)
    if capped:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    if event_log:
        for m in MODELS:
            cluster.configure(m, event_log="")
    wall = max((r["t_end"] for r in recs), default=time.perf_counter()) - t0
    row = {"mode": mode, "N": N, "max_tokens": max_tokens, "p": p, "cap_s": cap_s, "capped": capped,
           "algorithm": algo, **summarize_requests(recs, wall),
           "errors": [r["error"] for r in recs if "error" in r][:5],
           "finish": sorted({r.get("finish", "error") for r in recs})}
    if mode == "tokenrouter":
        row.update(B=dict(B), wait_s=wait_s)
    return row


def median_decode(calib: Dict[str, Any], b: int) -> Optional[float]:
    for r in calib.get("table", []):
        if r["batch_size"] == b:
            return r["decode_median_s"]
    return None


def run_pair(pair: str, shapes: Tuple[str, str], args, results: Dict[str, Any], budget: Budget,
             cells: List[Dict[str, Any]], reserve_s: float) -> None:
    """Start the pair's models, calibrate them, run its cells within the budget."""
    from tokenrouter.tools.direct import DirectRouter

    work = os.path.join(args.work, pair)
    ctx = args.context
    dirs = {m: write_model_dir(os.path.join(work, m), SHAPES[s], args.vocab, ctx) for m, s in zip(MODELS, shapes)}
    pr = results["pairs"].setdefault(pair, {"shapes": dict(zip(MODELS, shapes)), "cells": [], "skipped": []})
    pr["params"] = {m: param_count(SHAPES[s], args.vocab) for m, s in zip(MODELS, shapes)}
    kv = max(args.calib_sizes) * (args.calib_context + 16) + 64 * (args.max_tokens + 64)
    engine = dict(dtype=args.dtype, kv_pool_tokens=kv, max_running_requests=max(64, max(args.calib_sizes)) + 8,
                  context_length=ctx, load_format="dummy", device=args.device, attention_backend="torch_native",
                  cuda_graph=False, torch_threads=args.torch_threads, prefix_cache=False)
    if args.device == "cuda":
        engine["mem_fraction_static"] = args.mem_fraction
    models = {m: ({**engine, "model_path": dirs[m]}, {"stream_interval": 1, "prefill_chunk_tokens": 2048})
              for m in MODELS}
    ring = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"tokenrouter-gpu-lockstep-{os.getpid()}-{pair}")
    t0 = time.perf_counter()
    cluster = Cluster(models, ring, args.dry_run, timeout_s=max(60.0, budget.left()))
    try:
        pr["load_s"] = time.perf_counter() - t0
        pr["models"] = cluster.info
        save(results, args.out)
        pr["step_times"] = {}
        for m in MODELS:  # one model at a time: the other is idle
            pr["step_times"][m] = cluster.command(m, "calibrate", {"batch_sizes": args.calib_sizes,
                                                                   "context": args.calib_context,
                                                                   "decode_steps": args.calib_steps})
        calib = {"context": args.calib_context, "decode_steps": args.calib_steps, "batch_sizes": args.calib_sizes,
                 "models": {m: {k: v for k, v in r.items() if k != "kind"} for m, r in pr["step_times"].items()}}
        with open(os.path.join(args.out, f"calibration-{pair}.json"), "w") as f:  # scheduler_model's --calibration
            json.dump(calib, f, indent=1)
        save(results, args.out)
        slm1 = median_decode(pr["step_times"]["slm"], 1) or 0.0
        wait_s = args.wait_factor * slm1

        def router_for(algo, params):
            return DirectRouter(cluster, MODELS, dirs["slm"], algo, params)

        # byte-level tokenizer: one token per character
        prompts = ["".join(chr(97 + (7 * i + 13 * k) % 26) for k in range(args.prompt_tokens)) for i in range(64)]
        router_for("random", {"p": args.p, "seed": 0}).generate(prompts[0], {"max_tokens": 4, "ignore_eos": True},
                                                                 chat=False)  # warm-up
        mine = [c for c in cells if c["pair"] == pair]
        for k, c in enumerate(mine):
            cap = cell_cap_s(budget.left(), len(mine) - k, reserve_s, args.min_cell_s, args.max_cell_s)
            if cap <= 0:
                pr["skipped"].append({**c, "reason": f"budget: {budget.left():.0f} s left"})
                continue
            B = args.tokenrouter_b.get(c["N"], {"slm": 1, "llm": 1})
            ev = os.path.join(args.out, f"events-{pair}-N{c['N']}.jsonl") if c["mode"] == "eager-async" else ""
            try:
                row = run_cell(router_for, cluster, c["mode"], c["N"], args.max_tokens, args.p, cap, B, wait_s,
                               prompts, event_log=ev)
                if ev:
                    row["event_log"] = os.path.basename(ev)
            except Exception as e:  # noqa: BLE001 - the next cells still run
                row = {**c, "error": f"{type(e).__name__}: {e}"}
            pr["cells"].append(row)
            print(f"{pair} N={c['N']:>2} {c['mode']:<12} "
                  f"{row.get('throughput_tok_s', float('nan')):8.1f} tok/s  "
                  f"TPOT p50 {1e3 * row.get('tpot_p50_s', float('nan')):6.1f} ms  "
                  f"{'capped ' if row.get('capped') else ''}{row.get('error', '')}", flush=True)
            save(results, args.out)
        pr["memory"] = {m: cluster.command(m, "memory") for m in MODELS}
        pr["ratios"] = ratios(pr["cells"])
        save(results, args.out)
    finally:
        cluster.close()
        if os.path.exists(ring):
            os.remove(ring)


def ratios(cells: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per N: tokenrouter's and eager-async's throughput over lock-step's and llm-only's."""
    out: Dict[str, Dict[str, float]] = {}
    by = {(c.get("N"), c.get("mode")): c.get("throughput_tok_s") for c in cells if "throughput_tok_s" in c}
    for (n, mode), x in by.items():
        if mode not in ("tokenrouter", "eager-async") or not x:
            continue
        for base in ("lock-step", "llm-only"):
            y = by.get((n, base))
            if y:
                out.setdefault(str(n), {})[f"{mode}/{base}"] = x / y
    return out


def _model_b(text: str) -> Dict[int, Dict[str, int]]:
    """``"8:llm=2;32:llm=4"`` -> ``{8: {"slm": 1, "llm": 2}, 32: {"slm": 1, "llm": 4}}``."""
    out: Dict[int, Dict[str, int]] = {}
    for part in filter(None, text.split(";")):
        n, _, rest = part.partition(":")
        b = {"slm": 1, "llm": 1}
        b.update({k.strip(): int(v) for k, v in (x.split("=") for x in rest.split(",") if x)})
        out[int(n)] = b
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="", help="folder of wheels to install first (build/gpu-bundle)")
    ap.add_argument("--site", default="/tmp/tokenrouter-gpu-site", help="where the bundle is installed")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "build", "gpu-out"))
    ap.add_argument("--work", default="/tmp/tokenrouter-gpu-work", help="model configs and tokenizers")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 8 tokens, 300 s budget")
    ap.add_argument("--check-imports", action="store_true", help="only import the engine path")
    ap.add_argument("--pairs", default="", help=f"comma list of {sorted(PAIRS)} (default all)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--p", type=float, default=0.1, help="LLM probability of the random router")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--tokenrouter-b", default="8:llm=2;32:llm=4",
                    help="delayed-batching thresholds of the tokenrouter cells per N (N:model=B,...;...)")
    ap.add_argument("--wait-factor", type=float, default=2.0, help="wait bound = factor x SLM step at batch 1")
    ap.add_argument("--mem-fraction", type=float, default=0.88)
    a = ap.parse_args(argv)

    dry = a.dry_run
    a.vocab = 512 if dry else VOCAB
    a.context = 512 if dry else 4096
    a.dtype = "float32" if dry else "bfloat16"
    a.device = "cpu" if dry else "cuda"
    a.torch_threads = 1 if dry else 0
    a.calib_sizes = [1, 2, 4, 8] if dry else [1, 2, 4, 8, 16, 32, 48, 64]
    a.calib_context, a.calib_steps = (32, 2) if dry else (256, 6)
    a.prompt_tokens = 16 if dry else 64
    a.min_cell_s, a.max_cell_s = (5.0, 30.0) if dry else (8.0, 60.0)
    if dry:
        a.max_tokens = min(a.max_tokens, 8)
        a.budget_s = min(a.budget_s, 300.0)
        a.concurrency = "2,4"
    a.tokenrouter_b = _model_b(a.tokenrouter_b)
    budget = Budget(a.budget_s)
    results: Dict[str, Any] = {"kind": "gpu_matrix", "dry_run": dry, "argv": sys.argv[1:],
                               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "paper_r2r_n8": PAPER_R2R_N8, "pairs": {}}
    if a.bundle:
        results["bundle"] = install_bundle(a.bundle, a.site)
    results["host"] = prepare_process(dry)
    results["imports"] = check_imports()
    print(json.dumps({"host": results["host"], "imports": results["imports"]}), flush=True)
    if a.check_imports:
        return 0
    if not dry and not results["host"]["cuda"]:
        print("no CUDA device: use --dry-run on a CPU host", file=sys.stderr)
        return 2
    pairs_all = DRY_PAIRS if dry else PAIRS
    pairs = [p for p in (a.pairs.split(",") if a.pairs and not dry else pairs_all) if p]
    unknown = [p for p in pairs if p not in pairs_all]
    if unknown:
        ap.error(f"unknown pairs {unknown}")
    modes = [m for m in a.modes.split(",") if m]
    if set(modes) - set(MODES):
        ap.error(f"modes are {MODES}")
    if "random" not in results["imports"]["algorithms"]:
        ap.error("this checkout has no 'random' routing algorithm")
    cells = plan_cells(pairs, [int(n) for n in a.concurrency.split(",")], modes)
    results["plan"] = {"cells": len(cells), "budget_s": a.budget_s}
    startup_s = 20.0 if dry else 90.0  # a pair's start-up and calibration, kept for the pairs after this one
    save(results, a.out)
    for i, pair in enumerate(pairs):
        if budget.left() < startup_s:
            results["pairs"][pair] = {"skipped": "budget"}
            continue
        try:
            run_pair(pair, pairs_all[pair], a, results, budget, cells, reserve_s=startup_s * (len(pairs) - i - 1))
        except Exception as e:  # noqa: BLE001 - the other pair still runs
            import traceback

            results["pairs"].setdefault(pair, {})["error"] = f"{type(e).__name__}: {e}"
            results["pairs"][pair]["traceback"] = traceback.format_exc()[-4000:]
            print(f"{pair}: {e}", flush=True)
        save(results, a.out)
    results["seconds"] = budget.used()
    path = save(results, a.out)
    print(f"wrote {path} after {budget.used():.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
