"""GPU-speed benchmarks: workloads W1/W2/W4 of docs/workloads.md run on our engine and on
HF transformers baselines, written as JSON-lines records plus a markdown summary.

- `workloads`: seeded random-token prompts for each workload.
- `hardware`: device name, copy bandwidth, weight bytes and roofline arithmetic.
- `engine_runs` / `hf_baselines`: one function per (backend, workload), each returning records.
- `results`: the record format, JSON-lines I/O and the markdown summary.
"""
