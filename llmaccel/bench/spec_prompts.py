"""W5's prompts: input-grounded requests (rewrite a given function; quote or summarize a given
paragraph), where speculation has something to find. Shared by `llmaccel bench spec` and
benchmarks/spec_bench.py so both measure the same requests."""

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''
PROSE = ("Speculative decoding lets a small model propose several tokens that a large model "
         "then checks in a single forward pass. Because decoding is limited by reading the "
         "weights from memory rather than by arithmetic, checking several tokens costs about "
         "as much as producing one, so every accepted proposal is nearly free. The method keeps "
         "the large model's output distribution exactly, which makes it attractive for "
         "serving: users get the same answers, only sooner. Its benefit shrinks as batches "
         "grow, because large batches are limited by arithmetic, not by memory.")
PROMPTS = {
    "code": [f"Rewrite this function with type hints, keeping the logic:\n\n{CODE}\n",
             (f"Add a docstring example to this function and return it unchanged "
              f"otherwise:\n\n{CODE}\n")],
    "prose": [f"Quote the following paragraph, then summarize it in one sentence:\n\n{PROSE}\n",
              f"Repeat this text word for word:\n\n{PROSE}\n"],
}
