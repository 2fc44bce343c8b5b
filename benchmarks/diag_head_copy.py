"""Diagnostic (issue 7): where does a draft head miss on W5's prompts, and would a prompt lookup
have been right there? The target answers W5's first code and prose prompts greedily (HF, on
any device); the head then drafts from every answer position on the target's features
(DraftHead.unroll, as the engine drafts), and each position is scored: the head's draft at
steps 1-4 (right given the earlier ones were) and whether an n-gram prompt lookup (the last
`--lookup-min` tokens matched earlier in the context, as vLLM's ngram proposer) proposes the
right next token there.

    python benchmarks/diag_head_copy.py --target GGUF --heads DIR[,DIR] [--device cpu]

Prints, per prompt and head: the answer's length, top-1 at steps 1-4, the tokens per round at
k = 4 they imply, and step 1's top-1 split by whether the lookup was right ("copy positions"),
then steps 1-4 split the same way (each step's lookup over the context and the drafts before
it, which were right), and at those copy positions the attention weight on the lookup's
source per step.
"""

from __future__ import annotations

import argparse
import json

import torch

from llmaccel.train.head_metrics import attention_weights, lookup_proposals


def simulate_rounds(right: list[list[bool | None]], start: int, n: int, k: int = 4
                    ) -> float:
    """Tokens per round of greedy speculation at k drafts, round by round as the engine runs
    it: the first round after the context x_0..x_{start+1} (row `start`), each next one at
    the row after what it accepted. `tokens_per_round_k4` scores every position alike; a
    round here starts only where the last one stopped, right after a rejected draft, which
    are harder positions. `right[j][t]`: draft j + 1 at row t was right."""
    t, tokens, rounds = start, 0, 0
    while t + 2 < n:
        accepted = 0
        while (accepted < k and t + accepted + 2 < n
               and right[accepted][t]):
            accepted += 1
        step = min(accepted + 1, n - 1 - (t + 1))  # the bonus token unless the answer ended
        tokens += step
        rounds += 1
        t += step
    return round(tokens / max(rounds, 1), 3)


def _source_attention(head, seq: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                      allowed: torch.Tensor, ts: list[int]) -> dict[str, list[float]]:
    """At the answer's copy positions of each draft step (head_metrics.unrolled_copy_rows over
    the unrolled pass whose layer rows, positions and mask are h, positions and allowed:
    DraftHead.unroll_with_inputs; the drafts before each step right): the attention weight
    on the lookup's source, mean over all the layer's heads and over the first two (the ones
    the copy loss teaches by default)."""
    from llmaccel.train.head_metrics import _scores_of, unrolled_copy_rows

    n = seq.shape[1] - 1
    steps = h.shape[1] // n
    with torch.no_grad():
        w = _scores_of(head, h, positions, allowed).softmax(-1)[0]  # [heads, rows, rows]
        copy, source = unrolled_copy_rows(seq, steps)
    on = w.gather(-1, source[0][None, :, None].expand(w.shape[0], -1, 1))[..., 0]
    every, taught = [], []
    for a in range(steps):
        rows = [a * n + t for t in ts if copy[0, a * n + t]]
        every.append(round(float(on[:, rows].mean()), 3) if rows else None)
        taught.append(round(float(on[:2, rows].mean()), 3) if rows else None)
    return {"attn_source_steps_all_heads": every, "attn_source_steps_first_two": taught}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--heads", required=True,
                    help="comma-separated head directories; 'fresh' (or 'fresh-random': "
                         "attention_init random) for an untrained head from the target")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--out", default=None, help="a JSON file for the numbers")
    ap.add_argument("--target-attention", action="store_true",
                    help="with --show-misses: also where the target's last layer looks at "
                         "each missed position (the layer the heads start from)")
    ap.add_argument("--show-misses", type=int, default=0,
                    help="print up to N copy positions (lookup right) where step 1 missed: "
                         "the context's last tokens, the right token and the head's")
    args = ap.parse_args()

    from llmaccel.bench.spec_prompts import PROMPTS
    from llmaccel.train.distill_common import DistillConfig, load_target
    from llmaccel.train.draft_head import build_draft_head, load_draft_head, target_features

    target, device = load_target(DistillConfig(target=args.target, out="-", kind="head",
                                               device=args.device))
    model, tok = target.model, target.tokenizer
    rows = []
    for kind in ("code", "prose"):
        prompt = PROMPTS[kind][0]
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
        seq = out[0].tolist()
        p = ids.shape[1]
        f = target_features(model, out)
        last_attn = None
        if args.target_attention:  # eager attention returns its weights
            model.set_attn_implementation("eager")
            with torch.no_grad():
                att = model(out, output_attentions=True).attentions[-1]
            last_attn = att[0].mean(0)  # [rows, rows], mean over the last layer's heads
            model.set_attn_implementation("sdpa")
        for head_dir in args.heads.split(","):
            if head_dir in ("fresh", "fresh-random"):  # untrained, as training starts one
                head = build_draft_head(model, target.config, attention_init="random"
                                        if head_dir == "fresh-random" else "target").eval()
            else:
                head = load_draft_head(head_dir, model).eval()
            with torch.no_grad():
                outs, h, positions, allowed = head.unroll_with_inputs(out, f[:, :-1], 4)
            n = len(seq)
            # row t drafts x_{t+2}.. after the context x_0..x_{t+1}; answer rows: t + 1 >= p - 1
            right = []
            for step, o in enumerate(outs, start=1):
                pred = head.compute_logits(o[0]).argmax(-1).tolist()
                right.append([pred[t] == seq[t + step + 1] if t + step + 1 < n else None
                              for t in range(n - 1)])
            ts = [t for t in range(p - 2, n - 2)]
            # the lookup at t + 1 (what followed the latest earlier match) against x_{t+2}
            props = lookup_proposals(seq, args.lookup_min)
            look = {t: props[t + 1] == seq[t + 2] for t in ts}
            # per step: its top-1 given the drafts before it were right, and that split by
            # whether the step's lookup is right: step s at row t drafts x_{t+s+1} after
            # drafts x_{t+2}..x_{t+s} that were right, so its lookup is the one at t + s
            cond = []
            split: dict[str, list[float]] = {"lookup_right": [], "elsewhere": []}
            for step in range(4):
                ok = [t for t in ts if all(right[j][t] for j in range(step))
                      and right[step][t] is not None]
                cond.append(sum(right[step][t] for t in ok) / max(len(ok), 1))
                hit = {t: props[t + step + 1] == seq[t + step + 2] for t in ok}
                for name, want in (("lookup_right", True), ("elsewhere", False)):
                    rows_s = [t for t in ok if hit[t] == want]
                    split[name].append(round(sum(right[step][t] for t in rows_s)
                                             / max(len(rows_s), 1), 3))
            tok_round, run = 1.0, 1.0
            for c in cond:
                run *= c
                tok_round += run
            sim = simulate_rounds(right, p - 1, n)
            copy = [t for t in ts if look[t]]
            other = [t for t in ts if not look[t]]
            attn = _source_attention(head, out, h, positions, allowed, ts)
            row = {"kind": kind, "head": head_dir, "answer_tokens": n - p, **attn,
                   "top1_steps": [round(c, 3) for c in cond],
                   "tokens_per_round_k4": round(tok_round, 3),
                   "tokens_per_round_k4_rounds": sim,
                   "lookup_right": round(len(copy) / max(len(ts), 1), 3),
                   "step1_at_lookup_right": round(sum(right[0][t] for t in copy)
                                                  / max(len(copy), 1), 3),
                   "step1_elsewhere": round(sum(right[0][t] for t in other)
                                            / max(len(other), 1), 3),
                   "top1_steps_at_lookup_right": split["lookup_right"],
                   "top1_steps_elsewhere": split["elsewhere"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.show_misses:
                pred1 = head.compute_logits(outs[0][0]).argmax(-1).tolist()
                misses = [t for t in copy if not right[0][t]][:args.show_misses]
                weights = attention_weights(head, out, f[:, :-1])[0]
                for t in misses:  # row t: context x_0..x_{t+1}, drafts x_{t+2}
                    print(f"  miss at answer token {t + 2 - p}: ...{tok.decode(seq[t - 6:t + 2])!r}"
                          f" -> want {tok.decode([seq[t + 2]])!r}, head {tok.decode([pred1[t]])!r}",
                          flush=True)
                    # where the layer looked: its top rows, each with its tokens (x_r, x_{r+1})
                    w = weights[t, :t + 1]
                    top = w.topk(min(5, t + 1))
                    print("    attends " + ", ".join(
                        f"row {r - t:+d} {tok.decode(seq[r:r + 2])!r} {v:.2f}"
                        for v, r in zip(top.values.tolist(), top.indices.tolist())), flush=True)
                    if last_attn is not None:  # the target at the same position (t + 1)
                        top = last_attn[t + 1, :t + 2].topk(min(5, t + 2))
                        print("    target's last layer attends " + ", ".join(
                            f"row {r - t - 1:+d} {tok.decode(seq[r:r + 1])!r} {v:.2f}"
                            for v, r in zip(top.values.tolist(), top.indices.tolist())),
                            flush=True)
        print(repr(tok.decode(seq[p:]))[:600], flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
