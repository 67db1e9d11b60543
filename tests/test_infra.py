"""Checks of the set-up (deploy/env.sh, prepare_weights, assemble_backends) and of
the Triton chain with a throwaway decoupled echo model. Not tests of TokenRouter's
own models."""

from __future__ import annotations

import json
import os
import queue
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tritonserver import TritonServer

ENV_VARS = (
    "VIRTUAL_ENV", "TOKENROUTER_ROOT", "TOKENROUTER_SRC", "TOKENROUTER_CACHE",
    "TOKENROUTER_WEIGHTS", "TRITONSERVER", "TRITON_BACKEND_DIR", "LD_LIBRARY_PATH",
)


def test_env_exports(repo_root):
    for var in ENV_VARS:
        assert os.environ.get(var), f"{var} not exported by deploy/env.sh"
    assert Path(os.environ["TOKENROUTER_ROOT"]) == repo_root
    assert Path(os.environ["TOKENROUTER_SRC"]) == repo_root / "python_backend_src"
    assert os.environ["PATH"].split(":")[0] == os.path.join(os.environ["VIRTUAL_ENV"], "bin")
    assert Path(sys.prefix) == Path(os.environ["VIRTUAL_ENV"]), "pytest is not the venv's python"
    import scheduler_model
    import tokenrouter
    assert Path(tokenrouter.__file__).parent == repo_root / "python_backend_src" / "tokenrouter"
    assert Path(scheduler_model.__file__).parent == repo_root / "scheduler_model"
    ld = os.environ["LD_LIBRARY_PATH"].split(":")
    import sysconfig
    assert ld[0] == sysconfig.get_config_var("LIBDIR"), "python LIBDIR must come first"
    assert any(p.endswith("nvidia_pytriton.libs") for p in ld)
    assert os.access(os.environ["TRITONSERVER"], os.X_OK)
    import torch
    if not torch.cuda.is_available():
        assert os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def test_backend_dir_has_stub():
    bdir = Path(os.environ["TRITON_BACKEND_DIR"])
    stub = bdir / "python" / "triton_python_backend_stub"
    assert (bdir / "python" / "libtriton_python.so").is_file()
    assert (bdir / "python" / "triton_python_backend_utils.py").is_file()
    assert stub.is_file() and os.access(stub, os.X_OK)


def test_backend_dir_links_repo_backends(repo_root):
    bdir = Path(os.environ["TRITON_BACKEND_DIR"])
    for model_py in (repo_root / "backends").glob("*/model.py"):
        link = bdir / model_py.parent.name
        assert link.is_dir() and (link / "model.py").resolve() == model_py.resolve()


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    path = Path(os.environ["TOKENROUTER_WEIGHTS"]) / "smollm2-135m-instruct"
    assert (path / ".tokenrouter-complete").is_file(), "run deploy/prepare_weights.py"
    return path


@pytest.mark.slow  # loads the checkpoint in transformers
def test_weights_answer_paris(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_size_realistic_config(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    path = smollm2_dir.parent / "llama-size-realistic"
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.vocab_size == 49152 and cfg.hidden_size == 2048 and cfg.tie_word_embeddings
    assert not list(path.glob("*.safetensors")), "size-realistic must have no weights"
    assert "random" in (path / "README.txt").read_text().lower()
    a = AutoTokenizer.from_pretrained(path)("What is the capital of France?")["input_ids"]
    b = AutoTokenizer.from_pretrained(smollm2_dir)("What is the capital of France?")["input_ids"]
    assert a == b



def test_repository_variant_rejects_an_unknown_transport(repo_root, tmp_path):
    from tokenrouter.tools.repository import add_router, make_variant

    out = tmp_path / "variant"
    with pytest.raises(ValueError, match="transport must be one of"):
        make_variant(str(repo_root / "model_repository"), str(out), routers={"r2": {"transport": "bogus"}})
    assert not out.exists()  # refused before anything was written
    repo = make_variant(str(repo_root / "model_repository"), str(out), routers={"r3": {"transport": "Triton"}})
    assert (Path(repo) / "r3" / "config.pbtxt").exists()
    with pytest.raises(ValueError, match="transport must be one of"):
        add_router(repo, "r4", {"transport": "http"})
    assert not (Path(repo) / "r4").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"model_params": {"token_router": {"algorithm": "nope"}}},
     "router token_router: unknown routing algorithm 'nope'"),
    ({"model_params": {"token_router": {"algorithm_params": '{"tau": 5}'}}}, "'tau'=5.0 outside"),
    ({"model_params": {"token_router": {"algorithm_params": "[1]"}}}, "must be a JSON object"),
    ({"model_params": {"token_router": {"models": "slm"}}}, "needs between 2 and 2 models"),
    # a router copied from token_router gets the pair's algorithm_params (max_llm_run: R-Stitch only)
    ({"pair": "size-realistic", "routers": {"r_citer": {"algorithm": "citer"}}},
     "router r_citer: unknown parameters for algorithm 'citer': \\['max_llm_run'\\]"),
])
def test_repository_variant_rejects_routing_its_router_would_not_load(repo_root, tmp_path, kwargs, message):
    from tokenrouter.tools.repository import make_variant

    out = tmp_path / "variant"
    with pytest.raises(ValueError, match=message):
        make_variant(str(repo_root / "model_repository"), str(out), **kwargs)
    assert not out.exists()  # refused before anything was written


def test_repository_variant_keeps_routing_its_router_loads(repo_root, tmp_path):
    from tokenrouter.tools.repository import make_variant, read_config

    repo = make_variant(str(repo_root / "model_repository"), str(tmp_path / "v"), "size-realistic",
                        model_params={"token_router": {"algorithm": "rstitch"}},
                        routers={"r_none": {"algorithm": "none", "algorithm_params": '{"model": 1}'}})
    params = read_config(str(Path(repo) / "r_none" / "config.pbtxt")).parameters
    assert params["algorithm"].string_value == "none"
    assert params["algorithm_params"].string_value == '{"model": 1}'


ECHO_MODEL = textwrap.dedent('''
    import locale
    locale.setlocale(locale.LC_ALL, "C.UTF-8")  # the stub runs in the C locale

    import json, os, sys

    import numpy as np
    import scheduler_model
    import tokenrouter  # the stub ignores PYTHONPATH: both come from the venv (deploy/env.sh)
    import torch
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.info = json.dumps({
                "prefix": sys.prefix, "isolated": sys.flags.isolated,
                "torch": torch.__version__, "sum": float(torch.arange(4.0).sum()),
                "tokenrouter": tokenrouter.__file__, "scheduler_model": scheduler_model.__file__,
            })

        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
                words = text.decode().split() + [self.info]
                for i, w in enumerate(words):
                    out = pb_utils.Tensor("text_output", np.array([w.encode()], dtype=np.object_))
                    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == len(words) - 1 else 0
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=flags)
            return None
''')

ECHO_CONFIG = textwrap.dedent('''
    backend: "python"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
    output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
    instance_group [ { count: 1 kind: KIND_CPU } ]
''')


def test_triton_echo_chain(tmp_path):
    """tritonserver from env.sh's environment runs a decoupled Python model that
    imports torch and numpy from the venv; gRPC streaming returns every response."""
    import tritonclient.grpc as grpcclient

    model = tmp_path / "echo"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(ECHO_MODEL)
    (model / "config.pbtxt").write_text(ECHO_CONFIG)

    with TritonServer(models={"echo": model}, ready_timeout=180) as server:
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            inp = grpcclient.InferInput("text_input", [1], "BYTES")
            inp.set_data_from_numpy(np.array([b"hello triton world"], dtype=np.object_))
            client.async_stream_infer("echo", [inp], request_id="1",
                                      enable_empty_final_response=True)
            texts = []
            while True:
                result, error = results.get(timeout=60)
                assert error is None, error
                params = result.get_response().parameters
                if result.as_numpy("text_output") is not None:
                    texts.append(result.as_numpy("text_output")[0].decode())
                if params["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
            client.close()
    assert texts[:3] == ["hello", "triton", "world"]
    info = json.loads(texts[3])
    assert Path(info["prefix"]) == Path(os.environ["VIRTUAL_ENV"])
    assert info["sum"] == 6.0
    root = Path(os.environ["TOKENROUTER_ROOT"])
    assert Path(info["tokenrouter"]) == root / "python_backend_src" / "tokenrouter" / "__init__.py"
    assert Path(info["scheduler_model"]) == root / "scheduler_model" / "__init__.py"


def test_a_start_whose_models_never_finish_loading_counts_as_stalled(tmp_path):
    """The test server's start-up watch: a model whose stub logged "load done" without Triton's
    "successfully loaded" for LOAD_STALL_S seconds is named (the start is then retried with one
    model loading at a time); a loaded model is not."""
    import tritonserver as ts

    log = tmp_path / "tritonserver.log"
    log.write_text('I1206 init_watchdog.py:71] "llm: load done in 32.7 s"\n'
                   'I1206 init_watchdog.py:71] "slm: load done in 12.0 s"\n'
                   "I1206 model_lifecycle.cc:839] \"successfully loaded 'slm'\"\n")
    server = TritonServer.__new__(TritonServer)
    server.log_path = log
    seen: dict = {}
    assert server._stalled_models(seen, 0.0) == []  # first seen now
    assert server._stalled_models(seen, ts.LOAD_STALL_S - 1) == []
    assert server._stalled_models(seen, ts.LOAD_STALL_S + 1) == ["llm"]
    with log.open("a") as f:
        f.write("I1206 model_lifecycle.cc:839] \"successfully loaded 'llm'\"\n")
    assert server._stalled_models(seen, ts.LOAD_STALL_S + 2) == []


def test_set_algorithm_alone_gives_that_algorithms_defaults(repo_root, tmp_path, capsys):
    """``--set token_router.algorithm=random`` without ``algorithm_params``: the shipped parameters
    (R-Stitch's tau) belong to the shipped algorithm, so the router gets random's defaults and the user
    a note; naming the shipped algorithm again keeps its parameters."""
    from tokenrouter.tools.repository import main, read_config

    def written(*sets):
        out = tmp_path / f"v{len(list(tmp_path.iterdir()))}"
        argv = ["--src", str(repo_root / "model_repository"), "--out", str(out)]
        assert main(argv + [x for s in sets for x in ("--set", s)]) == 0, capsys.readouterr().err
        params = read_config(str(out / "token_router" / "config.pbtxt")).parameters
        return params["algorithm"].string_value, params["algorithm_params"].string_value, capsys.readouterr().err

    shipped = written()
    assert shipped[0] == "rstitch" and "tau" in shipped[1]
    algo, params, err = written("token_router.algorithm=random")
    assert (algo, params) == ("random", "{}") and "algorithm 'random' with its default parameters" in err
    assert written("token_router.algorithm=rstitch")[:2] == shipped[:2]
    algo, params, _ = written("token_router.algorithm=random", 'token_router.algorithm_params={"p": 0.3}')
    assert (algo, json.loads(params)) == ("random", {"p": 0.3})
