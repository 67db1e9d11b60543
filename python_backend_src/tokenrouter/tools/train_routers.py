"""Train the learned routers (CITER, R2R, Co-LLM, draft-verify's) for an SLM/LLM pair on the CPU.

    python -m tokenrouter.tools.train_routers                      # the demo pair -> tokenrouter/routers/
    python -m tokenrouter.tools.train_routers --r2r-width 1024     # R2R's published 6×1024 router
    python -m tokenrouter.tools.train_routers --kinds dv           # draft-verify's router only

Data (R2R-style labelling, one forward pass per model, teacher-forced):

1. For every prompt of ``--prompts`` (JSON lines ``{"prompt": …}``, optionally with a
   ``"system"`` turn; chat template applied) the **LLM** writes a greedy continuation of up to
   ``--max-new-tokens`` tokens (the trajectory).
2. The trajectory is run teacher-forced through the served SLM (features:
   last hidden state after the final norm ``[H]``, next-token logits ``[V]``,
   the SLM's greedy token) and through the *labelling SLM*.
3. Label per position: ``diff = argmax(labelling SLM) != argmax(LLM)`` -- R2R's
   "the SLM's token differs from the LLM's".
4. Continuation check (R2R §3.2, "critical" vs "neutral" divergences): at every
   ``diff`` position the LLM continues greedily for ``--rollout-tokens`` (W)
   tokens after the *SLM's* token, reusing the trajectory's KV cache.  The
   divergence is **neutral** when that continuation re-joins the trajectory --
   its last ``--rejoin-tokens`` (K) tokens occur, in order, in the trajectory's
   next W + K tokens, or both end with the same K tokens at a stop token -- and
   **critical** otherwise (R2R asks a verifier LLM whether the meaning changed;
   re-joining the LLM's own text is the cheap, deterministic stand-in).
   ``critical = diff and not neutral``; W = 0 skips the check (critical = diff).

Targets: R2R ``critical`` (it routes only divergences that change the
continuation); CITER confidence ``1 − critical`` (the SLM's token is
acceptable, CITER's long-term view); Co-LLM (its weak-supervision
initialisation) defer target ``diff``.

Draft-verify's router (kind ``dv``, rule ``router`` of :mod:`~tokenrouter.algorithms.draft_verify`)
judges a drafted token from the **LLM's** distribution at its position: its input is
:func:`~tokenrouter.algorithms.learned.dv_features` of the LLM's teacher-forced logits at each
trajectory position, evaluated at the labelling SLM's greedy token (the draft it would make),
its target ``critical``.  It is trained on the ``diff`` positions only: where the draft is the
LLM's own argmax the rule keeps it without asking the router (and the label is 0 there).

The demo pair serves the **same** SmolLM2-135M weights in both roles, so the
served SLM never differs from the LLM and every label would be 0.  For that
case (``--label-slm auto`` with SLM == LLM) the labelling SLM is a
**fake-quantised copy** of the SLM (``--bits``-bit symmetric round-to-nearest,
groups of ``--group`` input channels, every decoder linear layer): the routers
learn "positions where a weaker copy of this model would pick another token
than the full model", a proxy for hard tokens computed from the served SLM's
own features.  With a real pair (different checkpoints) the served SLM labels
itself (``--label-slm served``).

Training: Adam, BCE, 80/20 split by prompt, best epoch by validation loss.
``--kinds`` picks the routers to train (default all four).
R2R uses a positive-class weight (rare critical tokens) and stores the
threshold reaching ``--r2r-recall`` (0.95) recall on the validation split;
CITER, Co-LLM and dv are trained unweighted so their sigmoid outputs are
probabilities that the fixed thresholds (τ = 0.98, η = 0.15, dv's alpha) can be
compared with.  dv's validation metrics set its AUC beside those of the ``ratio``
and ``prob`` rules' scores on the same positions, and the share of drafts kept and of
critical drafts rejected at several alpha.  Files are float16 (:mod:`tokenrouter.algorithms.learned`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple

from ..engine import cpu

cpu.install()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ..algorithms.learned import DV_FEATURES, ROUTERS_DIR, build_router, dv_features, save_router  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def fake_quantize_(model: nn.Module, bits: int, group: int) -> int:
    """Symmetric round-to-nearest fake quantisation of every decoder ``nn.Linear`` in place.

    Each weight row is split into groups of ``group`` input channels with one
    scale ``max|w| / (2^(bits-1) − 1)`` per group.  Returns the number of
    layers quantised.
    """
    qmax = 2 ** (bits - 1) - 1
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and ".layers." in f".{name}":
            w = mod.weight.data
            out_f, in_f = w.shape
            g = group if in_f % group == 0 else in_f
            wg = w.reshape(out_f, in_f // g, g)
            scale = wg.abs().amax(-1, keepdim=True).clamp_min(1e-8) / qmax
            mod.weight.data = ((wg / scale).round().clamp(-qmax - 1, qmax) * scale).reshape(out_f, in_f)
            n += 1
    return n


def load_prompts(path: str) -> List[List[Dict[str, str]]]:
    """Prompts from a JSON-lines file, as chat messages: ``{"prompt": str}`` per line, with an
    optional ``"system": str`` turn before it (the instruction the deployment sends, e.g. a math
    task's "put your final answer within \\boxed{}": the router learns from the SLM's states
    under it).

    Raises:
        ValueError: a line is not such an object, or the file has fewer than 5 prompts.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                d = json.loads(line)
                if (not isinstance(d, dict) or not isinstance(d.get("prompt"), str)
                        or not isinstance(d.get("system", ""), str) or set(d) - {"prompt", "system"}):
                    raise ValueError(f"{path}:{i}: expected {{\"prompt\": str}} or {{\"system\": str, \"prompt\": str}}")
                turns = [{"role": "system", "content": d["system"]}] if d.get("system") else []
                out.append(turns + [{"role": "user", "content": d["prompt"]}])
    if len(out) < 5:
        raise ValueError(f"{path}: need at least 5 prompts, got {len(out)}")
    return out


def rejoins(cont: List[int], orig: List[int], stops, k: int) -> bool:
    """Whether a rollout ``cont`` re-joins the original continuation ``orig`` (module docstring, step 4).

    Args:
        cont: token ids the LLM wrote after the SLM's token (W of them, or fewer up to a stop).
        orig: the trajectory's tokens after the LLM's own token at that position (up to its stop).
        stops: stop token ids.
        k: how many trailing tokens must match.
    Returns:
        True (neutral divergence) when ``cont``'s last ``k`` tokens occur contiguously in
        ``orig[: len(cont) + k]``, or when both end at a stop token with the same last
        ``min(k, len)`` tokens; False (critical) otherwise.
    """
    def cut(x):
        for i, t in enumerate(x):
            if t in stops:
                return x[: i + 1], True
        return x, False
    cont, c_end = cut(list(cont))
    orig, o_end = cut(list(orig))
    if c_end or o_end:
        n = min(k, len(cont), len(orig))
        return c_end and o_end and cont[-n:] == orig[-n:]
    if len(cont) < k:
        return False
    tail, window = cont[-k:], orig[: len(cont) + k]
    return any(window[i:i + k] == tail for i in range(len(window) - k + 1))


def select_rows(cache, rows: torch.Tensor):
    """A new ``DynamicCache`` holding rows ``rows`` (int64 [C], repeats allowed) of ``cache``; ``cache`` is unchanged."""
    from transformers import DynamicCache

    sub = DynamicCache()
    for i, layer in enumerate(cache.layers):
        sub.update(layer.keys[rows], layer.values[rows], i)
    return sub


@torch.no_grad()
def rollout(llm, cache, mask: torch.Tensor, pos: torch.Tensor, first: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy LLM continuations from cut-off points of cached trajectories, all in one batch.

    Args:
        llm: the LLM (a transformers causal LM).
        cache: a ``DynamicCache`` of C rows (the trajectories', rows repeated per candidate).
        mask: int64 [C, S], 1 for the cached positions each candidate keeps (its prompt and
            its trajectory up to the cut), 0 elsewhere.
        pos: int64 [C], the position id of each candidate's first new token.
        first: int64 [C], the first new token (the SLM's choice).
        steps: W, tokens to write after ``first``.
    Returns:
        int64 [C, W]: the continuations.
    """
    out, x = [], first.view(-1, 1)
    for j in range(steps):
        mask = torch.cat([mask, torch.ones_like(x)], 1)
        lg = llm(input_ids=x, attention_mask=mask, position_ids=(pos + j).view(-1, 1),
                 past_key_values=cache, use_cache=True).logits
        x = lg[:, -1].float().argmax(-1, keepdim=True)
        out.append(x)
    return torch.cat(out, 1)


#: the flags whose values are paths (recorded_command)
_PATH_FLAGS = ("--data", "--out", "--prompts", "--slm", "--llm")


def portable_path(path: str) -> str:
    """``path`` as a router file's ``meta`` records it: relative paths as given, files under the
    repository relative to it, other absolute paths by their file name only."""
    if not os.path.isabs(path):
        return path
    return os.path.relpath(path, REPO_ROOT) if path.startswith(REPO_ROOT + os.sep) else os.path.basename(path)


def recorded_command(argv: Sequence[str]) -> str:
    """The training command as a router file's ``meta.command`` records it: ``argv`` with the
    folders of this machine left out (``--data``, ``--out`` and absolute ``--prompts`` keep their
    file names only; files under the repository are made relative to it), so that a shipped file
    names no local path.

    Args:
        argv: the tool's arguments (``sys.argv[1:]``), ``--flag value`` or ``--flag=value``.
    Returns:
        ``"python -m tokenrouter.tools.train_routers " + the arguments``, space-joined.
    """
    out, flag = [], None
    for a in argv:
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out.append(f"{k}={portable_path(v)}" if k in _PATH_FLAGS else a)
            flag = None
        elif a.startswith("--"):
            out.append(a)
            flag = a
        else:
            out.append(portable_path(a) if flag in _PATH_FLAGS else a)
    return "python -m tokenrouter.tools.train_routers " + " ".join(out)


@torch.no_grad()
def collect(slm, llm, label_slm, tok, prompts: List[List[Dict[str, str]]], max_new: int, batch: int = 16, *,
            rollout_tokens: int = 0, rejoin_tokens: int = 4, rollout_batch: int = 32) -> Dict[str, torch.Tensor]:
    """Run the labelling passes (module docstring), ``batch`` prompts at a time (left padding).

    Returns:
        dict of ``hidden`` float32 [N, H], ``emb`` float32 [N, H] (embedding of
        the SLM's greedy token), ``top`` float32 [N, 100] (top-100 SLM logits),
        ``diff`` float32 [N] (labels), ``critical`` float32 [N] (``diff`` whose
        rollout does not re-join; equals ``diff`` when ``rollout_tokens`` is 0),
        ``prompt`` int64 [N] (prompt index), ``dv`` float32 [N, 6] (:func:`dv_features` of the
        LLM's logits at the labelling SLM's greedy token).
    """
    emb_w = slm.get_input_embeddings().weight
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    H, E, T, D, P, C, F = [], [], [], [], [], [], []
    encoded = []
    for messages in prompts:  # chat messages (load_prompts)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        encoded.append([int(i) for i in ids])
    cands: List[Tuple[int, int, int, int, List[int]]] = []  # (row, t, SLM token, index in C, trajectory after t)
    for b0 in range(0, len(encoded), batch):
        chunk = encoded[b0:b0 + batch]
        L = max(len(c) for c in chunk)
        ids = torch.tensor([[pad] * (L - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in chunk])
        seq = llm.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad)
        gen = seq[:, L:]
        full_mask = torch.cat([mask, torch.ones_like(gen)], 1)
        pos_ids = (full_mask.cumsum(-1) - 1).clamp_min(0)
        o_s = slm(seq, attention_mask=full_mask, position_ids=pos_ids, output_hidden_states=True,
                  use_cache=rollout_tokens > 0 and llm is slm)
        lg_s_all = o_s.logits.float()
        if llm is slm:  # the demo pair: one model, which also rolls out
            lg_l_all, cache = lg_s_all, o_s.past_key_values
        else:
            o_l = llm(seq, attention_mask=full_mask, position_ids=pos_ids, use_cache=rollout_tokens > 0)
            lg_l_all, cache = o_l.logits.float(), o_l.past_key_values
        lg_q_all = lg_s_all if label_slm is slm else label_slm(
            seq, attention_mask=full_mask, position_ids=pos_ids).logits.float()
        for r in range(len(chunk)):
            g = gen.shape[1]
            for t, x in enumerate(gen[r].tolist()):  # up to and including the first stop token
                if x in stops:
                    g = t + 1
                    break
            pos = slice(L - 1, L - 1 + g)  # positions predicting the generated tokens
            lg_s = lg_s_all[r, pos]
            s_tok = lg_s.argmax(-1)
            H.append(o_s.hidden_states[-1][r, pos].float())
            E.append(emb_w[s_tok].float())
            T.append(torch.topk(lg_s, 100, dim=-1).values)
            q_tok = lg_q_all[r, pos].argmax(-1)
            d = (q_tok != lg_l_all[r, pos].argmax(-1)).float()
            F.append(dv_features(lg_l_all[r, pos], q_tok))
            D.append(d)
            P.append(torch.full((g,), b0 + r, dtype=torch.int64))
            C.append(d.clone())
            if rollout_tokens:
                for t in d.nonzero().view(-1).tolist():
                    cands.append((r, t, int(q_tok[t]), len(C) - 1, gen[r, t + 1:g].tolist()))
        if rollout_tokens and cands:
            for c0 in range(0, len(cands), rollout_batch):
                part = cands[c0:c0 + rollout_batch]
                rows = torch.tensor([r for r, *_ in part])
                sub = select_rows(cache, rows)
                m = full_mask[rows].clone()
                for i, (_r, t, *_rest) in enumerate(part):
                    m[i, L + t:] = 0  # keep the prompt and the trajectory before position t
                p0 = torch.tensor([int(pos_ids[r, L + t]) for r, t, *_ in part])
                cont = rollout(llm, sub, m, p0, torch.tensor([x for _r, _t, x, *_ in part]), rollout_tokens)
                for i, (_r, t, _x, ci, orig) in enumerate(part):
                    if rejoins(cont[i].tolist(), orig, stops, rejoin_tokens):
                        C[ci][t] = 0.0
            cands.clear()
        n_d = int(sum(float(x.sum()) for x in D))
        n_c = int(sum(float(x.sum()) for x in C))
        print(f"  labelled {min(b0 + batch, len(encoded))}/{len(encoded)} prompts "
              f"({n_d} divergences, {n_c} critical)", flush=True)
    return {"hidden": torch.cat(H), "emb": torch.cat(E), "top": torch.cat(T), "diff": torch.cat(D),
            "critical": torch.cat(C), "prompt": torch.cat(P), "dv": torch.cat(F)}


def auc(score: torch.Tensor, y: torch.Tensor) -> float:
    """Area under the ROC curve (rank statistic); NaN if one class is missing."""
    pos, neg = int(y.sum()), int((1 - y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    r = torch.empty_like(score)
    r[score.argsort()] = torch.arange(1, len(score) + 1, dtype=score.dtype)
    return float((r[y > 0.5].sum() - pos * (pos + 1) / 2) / (pos * neg))


def train(kind: str, arch: Dict[str, int], x: torch.Tensor, y: torch.Tensor, train_idx, val_idx, *,
          epochs: int, lr: float, pos_weight: bool, seed: int) -> Tuple[nn.Module, Dict[str, float], torch.Tensor]:
    """BCE training with Adam; returns the best-validation-loss module, its metrics and validation probabilities."""
    torch.manual_seed(seed)
    model = build_router(kind, arch)
    xt, yt, xv, yv = x[train_idx], y[train_idx], x[val_idx], y[val_idx]
    mean, std = xt.mean(0), xt.std(0).clamp_min(1e-4)
    if kind == "colm":  # a pure linear head: standardise during training, fold it in at the end
        xt, xv = (xt - mean) / std, (xv - mean) / std
    else:
        model.mean.copy_(mean)
        model.std.copy_(std)
    pw = None
    if pos_weight and yt.sum() > 0:
        pw = torch.tensor(float((1 - yt).sum() / yt.sum()))
    lossf = nn.BCEWithLogitsLoss(pos_weight=pw)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-5)
    best, best_state = float("inf"), None
    for ep in range(epochs):
        model.train()
        perm = torch.randperm(len(xt))
        for i in range(0, len(xt), 256):
            b = perm[i:i + 256]
            opt.zero_grad()
            lossf(model(xt[b]), yt[b]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            vl = float(lossf(model(xv), yv))
        if vl < best:
            best, best_state = vl, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    if kind == "colm":
        with torch.no_grad():
            w = model.lin.weight / std
            model.lin.bias -= (model.lin.weight * mean / std).sum()
            model.lin.weight.copy_(w)
        xv = xv * std + mean
    with torch.no_grad():
        pv = torch.sigmoid(model(xv))
    return model, {"val_loss": best, "val_auc": auc(pv, yv), "val_n": len(yv), "train_n": len(yt),
                   "val_pos_rate": float(yv.mean())}, pv


#: LLM-token shares at which the validation split's thresholds are reported (operating points to sweep)
SHARES = (0.05, 0.1, 0.2, 0.3, 0.5)


def thresholds_at_shares(pv: torch.Tensor, defer_below: bool) -> Dict[str, float]:
    """Thresholds that route a given share of the validation positions to the LLM.

    Args:
        pv: float32 [N], the router's validation probabilities.
        defer_below: True when the rule defers on ``p < threshold`` (CITER), False on ``p >= threshold``.
    Returns:
        ``{"0.1": threshold, …}`` for each share of :data:`SHARES` (the ``q``-quantile of ``pv``, with
        ``q = share`` or ``1 − share``).
    """
    return {str(r): float(torch.quantile(pv, r if defer_below else 1 - r)) for r in SHARES}


#: the routers this tool trains
KINDS = ("r2r", "citer", "colm", "dv")
#: alphas at which dv's validation metrics report the drafts kept and the critical drafts rejected
DV_ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9)


def dv_metrics(pv: torch.Tensor, yv: torch.Tensor, xv: torch.Tensor) -> Dict[str, object]:
    """Draft-verify router's validation figures on the divergence positions.

    Args:
        pv: float32 [N], the router's P(critical); yv: float32 [N], the labels (critical);
        xv: float32 [N, 6], the features (:data:`DV_FEATURES`).
    Returns:
        ``val_auc_ratio_score`` / ``val_auc_prob_score``: the AUC of ``-logp_gap`` and ``-logp`` (the
        ``ratio`` and ``prob`` rules' scores, lower = reject first) for the same labels;
        ``kept_at_alpha`` / ``critical_rejected_at_alpha``: per alpha of :data:`DV_ALPHAS`, the share
        of these drafts the rule keeps (1 - P(critical) >= alpha) and the share of the critical ones
        it rejects.
    """
    cols = {name: i for i, name in enumerate(DV_FEATURES)}
    keep = {str(al): (1 - pv) >= al for al in DV_ALPHAS}
    crit = yv > 0.5
    return {"val_auc_ratio_score": auc(-xv[:, cols["logp_gap"]], yv),
            "val_auc_prob_score": auc(-xv[:, cols["logp"]], yv),
            "kept_at_alpha": {k: float(v.float().mean()) for k, v in keep.items()},
            "critical_rejected_at_alpha": {k: float((~v[crit]).float().mean()) if crit.any() else float("nan")
                                           for k, v in keep.items()}}


def main(argv=None) -> int:
    """Command line entry point (see module docstring); returns the exit status."""
    wdir = os.environ.get("TOKENROUTER_WEIGHTS") or os.path.expanduser("~/.cache/tokenrouter/weights")
    ap = argparse.ArgumentParser(prog="python -m tokenrouter.tools.train_routers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--slm", default="smollm2-135m-instruct",
                    help="served SLM checkpoint: a folder, or a name under the weights folder")
    ap.add_argument("--llm", default=None, help="LLM checkpoint, as --slm (default: the SLM's -- the demo pair)")
    ap.add_argument("--label-slm", choices=("auto", "served", "fakequant"), default="auto",
                    help="labelling SLM: auto = fakequant when SLM == LLM, else served")
    ap.add_argument("--bits", type=int, default=4, help="fake-quantisation bits of the labelling SLM")
    ap.add_argument("--group", type=int, default=32, help="fake-quantisation group size (input channels)")
    ap.add_argument("--prompts", nargs="+", default=[os.path.join(REPO_ROOT, "data", "router_prompts.jsonl")],
                    help="JSON-lines prompt files (several are concatenated)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the models' dtype; match the served one (the qwen-coder pair: bfloat16 where the "
                    "CPU has native bf16)")
    ap.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts of each file (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rollout-tokens", type=int, default=16,
                    help="W: LLM tokens written after the SLM's token at each divergence to tell critical from "
                    "neutral ones (0: every divergence is critical)")
    ap.add_argument("--rejoin-tokens", type=int, default=4,
                    help="K: a rollout whose last K tokens re-join the trajectory marks a neutral divergence")
    ap.add_argument("--out", default=ROUTERS_DIR, help="output folder")
    ap.add_argument("--name", default="smollm2-135m", help="file suffix: <kind>_<name>.pt")
    ap.add_argument("--r2r-width", type=int, default=256, help="R2R MLP width (published: 1024)")
    ap.add_argument("--r2r-depth", type=int, default=6, help="R2R MLP depth (published: 6)")
    ap.add_argument("--r2r-recall", type=float, default=0.95, help="recall the stored R2R threshold reaches")
    ap.add_argument("--citer-width", type=int, default=256)
    ap.add_argument("--citer-depth", type=int, default=2)
    ap.add_argument("--dv-width", type=int, default=32, help="draft-verify router MLP width")
    ap.add_argument("--dv-depth", type=int, default=2, help="draft-verify router MLP depth")
    ap.add_argument("--dv-epochs", type=int, default=300,
                    help="draft-verify router epochs (its training set is the divergences only: few batches each)")
    ap.add_argument("--data", default=None,
                    help="labelled data file: loaded when it exists (the labelling passes are skipped), else "
                    "written after them (to fit again with other settings)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated routers to train, of {','.join(KINDS)} (default: all)")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}, got {a.kinds!r}")
    if a.threads:
        torch.set_num_threads(a.threads)
    for attr in ("slm", "llm"):  # a name (deploy/prepare_weights.py's folders) or a path
        v = getattr(a, attr)
        if v and not os.path.isdir(v):
            setattr(a, attr, os.path.join(wdir, v))
    torch.manual_seed(a.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    llm_path = a.llm or a.slm
    tok = AutoTokenizer.from_pretrained(a.slm)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=getattr(torch, a.dtype)).eval()  # noqa: E731
    slm = load(a.slm)
    same = os.path.realpath(llm_path) == os.path.realpath(a.slm)
    llm = slm if same else load(llm_path)
    mode = a.label_slm if a.label_slm != "auto" else ("fakequant" if same else "served")
    if mode == "fakequant":
        label_slm = load(a.slm)
        nq = fake_quantize_(label_slm, a.bits, a.group)
        label_desc = f"fake-quantised copy of the SLM ({a.bits}-bit RTN, group {a.group}, {nq} linear layers)"
    else:
        label_slm = slm
        label_desc = "the served SLM"
    prompts = [p for path in a.prompts for p in load_prompts(path)[: a.max_prompts or None]]
    if a.rollout_tokens < 0 or a.rejoin_tokens < 1:
        ap.error("--rollout-tokens must be >= 0 and --rejoin-tokens >= 1")
    if a.data and os.path.isfile(a.data):
        data = torch.load(a.data, weights_only=True)
    else:
        data = collect(slm, llm, label_slm, tok, prompts, a.max_new_tokens, rollout_tokens=a.rollout_tokens,
                       rejoin_tokens=a.rejoin_tokens)
        if a.data:
            torch.save(data, a.data)
    t_data = time.time() - t0
    n = len(data["diff"])
    print(f"labelled {n} positions from {len(prompts)} prompts in {t_data:.0f}s; "
          f"label SLM: {label_desc}; disagreement rate {float(data['diff'].mean()):.3f}, critical rate "
          f"{float(data['critical'].mean()):.3f}", flush=True)
    g = torch.Generator().manual_seed(a.seed)
    order = torch.randperm(len(prompts), generator=g)
    val_prompts = set(order[: max(1, len(prompts) // 5)].tolist())
    is_val = torch.tensor([int(p) in val_prompts for p in data["prompt"]])
    tr, va = (~is_val).nonzero().view(-1), is_val.nonzero().view(-1)
    y, y_crit = data["diff"], data["critical"]
    H = data["hidden"].shape[1]
    meta_common = {"slm": os.path.basename(a.slm.rstrip("/")), "llm": os.path.basename(llm_path.rstrip("/")),
                   "label_slm": label_desc, "label": "argmax(label SLM) != argmax(LLM) on LLM greedy trajectories",
                   "critical": (f"diff whose {a.rollout_tokens}-token LLM rollout after the SLM's token does not "
                                f"re-join the trajectory ({a.rejoin_tokens} tokens)") if a.rollout_tokens else "diff",
                   "rates": {"diff": float(y.mean()), "critical": float(y_crit.mean())},
                   "prompts": [portable_path(os.path.abspath(p)) for p in a.prompts],
                   "dtype": a.dtype,
                   "max_new_tokens": a.max_new_tokens, "positions": n, "seed": a.seed,
                   "command": recorded_command(argv if argv is not None else sys.argv[1:])}
    summary = {}

    if "r2r" in kinds:  # R2R: [h, e, top-100] -> critical
        arch = {"in_dim": 2 * H + 100, "width": a.r2r_width, "depth": a.r2r_depth, "hidden_size": H, "topk": 100}
        x = torch.cat([data["hidden"], data["emb"], data["top"]], 1)
        m, met, pv = train("r2r", arch, x, y_crit, tr, va, epochs=a.epochs, lr=1e-3, pos_weight=True, seed=a.seed)
        pos_scores = pv[y_crit[va] > 0.5].sort().values
        k = int((1 - a.r2r_recall) * len(pos_scores))
        thr = float(pos_scores[k]) if len(pos_scores) else 0.5
        met.update({"threshold": thr, "recall_target": a.r2r_recall,
                    "val_recall": float((pos_scores >= thr).float().mean()) if len(pos_scores) else float("nan"),
                    "val_routed_rate": float((pv >= thr).float().mean()),
                    "threshold_at_share": thresholds_at_shares(pv, defer_below=False)})
        f = os.path.join(a.out, f"r2r_{a.name}.pt")
        save_router(f, "r2r", arch, m, thr, {**meta_common, "target": "critical", "metrics": met})
        summary["r2r"] = (f, met)

    if "citer" in kinds:  # CITER: h -> acceptable (1 - critical)
        arch = {"in_dim": H, "width": a.citer_width, "depth": a.citer_depth, "hidden_size": H}
        m, met, pv = train("citer", arch, data["hidden"], 1 - y_crit, tr, va, epochs=a.epochs, lr=1e-3,
                           pos_weight=False, seed=a.seed)
        met.update({f"val_routed_rate_tau_{t}": float((pv < t).float().mean()) for t in (0.98, 0.9, 0.8)})
        met["tau_at_share"] = thresholds_at_shares(pv, defer_below=True)
        f = os.path.join(a.out, f"citer_{a.name}.pt")
        save_router(f, "citer", arch, m, None, {**meta_common, "target": "1 - critical", "metrics": met})
        summary["citer"] = (f, met)

    if "colm" in kinds:  # Co-LLM: h -> defer (diff), linear head
        arch = {"in_dim": H, "hidden_size": H}
        m, met, pv = train("colm", arch, data["hidden"], y, tr, va, epochs=a.epochs, lr=3e-3, pos_weight=False,
                           seed=a.seed)
        met.update({f"val_routed_rate_eta_{t}": float((pv > t).float().mean()) for t in (0.15, 0.3, 0.5)})
        met["eta_at_share"] = thresholds_at_shares(pv, defer_below=False)
        f = os.path.join(a.out, f"colm_{a.name}.pt")
        save_router(f, "colm", arch, m, None, {**meta_common, "target": "diff", "metrics": met})
        summary["colm"] = (f, met)

    if "dv" in kinds:  # draft-verify: the LLM's view of the labelling SLM's token -> critical, at divergences
        at = y > 0.5
        if int(at.sum()) < 2 or not bool(at[va].any()) or not bool(at[tr].any()):
            ap.error("dv: too few divergences to train on (use more prompts or tokens)")
        sub = at.nonzero().view(-1)
        pos_in_sub = torch.full((n,), -1, dtype=torch.int64)
        pos_in_sub[sub] = torch.arange(len(sub))
        tr_d, va_d = pos_in_sub[tr[at[tr]]], pos_in_sub[va[at[va]]]
        arch = {"in_dim": len(DV_FEATURES), "width": a.dv_width, "depth": a.dv_depth}
        x, yd = data["dv"][sub], y_crit[sub]
        m, met, pv = train("dv", arch, x, yd, tr_d, va_d, epochs=a.dv_epochs, lr=3e-3, pos_weight=False,
                           seed=a.seed)
        met.update(dv_metrics(pv, yd[va_d], x[va_d]))
        f = os.path.join(a.out, f"dv_{a.name}.pt")
        save_router(f, "dv", arch, m, None, {**meta_common, "target": "critical", "features": list(DV_FEATURES),
                                             "trained_on": "diff positions (label SLM token != LLM argmax)",
                                             "metrics": met})
        summary["dv"] = (f, met)

    for kind, (f, met) in summary.items():
        print(f"{kind}: {f} ({os.path.getsize(f) / 1e6:.2f} MB) " +
              ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in met.items()))
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
