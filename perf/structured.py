#!/usr/bin/env python
"""Structured output with routing on: validity, cost, equality, tool-call round trips.

On one server (started here for ``--pair`` with ``token_router`` set to ``--algorithm`` and its
``--params``, or a running one at ``--url``):

* **validity**: ``--requests`` requests (default 200) over the 22 JSON schemas of
  :data:`SCHEMAS` (nested objects, enums, arrays, required and optional fields, numbers with
  ranges, patterns), round robin, ``--concurrency`` at a time, through Triton's HTTP generate
  with ``guided_decoding.json``; each output is parsed and validated (``jsonschema``);
* **cost**: output tokens/s of the same prompts at ``--concurrency`` with the schema and without,
  ``--repeats`` pairs after a constrained warm-up run (not counted: it fills the prefix cache),
  the order alternating pair by pair; each unconstrained request writes as many tokens as its
  prompt's constrained one (``ignore_eos``), so that short JSON answers are not compared with
  long free ones (prefill and handoffs weigh more per token in a short answer); the ratio is the
  constrained runs' tokens/s over the unconstrained runs';
* **equality**: greedy output under a grammar that allows everything (``root ::= [^]*``)
  against unconstrained greedy output, token for token, for ``--equal-prompts`` prompts, both
  with the prompt already in the prefix cache (:func:`equality`);
* **tool calls** (unless ``--no-tools``): through the OpenAI front end, a forced call of a named
  function with the ``openai`` client, LiteLLM (its ``openai/`` provider) and ``instructor``
  (its TOOLS mode); a call round-trips when its name is the function's and its arguments
  validate against the function's parameters.

    source deploy/env.sh
    python perf/structured.py                                 # demo pair, R-Stitch tau 0.2
    python perf/structured.py --pair qwen-coder --params '{"tau": 0.05}'
    python perf/structured.py --url localhost:8001 --http-url localhost:8000 --no-tools

Writes ``structured.json`` (every request's outcome, the runs' token counts and times) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "perf"))

_S = {"type": "string"}
_I = {"type": "integer"}
_B = {"type": "boolean"}
_N = {"type": "number"}


def _obj(props: Dict[str, Any], required: Optional[List[str]] = None) -> Dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


#: (topic of the prompt, schema); every kind of constraint the issue names
SCHEMAS: List[Tuple[str, Dict[str, Any]]] = [
    ("a person", _obj({"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a book", _obj({"title": _S, "author": _S, "year": _I, "genres": {"type": "array", "items": _S, "maxItems": 3}})),
    ("a city", _obj({"name": _S, "country": _S, "population": _I, "capital": _B})),
    ("a product", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "price": _N,
                        "in_stock": _B})),
    ("the weather", _obj({"city": _S, "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                          "celsius": {"type": "integer", "minimum": -60, "maximum": 60}})),
    ("a movie", _obj({"title": _S, "rating": {"type": "number", "minimum": 0, "maximum": 10},
                      "cast": {"type": "array", "items": _obj({"actor": _S, "role": _S}), "maxItems": 3}})),
    ("an address", _obj({"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                         "country": {"enum": ["US", "FR", "DE", "JP"]}})),
    ("a to-do list", _obj({"items": {"type": "array", "minItems": 1, "maxItems": 4,
                                     "items": _obj({"task": _S, "done": _B})}})),
    ("an order", _obj({"id": _I, "customer": _obj({"name": _S, "email": _S}),
                       "lines": {"type": "array", "maxItems": 3, "items": _obj({"sku": _S, "qty": _I})}})),
    ("a recipe", _obj({"name": _S, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                       "ingredients": {"type": "array", "items": _S, "maxItems": 6},
                       "vegetarian": _B})),
    ("a log entry", _obj({"level": {"enum": ["debug", "info", "warning", "error"]}, "message": _S,
                          "code": {"type": "integer", "minimum": 0, "maximum": 999}})),
    ("a user account", _obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                             "admin": _B, "quota_gb": _N}, ["username", "admin"])),
    ("a flight", _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "to": {"type": "string", "pattern": "^[A-Z]{3}$"}, "stops": {"enum": [0, 1, 2]}})),
    ("a car", _obj({"make": _S, "model": _S, "year": {"type": "integer", "minimum": 1950, "maximum": 2026},
                    "electric": _B})),
    ("a planet", _obj({"name": _S, "moons": {"type": "integer", "minimum": 0, "maximum": 200},
                       "rings": _B, "type": {"enum": ["rocky", "gas giant", "ice giant", "dwarf"]}})),
    ("a company", _obj({"name": _S, "founded": _I,
                        "ceo": _obj({"name": _S, "since": _I}),
                        "public": _B})),
    ("a song", _obj({"title": _S, "artist": _S, "seconds": {"type": "integer", "minimum": 30, "maximum": 900}})),
    ("a bank transfer", _obj({"from_iban": _S, "to_iban": _S, "amount": {"type": "number", "minimum": 0},
                              "currency": {"enum": ["EUR", "USD", "GBP"]}})),
    ("a meeting", _obj({"title": _S, "attendees": {"type": "array", "items": _S, "minItems": 1, "maxItems": 4},
                        "minutes": {"enum": [15, 30, 45, 60]}, "remote": _B})),
    ("a sensor reading", _obj({"sensor": _S, "values": {"type": "array", "items": _N, "minItems": 1,
                                                          "maxItems": 5}, "ok": _B})),
    ("a chess move", _obj({"piece": {"enum": ["K", "Q", "R", "B", "N", "P"]},
                           "from": {"type": "string", "pattern": "^[a-h][1-8]$"},
                           "to": {"type": "string", "pattern": "^[a-h][1-8]$"}, "capture": _B})),
    ("a git commit", _obj({"hash": {"type": "string", "pattern": "^[0-9a-f]{7}$"}, "message": _S,
                           "files": {"type": "array", "items": _S, "maxItems": 3},
                           "author": _obj({"name": _S}, ["name"])}, ["hash", "message"])),
]
EQUAL_PROMPTS = ["Write a haiku about the sea.", "The capital of France is", "List three colors.",
                 "Explain recursion in one sentence.", "def add(a, b):", "Name a famous painter."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": _obj({"city": _S, "unit": {"enum": ["celsius", "fahrenheit"]}})}}


def _prompt(topic: str, schema: Dict[str, Any], i: int) -> str:
    return (f"Reply with one JSON object describing {topic} (example {i + 1}), with these fields: "
            f"{', '.join(schema['properties'])}.")


def _generate(http: str, prompt: str, sampling: Dict[str, Any], timeout: float = 1800) -> Dict[str, Any]:
    import requests

    body = {"text_input": prompt, "apply_chat_template": True, "exclude_input_in_output": True,
            "return_routing_trace": True, "sampling_parameters": json.dumps(sampling)}
    t0 = time.monotonic()
    r = requests.post(f"http://{http}/v2/models/token_router/generate", json=body, timeout=timeout)
    out = r.json()
    out["_status"], out["_s"] = r.status_code, time.monotonic() - t0
    if isinstance(out.get("routing_trace"), str):
        out["routing_trace"] = json.loads(out["routing_trace"])
    return out


def validity(http: str, a) -> Dict[str, Any]:
    """Each request's outcome: parsed, valid, finish_reason, tokens, LLM share."""
    import jsonschema

    jobs = [(i, SCHEMAS[i % len(SCHEMAS)]) for i in range(a.requests)]

    def one(job):
        i, (topic, schema) = job
        sp = {"max_tokens": a.max_tokens, "temperature": a.temperature, "seed": i,
              "guided_decoding": {"json": schema}}
        out = _generate(http, _prompt(topic, schema, i // len(SCHEMAS)), sp)
        row = {"i": i, "schema": i % len(SCHEMAS), "status": out["_status"], "finish": out.get("finish_reason"),
               "parsed": False, "valid": False, "seconds": round(out["_s"], 3)}
        if out["_status"] != 200:
            row["error"] = out.get("error")
            return row
        tr = out["routing_trace"]["trace"]
        row["tokens"], row["llm_tokens"] = len(tr), sum(1 for m in tr if m)
        try:
            obj = json.loads(out["text_output"])
            row["parsed"] = True
            jsonschema.validate(obj, schema)
            row["valid"] = True
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["text"] = out["text_output"][:500]
        return row

    with ThreadPoolExecutor(a.concurrency) as ex:
        rows = list(ex.map(one, jobs))
    n = len(rows)
    return {"requests": n, "schemas": len(SCHEMAS), "parsed": sum(r["parsed"] for r in rows),
            "valid": sum(r["valid"] for r in rows),
            "finish_length": sum(r["finish"] == "length" for r in rows),
            "llm_token_share": round(sum(r.get("llm_tokens", 0) for r in rows) /
                                     max(1, sum(r.get("tokens", 0) for r in rows)), 4),
            "rows": rows}


def cost(http: str, a) -> Dict[str, Any]:
    """Output tokens/s with and without the schema on the same prompts and with the same output
    lengths: each unconstrained request writes as many tokens as its prompt's constrained answer
    (``max_tokens`` = that, ``ignore_eos``), so that prefills and handoffs weigh the same in both.

    A constrained warm-up run (not counted) sets those lengths and puts every prompt in the
    prefix cache; then ``--repeats`` pairs, the order alternating (guided first in even repeats,
    plain first in odd ones), so that neither kind always runs first or on a colder cache.
    ``guided_over_plain`` is the guided runs' tokens/s over the plain runs' (sums);
    ``pair_ratios`` each pair's."""
    jobs = [(i, SCHEMAS[i % len(SCHEMAS)]) for i in range(a.cost_requests)]
    lengths: Dict[int, int] = {}

    def run(guided: bool) -> Tuple[int, float]:
        def one(job):
            i, (topic, schema) = job
            sp: Dict[str, Any] = {"max_tokens": a.max_tokens, "temperature": 0}
            if guided:
                sp["guided_decoding"] = {"json": schema}
            else:
                sp.update(max_tokens=lengths.get(i) or a.max_tokens, ignore_eos=True)
            out = _generate(http, _prompt(topic, schema, i // len(SCHEMAS)), sp)
            n = len(out["routing_trace"]["trace"]) if out["_status"] == 200 else 0
            if guided:
                lengths.setdefault(i, n)
            return n

        t0 = time.monotonic()
        with ThreadPoolExecutor(a.concurrency) as ex:
            toks = sum(ex.map(one, jobs))
        return toks, time.monotonic() - t0

    toks, dt = run(True)
    print(f"cost warm-up guided: {toks} tokens in {dt:.1f} s (not counted)", flush=True)
    runs = []
    for rep in range(a.repeats):
        for guided in ((True, False) if rep % 2 == 0 else (False, True)):
            toks, dt = run(guided)
            runs.append({"repeat": rep, "guided": guided, "tokens": toks, "seconds": round(dt, 3),
                         "tokens_per_s": round(toks / dt, 3)})
            print(f"cost repeat {rep} {'guided' if guided else 'plain '}: {toks} tokens in {dt:.1f} s = "
                  f"{toks / dt:.2f} tok/s", flush=True)
    g = [r["tokens_per_s"] for r in runs if r["guided"]]
    p = [r["tokens_per_s"] for r in runs if not r["guided"]]
    return {"runs": runs, "guided_over_plain": round(sum(g) / sum(p), 4) if sum(p) else None,
            "pair_ratios": [round(x / y, 4) for x, y in zip(g, p) if y]}


def equality(http: str, a) -> Dict[str, Any]:
    """Greedy token ids with an allow-everything grammar against without, prompt by prompt.

    Each prompt is sent plain twice, then with the grammar: the second plain request and the
    guided one both find the prompt in the prefix cache, so they are compared under the same
    cache state (in bfloat16 a prompt prefilled in two parts rounds differently from one
    prefilled whole, and a near-tie can then go the other way: ``plain_repeatable`` counts the
    prompts whose two plain runs agree, the noise floor of the comparison)."""
    same, repeat = [], []
    for prompt in EQUAL_PROMPTS[: a.equal_prompts]:
        sp = {"max_tokens": a.max_tokens, "temperature": 0}
        first = _generate(http, prompt, sp)["routing_trace"]["token_ids"]
        plain = _generate(http, prompt, sp)["routing_trace"]["token_ids"]
        free = _generate(http, prompt, {**sp, "guided_decoding": {"grammar": "root ::= [^]*"}})
        same.append(free["routing_trace"]["token_ids"] == plain)
        repeat.append(first == plain)
    return {"prompts": len(same), "equal": sum(same), "per_prompt": same, "plain_repeatable": sum(repeat),
            "plain_repeatable_per_prompt": repeat}


def tool_calls(openai_base: str, a) -> Dict[str, Any]:
    """A forced call of ``get_weather`` through the openai client, LiteLLM and instructor."""
    import jsonschema
    import openai

    params = WEATHER["function"]["parameters"]
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out: Dict[str, Any] = {}

    def check(name, args_text):
        args = json.loads(args_text)
        jsonschema.validate(args, params)
        return name == "get_weather"

    client = openai.OpenAI(base_url=openai_base + "/v1", api_key="unused", max_retries=0, timeout=1800)
    try:
        r = client.chat.completions.create(model="token_router", messages=ask, tools=[WEATHER], tool_choice=named,
                                           max_tokens=a.max_tokens, temperature=0)
        c = r.choices[0].message.tool_calls[0]
        out["openai"] = check(c.function.name, c.function.arguments)
    except Exception as e:  # noqa: BLE001 - reported, the others still run
        out["openai"] = f"{type(e).__name__}: {e}"
    try:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        r = litellm.completion(model="openai/token_router", api_base=openai_base + "/v1", api_key="unused",
                               messages=ask, tools=[WEATHER], tool_choice=named, max_tokens=a.max_tokens,
                               temperature=0)
        c = r.choices[0].message.tool_calls[0]
        out["litellm"] = check(c.function.name, c.function.arguments)
    except Exception as e:  # noqa: BLE001
        out["litellm"] = f"{type(e).__name__}: {e}"
    try:
        from typing import Literal

        import instructor
        from pydantic import BaseModel

        class Weather(BaseModel):
            city: str
            unit: Literal["celsius", "fahrenheit"]

        w = instructor.from_openai(client, mode=instructor.Mode.TOOLS).chat.completions.create(
            model="token_router", response_model=Weather, messages=ask, max_tokens=a.max_tokens, temperature=0,
            max_retries=0)
        out["instructor"] = isinstance(w, Weather)
    except Exception as e:  # noqa: BLE001
        out["instructor"] = f"{type(e).__name__}: {e}"
    return out


def _frontend(grpc: str, log: str) -> Tuple[subprocess.Popen, str]:
    """Start the OpenAI front end in front of ``grpc`` on a free port: (process, base URL)."""
    import urllib.request

    from tritonserver import free_ports

    port = free_ports(1)[0]
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tokenrouter.tools.openai_frontend", "--triton-url", grpc,
                                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the OpenAI front end did not start; see {log}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="", help="gRPC address of a running server (default: start one here)")
    ap.add_argument("--http-url", default="", help="its HTTP address (with --url)")
    ap.add_argument("--pair", default="demo", help="model pair of the server started here (default demo)")
    ap.add_argument("--algorithm", default="rstitch", help="token_router's algorithm (server started here)")
    ap.add_argument("--params", default="", help="its algorithm_params as JSON (default: the repository's)")
    ap.add_argument("--requests", type=int, default=200, help="validity requests (default 200)")
    ap.add_argument("--cost-requests", type=int, default=48, help="requests per cost run (default 48)")
    ap.add_argument("--repeats", type=int, default=2, help="guided/plain pairs of cost runs (default 2)")
    ap.add_argument("--equal-prompts", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0, help="of the validity requests (seeded)")
    ap.add_argument("--no-tools", action="store_true", help="skip the tool-call round trips")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: validity, cost, equality")
    ap.add_argument("--out", default=os.path.join(ROOT, "perf", "results", "structured",
                                                  time.strftime("%Y-%m-%d-%H%M%S")))
    a = ap.parse_args()
    if a.url and not a.http_url:
        ap.error("--url needs --http-url")
    skip = {s for s in a.skip.split(",") if s}
    os.makedirs(a.out, exist_ok=True)
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "pair": a.pair,
                              "command": "python perf/structured.py " + " ".join(sys.argv[1:]),
                              "args": {k: v for k, v in vars(a).items() if k != "out"}}

    def save():
        with open(os.path.join(a.out, "structured.json"), "w") as f:
            json.dump(report, f, indent=1)

    def run(grpc: str, http: str) -> None:
        if "validity" not in skip:
            report["validity"] = validity(http, a)
            v = report["validity"]
            print(f"validity: {v['valid']}/{v['requests']} valid, {v['parsed']} parsed, "
                  f"{v['finish_length']} cut at max_tokens, LLM share {v['llm_token_share']}", flush=True)
            save()
        if "equality" not in skip:
            report["equality"] = equality(http, a)
            eq = report["equality"]
            print(f"equality: {eq['equal']}/{eq['prompts']} equal (plain against plain: "
                  f"{eq['plain_repeatable']}/{eq['prompts']})", flush=True)
            save()
        if "cost" not in skip:
            report["cost"] = cost(http, a)
            print(f"cost: guided/plain tokens/s {report['cost']['guided_over_plain']}", flush=True)
            save()
        if not a.no_tools:
            proc, base = _frontend(grpc, os.path.join(a.out, "frontend.log"))
            try:
                report["tool_calls"] = tool_calls(base, a)
            finally:
                proc.terminate()
                proc.wait(30)
            print(f"tool calls: {report['tool_calls']}", flush=True)
            save()

    if a.url:
        run(a.url, a.http_url)
    else:
        from tokenrouter.tools.repository import make_variant
        from tritonserver import TritonServer, exit_on_termination

        exit_on_termination()
        router = {"algorithm": a.algorithm}
        if a.params:
            router["algorithm_params"] = a.params
        with tempfile.TemporaryDirectory(prefix="structured-") as work:
            repo = make_variant(os.path.join(ROOT, "model_repository"), os.path.join(work, "model_repository"),
                                a.pair, model_params={"token_router": router})
            report["router"] = router
            with TritonServer(repo, ready_timeout=1800, log_path=os.path.join(work, "tritonserver.log")) as srv:
                run(srv.grpc_url, srv.http_url)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
