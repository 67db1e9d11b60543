"""Client helpers for the tests: plain Triton clients (HTTP generate, gRPC streaming, metrics)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import queue
import re
import time
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import requests
import tritonclient.grpc as grpcclient

from tokenrouter.tools import admin


def generate(server, prompt: str, sampling: Optional[Dict[str, Any]] = None, *, chat: bool = False,
             trace: bool = True, exclude_input: bool = True, timeout: float = 300,
             model: str = "token_router") -> Dict[str, Any]:
    """Non-streaming request through the HTTP ``/generate`` endpoint of router ``model``;
    returns the JSON with routing fields parsed and ``_status``."""
    body: Dict[str, Any] = {"text_input": prompt, "apply_chat_template": chat,
                            "exclude_input_in_output": exclude_input, "return_routing_trace": trace}
    if sampling is not None:
        body["sampling_parameters"] = json.dumps(sampling)
    r = requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=timeout)
    out = r.json()
    out["_status"] = r.status_code
    for k in ("routing_summary", "routing_trace", "logprobs"):
        if isinstance(out.get(k), str):
            out[k] = json.loads(out[k])
    return out


def concurrently(*calls: Callable[[], Any]) -> List[Any]:
    """Run the zero-argument ``calls`` at once, one thread each; their results in order (the first
    exception is raised once all have ended)."""
    if not calls:
        return []
    with cf.ThreadPoolExecutor(len(calls)) as ex:
        return [f.result() for f in [ex.submit(c) for c in calls]]


def generate_many(server, requests: Sequence[tuple], **kwargs) -> List[Dict[str, Any]]:
    """:func:`generate` for each of ``requests`` at once, one client thread each (the models batch
    them); the outputs in the order of ``requests``.

    Args:
        requests: ``(prompt, sampling)`` or ``(prompt, sampling, model)`` tuples.
        kwargs: more of generate's arguments, for every request (``chat``, ``timeout``, ``model``).
    """
    def one(req):
        prompt, sampling, *model = req
        return lambda: generate(server, prompt, sampling, **{**kwargs, **({"model": model[0]} if model else {})})

    return concurrently(*map(one, requests))


def _input(name, arr, dtype):
    x = grpcclient.InferInput(name, list(arr.shape), dtype)
    x.set_data_from_numpy(arr)
    return x


def router_inputs(prompt: str, sampling: Optional[Dict[str, Any]], stream: bool, *, chat=False, trace=True,
                  exclude_input=True) -> List[Any]:
    ins = [_input("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
           _input("stream", np.array([stream]), "BOOL"),
           _input("apply_chat_template", np.array([chat]), "BOOL"),
           _input("exclude_input_in_output", np.array([exclude_input]), "BOOL"),
           _input("return_routing_trace", np.array([trace]), "BOOL")]
    if sampling is not None:
        ins.append(_input("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_),
                          "BYTES"))
    return ins


def grpc_stream(server, prompt: str, sampling: Optional[Dict[str, Any]] = None, *, stream: bool = True,
                chat: bool = False, trace: bool = True, timeout: float = 300,
                inputs: Optional[List[Any]] = None, model: str = "token_router") -> Dict[str, Any]:
    """One request over a gRPC stream to router ``model``; returns chunks, final fields, or ``error``;
    ``logprobs_chunks``: each response's ``logprobs`` (decoded JSON) where it has one."""
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    out: Dict[str, Any] = {"chunks": [], "error": None, "logprobs_chunks": []}
    try:
        c.async_stream_infer(model, inputs or router_inputs(prompt, sampling, stream, chat=chat,
                                                                      trace=trace),
                             enable_empty_final_response=True)
        deadline = time.time() + timeout
        while True:
            result, error = q.get(timeout=max(1.0, deadline - time.time()))
            if error is not None:
                out["error"] = str(error)
                break
            t = result.as_numpy("text_output")
            if t is not None and t.size:
                out["chunks"].append(t.reshape(-1)[0].decode("utf-8"))
            lp = result.as_numpy("logprobs")
            if lp is not None and lp.size:
                out["logprobs_chunks"].append(json.loads(lp.reshape(-1)[0]))
            for k in ("finish_reason", "routing_summary", "routing_trace"):
                v = result.as_numpy(k)
                if v is not None and v.size:
                    out[k] = v.reshape(-1)[0].decode("utf-8")
                    if k != "finish_reason":
                        out[k] = json.loads(out[k])
            for k in ("num_input_tokens", "num_output_tokens"):
                v = result.as_numpy(k)
                if v is not None and v.size:
                    out[k] = int(v.reshape(-1)[0])
            p = result.get_response().parameters.get("triton_final_response")
            if p is not None and p.bool_param:
                break
    finally:
        c.stop_stream()
        c.close()
    out["text"] = "".join(out["chunks"])
    return out


def stream_then_cancel(server, model: str, prompt: str, sampling: Dict[str, Any], *, chunks: int = 3,
                       timeout: float = 180) -> int:
    """A client that gives up mid-stream: a streamed request to router ``model``, cancelled
    (``stop_stream(cancel_requests=True)``) once ``chunks`` responses have come, each within
    ``timeout`` seconds and without an error.  Returns the responses read (``chunks``)."""
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer(model, router_inputs(prompt, sampling, True))
    got = 0
    while got < chunks:
        result, error = q.get(timeout=timeout)
        assert error is None, error
        got += 1
    c.stop_stream(cancel_requests=True)
    c.close()
    return got


def triton_stats(server, model: str) -> Dict[str, int]:
    """Triton's own statistics of ``model`` (``GET /v2/models/<model>/stats``): inference_count,
    execution_count and the success count."""
    st = requests.get(f"http://{server.http_url}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]
    return {"inference_count": int(st.get("inference_count", 0)), "execution_count": int(st.get("execution_count", 0)),
            "success_count": int(st["inference_stats"]["success"]["count"])}


def model_stats(server, model: str) -> Dict[str, Any]:
    """Statistics of one LLM subserver (its ``stats`` op)."""
    return admin.model_stats(server.grpc_url, model)


def metric_values(server, name: str) -> Dict[str, float]:
    """Prometheus metric ``name`` from Triton's metrics endpoint: {model label: value}."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^' + re.escape(name) + r'\{([^}]*)\}\s+([0-9.eE+-]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels.get("model", "")] = float(m.group(2))
    return out


def wait_kv_released(server, models=("slm", "llm"), timeout: float = 30.0) -> Dict[str, Dict[str, Any]]:
    """Poll the models' stats until no KV is held; return the last stats."""
    deadline = time.time() + timeout
    while True:
        st = {m: model_stats(server, m) for m in models}
        if all(s["kv_tokens_in_use"] == 0 and s["active"] == 0 for s in st.values()) or time.time() > deadline:
            return st
        time.sleep(0.2)


# ------------------------------------------------------------------ logprobs
def token_logprobs(entries: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The router's ``logprobs`` output (vllm_backend's: per token ``{"<id>": {"logprob", "rank",
    "decoded_token"}}``, the token first) as per-token ``{"id", "logprob", "rank", "top": [(id,
    logprob), ...]}``: ``top`` the other entries in the order sent (the top N, most likely first;
    the token itself among them when it is one of the N)."""
    out = []
    for d in entries:
        items = [(int(k), v) for k, v in d.items()]
        tid, first = items[0]
        top = [(i, v["logprob"]) for i, v in items[1:]]
        out.append({"id": tid, "logprob": first["logprob"], "rank": first["rank"], "decoded": first["decoded_token"],
                    "top": top, "top_ranks": [v["rank"] for _, v in items[1:]]})
    return out


def top_n(entry: Dict[str, Any], n: int) -> List[tuple]:
    """The ``n`` most likely tokens of one :func:`token_logprobs` entry, most likely first."""
    return sorted(entry["top"] + [(entry["id"], entry["logprob"])], key=lambda a: -a[1])[:n]


def model_next_token(server, model: str, token_ids: List[int], n: int, models=("slm", "llm"),
                     timeout: float = 300) -> Dict[str, Any]:
    """One model alone writes one greedy token after ``token_ids`` (a ``run`` op straight to its Triton
    interface: the exact ids, no tokenizer): ``{"id", "logprob", "rank", "top": [(id, logprob), ...]}``
    with its top ``n``, from the model's own raw distribution for that prefix."""
    import uuid

    rid = "next-" + uuid.uuid4().hex
    hdr = json.dumps({"rid": rid, "max_tokens": 1, "models": list(models), "algorithm": "none",
                      "params": {"model": list(models).index(model)},
                      "sampling": {"temperature": 0, "logprobs": n}})
    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    ids: List[int] = []
    lps: List[float] = []
    tops: List[Any] = []
    try:
        c.async_stream_infer(model, [_input("request_id", np.array([[rid.encode()]], dtype=np.object_), "BYTES"),
                                     _input("input_ids", np.array([token_ids], dtype=np.int64), "INT64"),
                                     _input("peer_req", np.array([[hdr.encode()]], dtype=np.object_), "BYTES")])
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            ev = json.loads(result.as_numpy("event").reshape(-1)[0])
            ids += [int(t) for t in result.as_numpy("output_ids").reshape(-1)]
            lps += ev.get("logprobs") or []
            tops += ev.get("top_logprobs") or []
            if ev["kind"] != "tokens":
                break
    finally:
        c.stop_stream()
        c.close()
    assert len(ids) == len(lps) == len(tops) == 1, (ids, lps, tops)
    rank, top_ids, top_lps = tops[0]
    return {"id": ids[0], "logprob": lps[0], "rank": rank, "top": list(zip(top_ids, top_lps))}


def assert_top_close(got: List[tuple], ref: List[tuple], tol: float, where: str = "") -> None:
    """Two top-N lists ``[(id, logprob), ...]`` (most likely first) agree within ``tol``: the same
    logprob at each place, and the same ids, except ids that trade places with a near-tie or sit at
    the boundary of the N within ``tol`` of the last value."""
    assert len(got) == len(ref), (where, got, ref)
    for (gi, gv), (ri, rv) in zip(got, ref):
        assert abs(gv - rv) <= tol, (where, got, ref)
    g, r = dict(got), dict(ref)
    for i in set(g) ^ set(r):
        v, last = (g[i], got[-1][1]) if i in g else (r[i], ref[-1][1])
        assert abs(v - last) <= 2 * tol, (where, got, ref)
    for i in set(g) & set(r):
        assert abs(g[i] - r[i]) <= tol, (where, got, ref)


def own_runs(server, prompt_ids: List[int], ids: List[int], models: List[str], n: int,
             workers: int = 4) -> List[Dict[str, Any]]:
    """For each output position i, model ``models[i]``'s own greedy next token after ``prompt_ids +
    ids[:i]`` with its top ``n`` (:func:`model_next_token`), a few at a time."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda i: model_next_token(server, models[i], prompt_ids + ids[:i], n), range(len(ids))))


def assert_from_writers(server, prompt_ids: List[int], out: Dict[str, Any], n: int, tol: float,
                        models=("slm", "llm"), same_token: bool = True) -> List[Dict[str, Any]]:
    """Every output token of a greedy routed answer ``out`` (with ``routing_trace`` and ``logprobs`` N =
    ``n``) carries the logprob and top ``n`` of the model that wrote it (``routing_trace.trace``): its
    own run (no grammar) for the same prefix agrees within ``tol``, and gives the same token unless
    ``same_token`` is False (a grammar chose the token; its logprob is then compared where the run's
    top ``n`` holds it).  Returns those runs."""
    ids, trace = out["routing_trace"]["token_ids"], out["routing_trace"]["trace"]
    entries = token_logprobs(out["logprobs"])
    assert [e["id"] for e in entries] == ids
    refs = own_runs(server, prompt_ids, ids, [models[w] for w in trace], n)
    for i, (e, ref) in enumerate(zip(entries, refs)):
        where = f"token {i} by {models[trace[i]]}"
        if same_token:
            assert ref["id"] == e["id"], (where, ref, e)
            assert abs(ref["logprob"] - e["logprob"]) <= tol, (where, ref, e)
        elif e["id"] in dict(ref["top"]):
            assert abs(dict(ref["top"])[e["id"]] - e["logprob"]) <= tol, (where, ref, e)
        assert_top_close(top_n(e, n), ref["top"], tol, where)
    return refs
