"""W5 (BENCHMARKS.md): speculative decoding against plain decoding on our engine, same run.

    python benchmarks/spec_bench.py --target ./qwen2.5-coder-1.5b.gguf \\
        --draft ./qwen2.5-coder-0.5b.gguf --methods draft,ngram --batches 1,4,16,64 \\
        --name W5-qwen-coder-h100 --out results

For each method, batch size and prompt kind (code: rewrite a given function; prose: summarize
or quote a given paragraph, both grounded in their input), the same requests run without and
with speculation (greedy, EOS ignored, `--max-tokens` each), timed end to end after a warm-up,
the plain engine's timed runs alternating with the speculative engine's (both stay loaded).
Records: `out_tok_s` of both, `speedup`, `acceptance_rate`, `mean_accepted_len`, the mean k
drafted per speculative step, how many engine steps ran without speculation (the engine's
automatic off switch), and for the draft model the bound E[tokens per step] / (1 + k c) over
the speculative steps (measured tokens per step and mean k), with c = the draft's
decode step time over the target's, both measured here at the same batch size (plain decoding
of each model alone, in turns). Greedy outputs are compared with and without speculation.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from step_trace import StepTrace, brief  # noqa: E402

from llmaccel.bench.results import current_commit
from llmaccel.bench.spec_prompts import CODE, PROMPTS, PROSE  # noqa: E402,F401


def _requests(tok, kind: str, batch: int) -> list[list[int]]:
    """`batch` chat-formatted requests cycling through the kind's prompts."""
    from llmaccel.models.tokenizer import format_prompt

    base = PROMPTS[kind]
    return [format_prompt(tok, base[i % len(base)], None) for i in range(batch)]


def _run_alternating(engines, prompts, params, repeats: int
                     ) -> list[tuple[float, list[list[int]], dict, list[float]]]:
    """Per engine: the median wall time of `repeats` timed runs, the last run's tokens, the
    timed runs' steps by class (step_trace.py: summed over the repeats) and each run's wall
    (ms). The engines' timed runs alternate (plain, speculative, plain, ...): whatever drifts
    over a cell (GPU clocks, the host) falls on both alike. Run one after the other, engines
    doing the same plain decoding measured 4-11% apart on an H100 (speculation
    switched off at those batch sizes, step for step the same work)."""
    # Warm-up: one whole untimed run of the batch per engine. Triton compiles kernel variants
    # on first use (the prefill/extend shapes of this batch, and a speculative engine's
    # overlapped rounds at each k its adaptive k reaches), which must not land in the timed
    # runs. An 8-token warm-up left them there: a first head engine timed 613 and
    # 376 ms for its first two runs against 149-151 ms for the rest, and its automatic switch
    # learned from those slow rounds. Prefix caching is off (see main), so the timed runs
    # recompute their prompts.
    for llm in engines:
        llm.generate(prompts, params, use_tqdm=False)
    walls: list[list[float]] = [[] for _ in engines]
    traces = [StepTrace(llm.engine) for llm in engines]
    outs: list = [None] * len(engines)
    for _ in range(repeats):
        for i, llm in enumerate(engines):
            with traces[i]:
                start = time.perf_counter()
                outs[i] = llm.generate(prompts, params, use_tqdm=False)
                walls[i].append(time.perf_counter() - start)
    results = []
    for w, out, trace in zip(walls, outs, traces):
        results.append((statistics.median(w), [o.outputs[0].token_ids for o in out],
                        trace.summary(), [round(x * 1e3, 1) for x in w]))
    return results


class _MonitorLog:
    """Every step the off switch was shown during a cell (--monitor-log): the kind the engine
    passed to record_step ([batch, speculative, rows], None for a step that was not all
    decoding), tokens, ms, steady, whether the monitor counted it, and the switch's round.
    For finding the rounds that move a mode's measured rate."""

    def __init__(self, switch) -> None:
        self.switch, self.rows, self._observed = switch, [], False
        self._record, self._observe = switch.record_step, switch.monitor.observe

    def _observe_hook(self, *args) -> None:
        self._observed = True
        self._observe(*args)

    def _record_hook(self, kind, tokens, seconds, steady=True) -> None:
        self._observed = False
        self._record(kind, tokens, seconds, steady)
        k = None if kind is None else [kind[0], int(kind[1]), kind[2] if len(kind) > 2 else 0]
        self.rows.append([k, tokens, round(seconds * 1e3, 3), int(steady), int(self._observed),
                          self.switch.round])

    def __enter__(self) -> "_MonitorLog":
        self.switch.monitor.observe = self._observe_hook
        self.switch.record_step = self._record_hook
        return self

    def __exit__(self, *exc) -> None:
        del self.switch.monitor.observe, self.switch.record_step  # the class methods again


def first_difference(plain, prompts: list[list[int]], want: list[list[int]],
                     got: list[list[int]], top: int = 5) -> dict | None:
    """Where a speculative run's tokens first leave plain decoding's, and whether it is a near
    tie: plain decoding's `top` logprobs at that position (its prompt and the tokens before,
    generated again for one token). Both tokens among them with a gap of a few hundredths
    points at rounding (a verify step's kernels sum in another order than a plain step's);
    the speculative token far below, or not among them, at a logic error. None if equal."""
    from llmaccel.engine.sampling_params import SamplingParams

    for i, (w, g) in enumerate(zip(want, got)):
        if w == g:
            continue
        j = next((n for n, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
        rec: dict = {"request": i, "index": j, "plain_token": w[j] if j < len(w) else None,
                     "spec_token": g[j] if j < len(g) else None}
        if rec["plain_token"] is not None and rec["spec_token"] is not None:
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=top)
            out = plain.generate([prompts[i] + w[:j]], one, use_tqdm=False)[0].outputs[0]
            lps = out.logprobs[0] if out.logprobs else {}
            rec["plain_top_logprobs"] = {str(t): round(v, 4) for t, v in lps.items()}
            if rec["plain_token"] in lps and rec["spec_token"] in lps:
                rec["logprob_gap"] = round(lps[rec["plain_token"]] - lps[rec["spec_token"]], 4)
        return rec
    return None


def _limits(text: str | None, methods: list[str]) -> dict[str, int]:
    """--disable-by-batch-size: '64' (every method) or 'ngram=64,draft=4'."""
    if not text:
        return {}
    if "=" not in text:
        return {m: int(text) for m in methods}
    pairs = [part.split("=", 1) for part in text.split(",")]
    unknown = [m for m, _ in pairs if m not in methods]
    if unknown:
        raise SystemExit(f"--disable-by-batch-size names methods not run: {unknown}")
    return {m: int(n) for m, n in pairs}


def _vocab_size(llm) -> int | None:
    """The tokens a draft head scores (its draft vocabulary's size, else the whole
    vocabulary); None for other methods."""
    head = getattr(llm.engine, "draft_head", None)
    if head is None:
        return None
    return int(head.draft_ids.numel()) if head.draft_ids is not None else head.config.vocab_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--head", default=None,
                    help="a draft head directory (llmaccel distill-draft --kind head) for "
                         "method 'head'")
    ap.add_argument("--methods", default="draft,ngram", help="any of draft, ngram, head")
    ap.add_argument("--draft-vocab-sizes", default=None,
                    help="head: comma-separated draft_vocab_size values, one head engine each "
                         "('auto': the head's draft_vocab.json as saved; 0: the whole "
                         "vocabulary); default: auto")
    ap.add_argument("--draft-chain", default="on",
                    help="draft/head: comma-separated on,off -- the k - 1 draft steps after the "
                         "catch-up as one chained CUDA graph (on, the default) or one launch "
                         "each (draft_chain), one engine each")
    ap.add_argument("--draft-overlap", default="on",
                    help="draft/head: comma-separated on,off -- the next round's drafts launched "
                         "with this round's verify step (on, the default; spec/overlap.py) or "
                         "after verification (draft_overlap), one engine each")
    ap.add_argument("--draft-topk", default="1",
                    help="head: candidates per draft depth (tree verification, "
                         "spec/tree.py; 1 = a chain), comma-separated: one engine each")
    ap.add_argument("--ngram-first", default="off",
                    help="draft/head: comma-separated off,on -- n-gram lookup drafts where the "
                         "context has a match, the model elsewhere (SpeculativeConfig."
                         "ngram_first), one engine each")
    ap.add_argument("--prompt-lookup-min", type=int, default=None,
                    help="n-gram lookup's shortest match (ngram, and ngram_first); default: "
                         "SpeculativeConfig's")
    ap.add_argument("--prompt-lookup-num-tokens", default=None,
                    help="with --ngram-first on: comma-separated, the most tokens a lookup "
                         "drafts (SpeculativeConfig.prompt_lookup_num_tokens; 'k': as the "
                         "model), one engine each")
    ap.add_argument("--switch", default="auto",
                    help="comma-separated: auto (the engine's off switch decides per step), on "
                         "(speculate at every step: what the switch chooses against)")
    ap.add_argument("--disable-by-batch-size", default=None,
                    help="SpeculativeConfig.disable_by_batch_size with --switch auto: one number "
                         "for every method or METHOD=N pairs ('ngram=64,draft=4'); a method "
                         "not named has none")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--kinds", default="code,prose")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per cell (the median wall counts): short runs vary")
    ap.add_argument("--no-draft-alone", action="store_true",
                    help="skip timing the draft model alone (no bound; "
                         "saves loading a third model)")
    ap.add_argument("--monitor-log", action="store_true",
                    help="write every step the off switch saw per cell to NAME-monitor.jsonl")
    ap.add_argument("--name", default="W5-spec")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    import torch

    from llmaccel import LLM, SamplingParams
    from llmaccel.spec.adaptive import speedup_bound

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # prefix caching off: the warm-up must not serve the timed run's prompts from the cache
    kw = {"dtype": args.dtype, "max_model_len": args.max_model_len,
          "enable_prefix_caching": False}
    plain_kw = dict(kw)
    if torch.cuda.is_available():
        # The plain engines capture the graphs the speculative one's target does (k + 1 rows
        # per sequence, up to 1024): small prefill steps replay them as rows, so without this
        # a plain engine (graphs up to 512 rows) would prefill 512-1024 tokens eagerly and the
        # speculative one from a graph (~15 ms apart on an H100: a few % of a batch-4 cell).
        from llmaccel.engine.config import EngineConfig
        from llmaccel.engine.sizing import capture_sizes

        spec_cfg = EngineConfig(model=args.target, speculative_config={
            "method": "ngram", "num_speculative_tokens": args.k})
        plain_kw["cudagraph_capture_sizes"] = tuple(
            capture_sizes(spec_cfg, torch.device("cuda")))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    commit = current_commit()
    command = "python benchmarks/spec_bench.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    records, rows = [], []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = ("| method | switch | prompts | batch | plain out tok/s | spec out tok/s | speedup | "
              "acceptance | tokens/step | mean k | spec / off steps | bound | identical |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")

    def save() -> None:
        """Written after every cell: a run cut short keeps what it measured."""
        with open(out / f"{args.name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        (out / f"{args.name}.md").write_text(
            f"# {args.name}\n\nCommand: `{command}`\n\n{header}" + "\n".join(rows) + "\n")
    plain = LLM(args.target, **plain_kw)
    tok = plain.get_tokenizer()
    draft_alone = (LLM(args.draft, **plain_kw) if args.draft and "draft" in args.methods
                   and not args.no_draft_alone else None)
    batches = [int(b) for b in args.batches.split(",")]
    cost_c: dict[tuple[str, int], float] = {}
    for kind in args.kinds.split(","):
        for b in batches:
            if draft_alone is not None:  # c of the bound: both models timed in turns
                prompts = _requests(tok, kind, b)
                target_run, draft_run = _run_alternating([plain, draft_alone], prompts, params,
                                                         args.repeats)
                cost_c[kind, b] = draft_run[0] / target_run[0]
    del draft_alone
    gc.collect()  # the speculative engines size their KV caches from free memory
    torch.cuda.empty_cache() if device == "cuda" else None
    vocab_sizes = [None if v == "auto" else int(v)
                   for v in (args.draft_vocab_sizes or "auto").split(",")]
    chains = args.draft_chain.split(",")
    overlaps = args.draft_overlap.split(",")
    firsts = args.ngram_first.split(",")
    lookup_ks = [None if v == "k" else int(v)
                 for v in (args.prompt_lookup_num_tokens or "k").split(",")]
    topks = [int(t) for t in args.draft_topk.split(",")]
    runs = [(m, s, v, c, o, f, lk, tk) for m in args.methods.split(",")
            for s in args.switch.split(",")
            for v in (vocab_sizes if m == "head" else [None])
            for c in (chains if m != "ngram" else ["on"])
            for o in (overlaps if m in ("draft", "head") else ["on"])
            for f in (firsts if m in ("draft", "head") else ["off"])
            for lk in (lookup_ks if f == "on" else [None])
            for tk in (topks if m == "head" else [1])]
    limits = _limits(args.disable_by_batch_size, args.methods.split(","))
    for method, switch, vocab, chain, overlap, first, lookup_k, topk in runs:
        spec = {"method": method, "num_speculative_tokens": args.k}
        if topk > 1:
            spec["draft_topk"] = topk
        if first == "on":
            spec["ngram_first"] = True
            spec["prompt_lookup_num_tokens"] = lookup_k
        if args.prompt_lookup_min is not None and (method == "ngram" or first == "on"):
            spec["prompt_lookup_min"] = args.prompt_lookup_min
        if method != "ngram":
            spec["draft_chain"] = chain == "on"
            spec["draft_overlap"] = overlap == "on"
        if method == "draft":
            spec["model"] = args.draft
        elif method == "head":
            spec["model"] = args.head
            spec["draft_vocab_size"] = vocab
        if switch == "on":  # never off: what speculating at every step gives (adaptive k >= 1)
            spec["auto_disable"] = False
        elif limits.get(method) is not None:
            spec["disable_by_batch_size"] = limits[method]
        llm = LLM(args.target, speculative_config=spec, **kw)
        for kind in args.kinds.split(","):
            for b in batches:
                prompts = _requests(tok, kind, b)
                before = llm.get_stats().spec_decode
                overlapped = llm.engine.spec.num_overlapped
                looked_up = llm.engine.spec.num_ngram_first
                tree_acc = llm.engine.spec.num_tree_accepted
                sw = llm.engine.spec.switch
                switches = 0 if sw is None else sw.num_switches
                # the plain engine stays loaded: its runs alternate with the speculative
                # engine's, a fresh baseline for every cell
                mlog = _MonitorLog(sw) if args.monitor_log and sw is not None else None
                with mlog or contextlib.nullcontext():
                    base, (wall, tokens, steps_spec, walls) = _run_alternating(
                        [plain, llm], prompts, params, args.repeats)
                if mlog is not None:
                    with open(out / f"{args.name}-monitor.jsonl", "a") as f:
                        f.write(json.dumps({"method": method, "kind": kind, "batch": b,
                                            "commit": commit, "steps": mlog.rows}) + "\n")
                after = llm.get_stats().spec_decode
                steps = after["num_steps"] - before["num_steps"]
                drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                emitted = after["num_emitted_tokens"] - before["num_emitted_tokens"]
                acc = accepted / drafted if drafted else 0.0
                base_wall, base_tokens, steps_plain, base_walls = base
                n_out = sum(len(t) for t in tokens)
                rec = {"workload": "W5", "model": Path(args.target).name,
                       "load_format": "auto", "backend": "llmaccel",
                       "config": {"batch": b, "method": method, "switch": switch,
                                  "disable_by_batch_size": spec.get("disable_by_batch_size"),
                                  "kind": kind, "k": args.k,
                                  "max_tokens": args.max_tokens,
                                  "draft": spec.get("model"),
                                  "draft_vocab_size": _vocab_size(llm),
                                  "draft_chain": None if method == "ngram" else chain,
                                  "draft_overlap": overlap if method in ("draft", "head") else None,
                                  "ngram_first": first == "on",
                                  "prompt_lookup_num_tokens": lookup_k,
                                  "draft_topk": topk,
                                  "identical_to_plain": tokens == base_tokens,
                                  "first_difference": first_difference(plain, prompts,
                                                                       base_tokens, tokens),
                                  "plain_out_tok_s": round(n_out / base_wall, 2),
                                  "spec_out_tok_s": round(n_out / wall, 2)},
                       "metric": "speedup", "value": round(base_wall / wall, 3),
                       "acceptance_rate": round(acc, 4),
                       "mean_accepted_len": round(emitted / steps, 3) if steps else 0.0,
                       "device": (torch.cuda.get_device_name() if device == "cuda"
                                  else "cpu"),
                       "torch": torch.__version__, "commit": commit, "command": command}
                off = after["num_off_steps"] - before["num_off_steps"]
                mean_k = drafted / steps if steps else 0.0
                rec["config"]["mean_k"] = round(mean_k, 3)
                rec["config"]["off_steps"] = off  # engine steps that ran without speculation
                rec["config"]["spec_steps"] = steps
                # engine rounds whose drafts were launched during the previous round, all runs
                # of the cell (warm-up included)
                rec["config"]["overlapped_rounds"] = llm.engine.spec.num_overlapped - overlapped
                rec["config"]["ngram_first_rounds"] = llm.engine.spec.num_ngram_first - looked_up
                # sequence rounds that accepted a sibling draft (tree verification), all runs
                rec["config"]["tree_accepted_rounds"] = (llm.engine.spec.num_tree_accepted
                                                         - tree_acc)
                # the timed runs' engine steps by class, summed over the repeats: where a
                # speculative run's time went against the plain engine's (step_trace.py)
                rec["config"]["steps_plain"] = steps_plain
                rec["config"]["steps_spec"] = steps_spec
                # every timed run's wall (ms), in the order they alternated; medians count
                rec["config"]["walls_plain_ms"], rec["config"]["walls_spec_ms"] = base_walls, walls
                print(f"  steps, plain: {brief(steps_plain)}\n  steps, spec:  {brief(steps_spec)}",
                      flush=True)
                monitor = llm.engine.spec.monitor  # the off switch's view after the cell
                for mode, key in ((True, "monitor_spec_tok_s"), (False, "monitor_plain_tok_s")):
                    # tokens/s per sequence, this batch's bucket (no monitor without graphs)
                    rate = None if monitor is None else monitor.rate(b, mode)
                    rec["config"][key] = None if rate is None else round(rate, 1)
                sw = llm.engine.spec.switch
                if sw is not None:  # n-gram's shadow prediction, the switch's churn
                    pred, over = sw.predicted_rate(b), sw.overhead_ms(b)
                    rec["config"]["switch_predicted_tok_s"] = pred and round(pred, 1)
                    rec["config"]["switch_overhead_ms"] = over and round(over, 3)
                    rec["config"]["switch_changes"] = sw.num_switches - switches
                if method == "draft" and (kind, b) in cost_c and steps:
                    c = cost_c[kind, b]  # per-step time ratio, same batch
                    # the bound E[tokens per step] / (1 + k c) of the speculative steps,
                    # with the measured tokens per step and the mean k drafted
                    bound = (emitted / steps) / (1 + mean_k * c)
                    rec["config"]["cost_ratio_c"] = round(c, 4)
                    rec["config"]["iid_bound_k"] = round(speedup_bound(acc, args.k, c), 3)
                    rec["speedup_bound"] = round(bound, 3)
                    rec["share_of_bound"] = round(rec["value"] / bound, 3) if bound else None
                records.append(rec)
                dv = rec["config"]["draft_vocab_size"]
                label = method if dv is None else f"{method} (vocab {dv})"
                if method != "ngram" and len(chains) > 1:
                    label += f" (chain {chain})"
                if method != "ngram" and len(overlaps) > 1:
                    label += f" (overlap {overlap})"
                if method != "ngram" and len(firsts) > 1:
                    label += f" (ngram first {first})"
                if lookup_k is not None:
                    label += f" (lookup up to {lookup_k})"
                if topk > 1:
                    label += f" (topk {topk})"
                rows.append(f"| {label} | {switch} | {kind} | {b} | "
                            f"{rec['config']['plain_out_tok_s']} | "
                            f"{rec['config']['spec_out_tok_s']} | {rec['value']} | {acc:.2f} | "
                            f"{rec['mean_accepted_len']} | {mean_k:.2f} | {steps} / {off} | "
                            f"{rec.get('speedup_bound', '-')} | "
                            f"{rec['config']['identical_to_plain']} |")
                print(rows[-1], flush=True)
                diff = rec["config"]["first_difference"]
                if diff is not None:  # on the console and in the records, not in the table
                    print(f"  not identical: {diff}", flush=True)
                save()
        del llm
        gc.collect()  # the next engine sizes its KV cache from free memory
        torch.cuda.empty_cache() if device == "cuda" else None
    save()
    print(header + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
