"""The recipe: which stages of the workflow run on which model, with what settings. Read from
YAML and validated by pydantic; an error names the offending key and its line in the file.

    name: smollm2-small
    model: null                # default model; a path, GGUF file, hub id or benchmark shape
    stages:
      finetune: {steps: 20}
      quantize: {methods: [rtn-int8, gptq-int4-g128]}
      eval: {context: 512, limit: 4}

A stage left out of `stages` does not run; `enabled: false` keeps its settings but skips it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from llmaccel.errors import LLMAccelError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RecipeError(LLMAccelError):
    """A recipe that cannot run: bad YAML, an unknown key, a value out of range."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True


class AnalyzeStage(_Section):
    gpu: Optional[str] = None            # a datasheet GPU for the roofline (analyze --gpu)
    context: int = Field(0, ge=0)        # KV-cache reads of this many tokens in the roofline


class FinetuneStage(_Section):
    """LoRA through peft (`llmaccel finetune`); later stages use the merged model."""
    data: Optional[str] = None           # None: the recipe's `data`
    lora_r: int = Field(8, ge=1)
    lora_alpha: float = 16.0
    lr: float = Field(1e-4, gt=0)
    steps: int = Field(200, ge=1)
    batch_size: int = Field(4, ge=1)
    seq_len: int = Field(256, ge=2)
    eval_every: int = Field(25, ge=1)
    max_blocks: Optional[int] = Field(None, ge=2)
    seed: int = 0


class QuantizeStage(_Section):
    """One checkpoint per scheme of docs/workloads.md (rtn-int8, gptq-int4-g128, ..., fp8)."""
    methods: list[str] = Field(default_factory=lambda: ["rtn-int8", "rtn-int4-g128",
                                                        "gptq-int4-g128", "awq-int4-g128",
                                                        "fp8"])
    data: Optional[str] = None           # GPTQ/AWQ calibration text; None: the recipe's
    n_samples: int = Field(128, ge=1)    # calibration sequences (GPTQ, AWQ)
    seq_len: int = Field(512, ge=2)      # tokens per calibration sequence

    @field_validator("methods")
    @classmethod
    def _known(cls, methods: list[str]) -> list[str]:
        from llmaccel.quant.schemes import SCHEMES

        for m in methods:
            if m not in SCHEMES:
                raise ValueError(f"unknown scheme {m!r} (known: {', '.join(SCHEMES)})")
        if len(set(methods)) != len(methods):
            raise ValueError("a scheme is listed twice")
        return methods


class EvalStage(_Section):
    """Test-split perplexity of every model variant (W6's method)."""
    data: Optional[str] = None           # None: the recipe's `data`
    context: int = Field(2048, ge=2)
    stride: Optional[int] = Field(None, ge=1)
    limit: Optional[int] = Field(None, ge=1)  # at most this many windows (small runs)


# What each workload runs: W3 in process here (`llmaccel bench serve --backend openai` measures
# servers).
WORKLOAD_BACKENDS = {"latency": ("llmaccel", "hf-eager", "hf-static-compile"),
                     "throughput": ("llmaccel", "hf-cb"), "serve": ("llmaccel",)}


class BenchStage(_Section):
    """`llmaccel bench` W1 (latency), W2 (throughput) and W3 (serve: Poisson arrivals) on
    every model variant: our engine, and HF transformers as the baseline on the unquantized
    ones (it does not run our quantized checkpoints' kernels)."""
    workloads: list[Literal["latency", "throughput", "serve"]] = Field(
        default_factory=lambda: ["latency", "throughput", "serve"])
    backends: list[Literal["llmaccel", "hf-eager", "hf-static-compile", "hf-cb"]] = Field(
        default_factory=lambda: ["llmaccel", "hf-eager", "hf-cb"])
    quick: bool = False                  # bench's --quick sizes instead of docs/workloads.md's
    repeats: int = Field(3, ge=1)
    request_rates: list[float] = Field(default_factory=lambda: [1.0, 4.0, 16.0, 64.0])  # W3
    num_prompts: Optional[int] = Field(None, ge=1)  # W3 requests per load point (None: 200)
    # Which variants (base, finetuned, a scheme) also run the HF baselines, and which run W3:
    # a fine-tuned copy runs at the base model's speed, and W3 at 1 req/s takes minutes a
    # variant, so a GPU-sized recipe picks where they are worth their time. None: all.
    baseline_variants: Optional[list[str]] = Field(default_factory=lambda: ["base"])
    serve_variants: Optional[list[str]] = None

    @field_validator("request_rates")
    @classmethod
    def _rates(cls, rates: list[float]) -> list[float]:
        if not rates or any(r <= 0 for r in rates):
            raise ValueError("request rates are positive numbers of requests per second")
        return rates


class DraftStage(_Section):
    """Speculative decoding on the workflow's model (the fine-tuned one when fine-tuning
    runs): n-gram lookup, a draft model (`model`, same tokenizer) and a draft head trained
    here (`llmaccel distill-draft --kind head`), each measured against plain decoding (W5)."""
    methods: list[Literal["ngram", "model", "head"]] = Field(
        default_factory=lambda: ["ngram", "head"])
    model: Optional[str] = None          # the draft model of method "model"
    num_speculative_tokens: int = Field(4, ge=1)
    # vLLM's disable_by_batch_size, per method ({ngram: 64, model: 4}): at or above this many
    # requests the engine decodes plainly. A measured crossover for the target; unset, the
    # engine's automatic switch alone decides (it misses some crossovers).
    disable_by_batch_size: dict[Literal["ngram", "model", "head"], int] = Field(
        default_factory=dict)
    # the head's training: None (the recipe's `data`), a text file, a dataset, or self[:N]
    # (the target's own answers to N requests: what the head drafts for when serving;
    # distill-draft --data)
    data: Optional[str] = None
    steps: int = Field(200, ge=1)
    batch_size: int = Field(4, ge=1)
    seq_len: int = Field(256, ge=2)
    max_blocks: Optional[int] = Field(None, ge=2)
    max_seconds: Optional[float] = Field(None, gt=0)
    # Held-out KL every eval_every steps; training stops after `patience` without a new best.
    # Every 25 steps with patience 2, a SmolLM2 head stopped on noise at step ~500 (13% top-1);
    # every 250 with patience 4 it ran to its time limit at 33%.
    eval_every: int = Field(25, ge=1)
    patience: int = Field(2, ge=1)
    # the W5 measurement, on the workflow's model (the fine-tuned one when fine-tuning runs)
    # or on each variant named here (base, finetuned, a scheme: speculation on a quantized
    # target; the head trained on the workflow's model serves them all)
    variants: Optional[list[str]] = None
    batches: list[int] = Field(default_factory=lambda: [1, 4, 16, 64])
    kinds: list[Literal["code", "prose"]] = Field(default_factory=lambda: ["code", "prose"])
    max_tokens: int = Field(192, ge=1)
    repeats: int = Field(3, ge=1)

    @field_validator("methods")
    @classmethod
    def _distinct(cls, methods: list[str]) -> list[str]:
        if len(set(methods)) != len(methods):
            raise ValueError("a method is listed twice")
        return methods

    @field_validator("batches")
    @classmethod
    def _batches(cls, batches: list[int]) -> list[int]:
        if not batches or any(b < 1 for b in batches):
            raise ValueError("batch sizes are integers >= 1")
        return batches

    @field_validator("disable_by_batch_size")
    @classmethod
    def _limits(cls, limits: dict[str, int]) -> dict[str, int]:
        bad = {m: n for m, n in limits.items() if n < 1}
        if bad:
            raise ValueError(f"batch sizes are integers >= 1, got {bad}")
        return limits

    @model_validator(mode="after")
    def _draft_model(self) -> DraftStage:
        if "model" in self.methods and not self.model:
            raise ValueError("method 'model' needs `model:` (the draft model's path or id)")
        return self


class ReportStage(_Section):
    """report.md: the method x engine table (throughput, perplexity, memory), fine-tuning and
    quantization facts, then `llmaccel report`'s tables and plots of every measurement."""
    title: Optional[str] = None


class Stages(BaseModel):
    model_config = ConfigDict(extra="forbid")
    analyze: Optional[AnalyzeStage] = None
    finetune: Optional[FinetuneStage] = None
    quantize: Optional[QuantizeStage] = None
    eval: Optional[EvalStage] = None
    bench: Optional[BenchStage] = None
    draft: Optional[DraftStage] = None
    report: Optional[ReportStage] = None

    def variants(self) -> list[str]:
        """The model variants eval and bench run on: base, finetuned, one per scheme."""
        on = [k for k in ("finetune", "quantize") if getattr(self, k) is not None
              and getattr(self, k).enabled]
        return (["base"] + (["finetuned"] if "finetune" in on else [])
                + (list(self.quantize.methods) if "quantize" in on else []))

    @model_validator(mode="after")
    def _variant_lists(self) -> Stages:
        known = self.variants()
        for section, key in (("bench", "baseline_variants"), ("bench", "serve_variants"),
                             ("draft", "variants")):
            stage = getattr(self, section)
            bad = [v for v in (getattr(stage, key) or [] if stage is not None else [])
                   if v not in known]
            if bad:
                raise ValueError(f"{section}.{key}: {', '.join(map(repr, bad))} is not a "
                                 f"variant of this recipe (variants: {', '.join(known)})")
        return self


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "default"
    model: Optional[str] = None          # None: the default model (SmolLM2-135M-Instruct)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # The text every stage reads unless it names its own: wikitext2 (found locally or
    # downloaded once), a text file, a WikiText-2 directory or a Hugging Face dataset id.
    data: str = "wikitext2"
    stages: Stages = Field(default_factory=Stages)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not NAME.match(name):
            raise ValueError("letters, digits, '.', '_' and '-' only (it names a directory)")
        return name

    def device_arg(self) -> str | None:
        return None if self.device == "auto" else self.device

    def with_data(self, data: str) -> Recipe:
        """This recipe reading `data` in every stage (`llmaccel run --data`); a draft head
        trained on the model's own answers (`self`) keeps them."""
        stages = self.stages.model_copy(update={
            name: stage.model_copy(update={"data": None})
            for name in ("finetune", "quantize", "eval", "draft")
            if (stage := getattr(self.stages, name)) is not None
            and not (name == "draft" and str(stage.data or "").startswith("self"))})
        return self.model_copy(update={"data": data, "stages": stages})


def parse_recipe(text: str, where: str = "<recipe>") -> Recipe:
    """The recipe in YAML `text`; RecipeError naming the key and line of the first problem."""
    import yaml

    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{where}:{line}: not valid YAML ({getattr(e, 'problem', e)})") \
            from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a mapping of keys (name, model, stages, ...), "
                          f"not a {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        msg = _message(err)
        # A check across sections names its key first ("bench.serve_variants: ..."): point
        # at that key's line, not the section holding both.
        m = re.match(r"([a-z_]+(?:\.[a-z_]+)+): ", msg)
        if m:
            loc, msg = loc + tuple(m.group(1).split(".")), msg[m.end():]
        key = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(root, loc)
        at = f" line {line}" if line else ""
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise RecipeError(f"{where}:{at}: {key}: {msg}{more}") from None


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file {p} not found")
    return parse_recipe(p.read_text(), str(p))


def _message(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown key"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def _line_of(node: Any, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at `loc` (the deepest one that exists)."""
    import yaml

    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                return line
            key, node = match
            line = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def default_recipe(size: Literal["small", "full"] = "small") -> Recipe:
    """The built-in recipe (`llmaccel run` with no file) on the default model. small: sizes a
    CPU gets through in minutes; full: docs/workloads.md's sizes, for a GPU."""
    if size == "small":
        stages = Stages(
            analyze=AnalyzeStage(),
            finetune=FinetuneStage(steps=12, batch_size=2, seq_len=128, eval_every=6,
                                   max_blocks=64),
            quantize=QuantizeStage(methods=["rtn-int8", "rtn-int4-g128", "gptq-int4-g128",
                                            "awq-int4-g128", "fp8"],
                                   n_samples=8, seq_len=128),
            eval=EvalStage(context=512, limit=8),
            bench=BenchStage(workloads=["latency", "throughput"], quick=True, repeats=1,
                             backends=["llmaccel", "hf-eager"]),
            draft=DraftStage(methods=["ngram", "head"], steps=20, batch_size=2, seq_len=128,
                             max_blocks=64, batches=[1], max_tokens=48, repeats=1),
            report=ReportStage())
        return Recipe(name="default-small", stages=stages)
    # full: W1, W2 and W6 on every variant; the HF baseline (W1, eager) on the model as given
    # (a LoRA merge runs at its speed) and W3 (1 req/s alone is 200 s) there too; a head
    # trained for up to 150 s on the model's own answers to 1024 requests (WikiText-2's
    # validation split alone stopped a SmolLM2 head at 13% top-1 agreement). About 22
    # minutes of stage time on an H100. HF's continuous batching
    # (hf-cb) is left out: one W2 run of SmolLM2 took 2.5 min on an H100, and a measurement
    # is four runs (warm-up and three repeats); add it to a recipe's bench.backends for W2.
    return Recipe(name="default", stages=Stages(
        analyze=AnalyzeStage(), finetune=FinetuneStage(), quantize=QuantizeStage(),
        eval=EvalStage(), bench=BenchStage(backends=["llmaccel", "hf-eager"],
                                           serve_variants=["base"]),
        draft=DraftStage(data="self", steps=3000, batch_size=8, seq_len=512,
                         eval_every=250, patience=4, max_seconds=150),
        report=ReportStage()))
