"""Step latency L_i of real-size decoder shapes on a GPU, for the DTMC (paper §Design, "DTMC for B*").

The serving stack (Triton + SGLang) needs its own GPU host (docs/performance.md, "GPU").  This tool
measures what the DTMC needs from such a host without it: the time of one forward step of a
Llama/Qwen3-shaped decoder with **random bf16 weights** (speed only), as SGLang runs it with CUDA
graphs, for

* ``decode``: b rows, one new token each, context C already in the KV cache;
* ``resume``: b rows, two new tokens each (a request returning from a peer appends the peer's
  token(s) and runs them as an extend; paper §Design, "handoff–resume");
* ``prefill``: one request's prompt of P tokens.

Each shape is captured once as a CUDA graph (static KV cache of ``C + 8`` positions per row,
attention over the whole cache with a position mask) and replayed; the figure is the median of
``--reps`` replays timed with CUDA events, in seconds.  The output JSON holds, per model, the
tables ``decode_s``, ``resume_s`` (keys: b) and ``prefill_s`` (keys: P), and the same points as a
``table`` in the format of ``python -m tokenrouter.tools.admin calibrate``, so the file can be given to
``python -m scheduler_model profile/solve --calibration`` (its ``models`` are keyed by role).

    python perf/gpu_step_latency.py --models slm=qwen3-0.6b,llm=qwen3-8b -o gpu_latency.json
    python perf/gpu_step_latency.py --check          # CPU: the decoder against transformers' Llama

The decoder is a plain PyTorch Llama (RMSNorm, GQA attention with RoPE, SwiGLU MLP, untied LM head);
``--check`` compares its logits with ``transformers.LlamaForCausalLM`` on the same weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """Decoder shape: widths in elements, counts in layers/heads."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def params(self) -> int:
        """Parameter count (embedding and LM head counted separately)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden


#: public model shapes (config.json values of the released checkpoints)
SHAPES: Dict[str, Shape] = {
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 49152),
    "llama-size-realistic": Shape(2048, 16, 32, 8, 64, 5632, 49152),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 151936),
    "qwen3-8b": Shape(4096, 36, 32, 8, 128, 12288, 151936),
    "qwen3-32b": Shape(5120, 64, 64, 8, 128, 25600, 151936),
}


class Decoder(torch.nn.Module):
    """A Llama-style decoder over a static KV cache.

    Args:
        shape: :class:`Shape`.
        rows: KV-cache rows (most requests in one step).
        cache_len: positions per row.
        dtype, device: of weights and cache.

    ``forward(ids, pos)``: ids, pos int64 ``[b, T]`` (b ≤ rows; row r of the batch uses cache row r;
    ``pos`` are absolute positions, < cache_len) → logits of the last token of each row,
    ``[b, vocab]``, in ``dtype``.  Keys/values of the T new tokens are written to the cache first;
    each query attends to cache positions ≤ its own.
    """

    def __init__(self, shape: Shape, rows: int, cache_len: int, dtype=torch.bfloat16, device="cuda",
                 theta: float = 1e6, eps: float = 1e-6):
        super().__init__()
        s, self.shape, self.eps = shape, shape, eps
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims):
            x = torch.empty(*dims, device=device, dtype=dtype)
            return torch.nn.Parameter(x.normal_(0.0, 0.02, generator=g), requires_grad=False)

        def ones(n):
            return torch.nn.Parameter(torch.ones(n, device=device, dtype=dtype), requires_grad=False)

        self.embed = w(s.vocab, s.hidden)
        self.lm_head = w(s.vocab, s.hidden)
        self.norm = ones(s.hidden)
        self.layers = torch.nn.ModuleList()
        for _ in range(s.layers):
            layer = torch.nn.Module()
            layer.q = w(s.heads * s.head_dim, s.hidden)
            layer.k = w(s.kv_heads * s.head_dim, s.hidden)
            layer.v = w(s.kv_heads * s.head_dim, s.hidden)
            layer.o = w(s.hidden, s.heads * s.head_dim)
            layer.gate = w(s.intermediate, s.hidden)
            layer.up = w(s.intermediate, s.hidden)
            layer.down = w(s.hidden, s.intermediate)
            layer.in_norm = ones(s.hidden)
            layer.post_norm = ones(s.hidden)
            self.layers.append(layer)
        self.k_cache = torch.zeros(s.layers, rows, s.kv_heads, cache_len, s.head_dim, device=device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        inv = 1.0 / theta ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("cache_pos", torch.arange(cache_len, device=device), persistent=False)

    def _rms(self, x, wt):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * wt

    def _rope(self, x, pos):  # x [b, h, T, d], pos [b, T]
        ang = pos[:, None, :, None].float() * self.inv_freq  # [b, 1, T, d/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        x1, x2 = x.float().chunk(2, dim=-1)
        rot = torch.cat([-x2, x1], dim=-1)
        return (x.float() * cos + rot * sin).to(x.dtype)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        s = self.shape
        b, T = ids.shape
        x = F.embedding(ids, self.embed)
        mask = self.cache_pos[None, None, None, :] <= pos[:, None, :, None]  # [b, 1, T, cache_len]
        rows = torch.arange(b, device=ids.device)
        for li, layer in enumerate(self.layers):
            h = self._rms(x, layer.in_norm)
            q = F.linear(h, layer.q).view(b, T, s.heads, s.head_dim).transpose(1, 2)
            k = F.linear(h, layer.k).view(b, T, s.kv_heads, s.head_dim).transpose(1, 2)
            v = F.linear(h, layer.v).view(b, T, s.kv_heads, s.head_dim).transpose(1, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc[rows[:, None], :, pos] = k.transpose(1, 2)  # [b, T, kvh, d] into [rows, kvh, pos, d]
            vc[rows[:, None], :, pos] = v.transpose(1, 2)
            a = F.scaled_dot_product_attention(q, kc[:b], vc[:b], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(b, T, -1), layer.o)
            h = self._rms(x, layer.post_norm)
            x = x + F.linear(F.silu(F.linear(h, layer.gate)) * F.linear(h, layer.up), layer.down)
        return F.linear(self._rms(x[:, -1], self.norm), self.lm_head)


def time_step(model: Decoder, b: int, T: int, start: int, reps: int, graph: bool = True) -> float:
    """Median seconds of one step of b rows × T new tokens at positions start .. start+T-1.

    With ``graph`` (CUDA only) the step is captured as a CUDA graph and replayed.
    """
    dev = model.k_cache.device
    ids = torch.randint(0, model.shape.vocab, (b, T), device=dev)
    pos = (start + torch.arange(T, device=dev)).expand(b, T).contiguous()
    if dev.type != "cuda":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model(ids, pos)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(ids, pos)
    torch.cuda.current_stream().wait_stream(stream)
    run = lambda: model(ids, pos)  # noqa: E731
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(ids, pos)
        run = g.replay
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(ts)


def measure(name: str, shape: Shape, batches: List[int], context: int, prefills: List[int], reps: int,
            device: str) -> Dict:
    """Step-latency tables of one shape (seconds); see the module docstring."""
    rows = max(batches)
    cache_len = max(context, max(prefills)) + 8
    t0 = time.perf_counter()
    model = Decoder(shape, rows, cache_len, device=device)
    out = {"shape": asdict(shape), "params_b": round(shape.params() / 1e9, 3), "context": context,
           "decode_s": {}, "resume_s": {}, "prefill_s": {}, "decode_eager_b1_s": None}
    for b in batches:
        out["decode_s"][str(b)] = time_step(model, b, 1, context, reps)
        out["resume_s"][str(b)] = time_step(model, b, 2, context, reps)
        print(f"{name}: b={b:<4d} decode {out['decode_s'][str(b)] * 1e3:7.3f} ms   resume(2 tok) "
              f"{out['resume_s'][str(b)] * 1e3:7.3f} ms", flush=True)
    for p in prefills:
        out["prefill_s"][str(p)] = time_step(model, 1, p, 0, max(3, reps // 4))
        print(f"{name}: prefill {p} tokens {out['prefill_s'][str(p)] * 1e3:7.3f} ms", flush=True)
    # the calibration format of ``python -m tokenrouter.tools.admin calibrate`` (scheduler_model/calibrate.py)
    out["table"] = [{"batch_size": b, "decode_latency_s": [out["decode_s"][str(b)]],
                     "decode_median_s": out["decode_s"][str(b)],
                     "resume_latency_s": out["resume_s"][str(b)], "resume_extend_tokens": 2 * b,
                     "prefill": [{"rows": 1, "extend_tokens": p, "latency_s": out["prefill_s"][str(p)]}
                                 for p in prefills] if i == 0 else []}
                    for i, b in enumerate(batches)]
    if device == "cuda":
        out["decode_eager_b1_s"] = time_step(model, 1, 1, context, reps, graph=False)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def check() -> int:
    """The decoder's logits against transformers' LlamaForCausalLM (CPU, float32, tiny shape)."""
    try:  # the project's CPU venv needs its torchvision shim before transformers is imported
        from tokenrouter.engine.cpu import install

        install()
    except ImportError:
        pass
    from transformers import LlamaConfig, LlamaForCausalLM

    s = Shape(64, 2, 4, 2, 16, 128, 97)
    dec = Decoder(s, rows=2, cache_len=32, dtype=torch.float32, device="cpu", theta=1e4, eps=1e-6)
    cfg = LlamaConfig(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                      num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                      vocab_size=s.vocab, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    ref = LlamaForCausalLM(cfg).eval()
    sd = {"model.embed_tokens.weight": dec.embed, "lm_head.weight": dec.lm_head, "model.norm.weight": dec.norm}
    for i, L in enumerate(dec.layers):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": L.q, p + "self_attn.k_proj.weight": L.k,
                   p + "self_attn.v_proj.weight": L.v, p + "self_attn.o_proj.weight": L.o,
                   p + "mlp.gate_proj.weight": L.gate, p + "mlp.up_proj.weight": L.up,
                   p + "mlp.down_proj.weight": L.down, p + "input_layernorm.weight": L.in_norm,
                   p + "post_attention_layernorm.weight": L.post_norm})
    ref.load_state_dict({k: v.data for k, v in sd.items()}, strict=False)
    ids = torch.randint(0, s.vocab, (2, 7))
    with torch.no_grad():
        want = ref(ids).logits  # [2, 7, vocab]
        pos = torch.arange(7).expand(2, 7)
        got_prefill = dec(ids[:, :5], pos[:, :5])  # prompt of 5, then 2 decode steps
        got6 = dec(ids[:, 5:6], pos[:, 5:6])
        got7 = dec(ids[:, 6:7], pos[:, 6:7])
    err = max(float((got_prefill - want[:, 4]).abs().max()), float((got6 - want[:, 5]).abs().max()),
              float((got7 - want[:, 6]).abs().max()))
    scale = float(want.abs().max())
    print(f"max |decoder - transformers| = {err:.2e} (logit scale {scale:.2e})")
    return 0 if err <= 1e-4 * max(1.0, scale) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="slm=qwen3-0.6b,llm=qwen3-8b",
                    help=f"role=shape pairs; shapes: {', '.join(SHAPES)}")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each row's KV cache")
    ap.add_argument("--prefill", default="128,512,2048", help="prompt lengths for the prefill table")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check", action="store_true", help="compare the decoder with transformers (CPU) and exit")
    ap.add_argument("-o", "--out", default="gpu_step_latency.json")
    a = ap.parse_args(argv)
    if a.check:
        return check()
    try:
        models = dict(x.split("=") for x in a.models.split(",") if x)
        batches = [int(x) for x in a.batch_sizes.split(",")]
        prefills = [int(x) for x in a.prefill.split(",")]
    except ValueError:
        ap.error("--models takes role=shape pairs; --batch-sizes/--prefill comma-separated integers")
    bad = set(models.values()) - set(SHAPES)
    if bad:
        ap.error(f"unknown shapes {sorted(bad)}; known: {sorted(SHAPES)}")
    torch.backends.cuda.matmul.allow_tf32 = True
    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": "bfloat16", "graphs": a.device == "cuda",
              "models": {}, "roles": models}
    with torch.inference_mode():
        for role, name in models.items():
            report["models"][role] = {"name": name, **measure(name, SHAPES[name], batches, a.context, prefills,
                                                              a.reps, a.device)}
            with open(a.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
