"""Side-by-side throughput of our stages and plain TRL / plain `generate`, same shapes, one process.

    python scripts/bench.py --size tiny                 # CPU, a few minutes
    python scripts/bench.py --size micro                # seconds: the reduced form CI runs
    python scripts/bench.py --size 0.5b --json bench.json   # GPU: random-init Qwen2.5-0.5B shape, no download
    python scripts/bench.py --size 0.5b --sections ppo --set seq=128 batch=2 updates=1   # that shape, small, on CPU

Sections (`--sections rollout,static,sft,dpo,ppo`, the default):
  rollout  tokens/s of `sampling.generate` (prompts grouped by length, one big batch) against plain
           `model.generate` called per small batch (how TRL's GRPO samples: per-device batch of 8; on the
           first `plain_prompts` prompts only, as its rate hardly depends on how many batches it runs);
           then with a LoRA adapter, run in the forward pass or merged for sampling (`merge_lora`);
  static   `cache: static` (compiled decoding on a GPU) beside the dynamic cache; on CPU only with
           `--static-cache`, where nothing is compiled;
  sft      tokens/s of the `sft` stage's TRL config against `trl.SFTConfig()` defaults (on CPU the
           defaults need bf16 off to run at all, which is the only change made to them), and ours with
           TRL's padding-free packing (`packing: true, packing_strategy: bfd`) on the same rows of varied length;
  dpo      pairs/s of the `dpo` stage with LoRA against `trl.DPOConfig()` defaults with LoRA;
  ppo      episodes/s of the `ppo` stage with LoRA (policy, reference and critic on one base; a verifier
           as the reward, so no reward model), prompts of half the sequence length as in `dpo`. TRL 1.16
           has no PPO to compare with; on a GPU the table adds its peak memory over `dpo`'s (the
           goal: at most 1.5x).
  vllm     (not in the default list: needs vLLM, e.g. the environment of scripts/vllm_env.sh) tokens/s of
           `backend: vllm` (an engine in this process, the policy's weights pushed before each call, 8 samples
           re-scored by the policy after it), our HF sampler and plain `model.generate` (the whole batch in one
           call, left-padded), on the same prompts, for each BATCHxNEW_TOKENS of `--vllm-shapes`; then the
           engine's start-up and the time of one weight push, eager and compiled (`vllm.enforce_eager`).
           `--model PATH` runs it on a real checkpoint (its chat template, prompts asking for stories).
Each result records peak memory (GPU: torch.cuda.max_memory_allocated over the section; CPU: the
process's peak resident set so far, so compare CPU sections run one per process: `--sections ppo`)
and, on a GPU, MFU against `--peak-tflops` (790 bf16 TFLOP/s measured on an H200).
Models are random-init with the character tokenizer; sequences are synthetic text of fixed length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    "micro": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab=None,
                  prompts=8, new_tokens=8, seq=32, batch=4, steps=2, pairs=8, updates=1, plain_prompts=8),  # the CI smoke test
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab=None,
                 prompts=64, new_tokens=32, seq=128, batch=16, steps=8, pairs=64, updates=4, plain_prompts=64),
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab=151936,
                 prompts=256, new_tokens=256, seq=1024, batch=8, steps=20, pairs=160, updates=4, plain_prompts=32),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960, vocab=151936,
                 prompts=256, new_tokens=256, seq=1024, batch=8, steps=20, pairs=160, updates=4, plain_prompts=32),
}


def build_model(size: dict, folder: Path) -> Path:
    """A random-init Qwen2 of the given shape with our character tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from alignment.models.tiny import build_tokenizer
    from alignment.models.loading import default_dtype

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=size["vocab"] or len(tokenizer), hidden_size=size["hidden_size"],
        num_hidden_layers=size["num_layers"], num_attention_heads=size["num_heads"],
        num_key_value_heads=size["num_kv_heads"], intermediate_size=size["intermediate_size"],
        max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(default_dtype()).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("abcdefghij0123456789 +=?") for _ in range(length))


class Peak:
    """Peak memory in MiB over a block (GPU allocator peak, else the process's resident set)."""

    def __enter__(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import resource

        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.mib = torch.cuda.max_memory_allocated() / 2**20
        else:  # Linux reports the peak resident set in KiB; it never goes down, hence one section per process
            self.mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        self.seconds = time.perf_counter() - self.start


def mfu(tokens_per_s: float, params: int, peak_tflops: float, training: bool) -> float | None:
    """Model FLOPs utilisation: 6N FLOPs per trained token (2N forward + 4N backward), 2N per sampled one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tokens_per_s * (6 if training else 2) * params / (peak_tflops * 1e12)


def rollout_setup(model_dir: Path, size: dict):
    """The policy on the device, `prompts` rendered prompts of 8-48 characters, our sampling settings."""
    import torch

    from alignment.config.sampling import SamplingSpec
    from alignment.data.formatting import render_prompt
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer

    tokenizer, model = load_tokenizer(str(model_dir)), load_policy(str(model_dir))
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)
    prompts = [render_prompt(tokenizer, text(rng, rng.randint(8, 48))) for _ in range(size["prompts"])]
    spec = SamplingSpec(max_new_tokens=size["new_tokens"], temperature=1.0, batch_size=size["prompts"])
    return tokenizer, model, prompts, spec


def timed_generate(section, variant, model, tokenizer, prompts, spec, args) -> dict:
    from alignment.sampling import generate

    with Peak() as peak:
        samples = generate(model, tokenizer, prompts, spec)
    tokens = sum(len(s.token_ids) for s in samples)
    return row(section, variant, tokens / peak.seconds, "tokens/s", peak, model, args, False)


def warm_up(model, tokenizer, prompts, spec) -> None:
    """The first generate call of a process pays one-off costs (kernels, allocator), whoever makes it."""
    from alignment.sampling import generate

    generate(model, tokenizer, prompts[:8], spec.model_copy(update={"max_new_tokens": min(8, spec.max_new_tokens)}))


def bench_rollout(model_dir: Path, size: dict, args) -> list[dict]:
    tokenizer, model, prompts, spec = rollout_setup(model_dir, size)
    warm_up(model, tokenizer, prompts, spec)
    results = [timed_generate("rollout", "ours: sampling.generate", model, tokenizer, prompts, spec, args)]
    # Plain decoding is bound by per-step overhead, so its rate hardly depends on how many batches of 8 it
    # runs: on a GPU a subset (`plain_prompts`) keeps this row to a minute instead of ten.
    with Peak() as peak:
        tokens = 0
        for start in range(0, size["plain_prompts"], 8):  # what TRL GRPO does per device step
            batch = tokenizer(prompts[start : start + 8], return_tensors="pt", padding=True,
                              padding_side="left").to(model.device)
            out = model.generate(**batch, max_new_tokens=size["new_tokens"], do_sample=True,
                                 pad_token_id=tokenizer.pad_token_id)
            generated = out[:, batch["input_ids"].shape[1]:]
            tokens += int((generated != tokenizer.pad_token_id).sum())
    results.append(row("rollout", "plain: model.generate, batch 8", tokens / peak.seconds, "tokens/s", peak, model, args, False))
    return results + bench_lora_rollout(model, tokenizer, prompts, spec, args)


def bench_static(model_dir: Path, size: dict, args) -> list[dict]:
    """`cache: static` (compiled decoding on a GPU) beside the default dynamic cache, in its own section:
    compiling takes long, and a time limit on it should not cost the other rollout rows."""
    tokenizer, model, prompts, spec = rollout_setup(model_dir, size)
    warm_up(model, tokenizer, prompts, spec)
    static = spec.model_copy(update={"cache": "static"})
    timed_generate("static", "compile", model, tokenizer, prompts, static, args)  # the first call compiles (GPU)
    return [timed_generate("static", "ours: sampling.generate", model, tokenizer, prompts, spec, args),
            timed_generate("static", "ours: static cache (compiled on GPU)", model, tokenizer, prompts, static, args)]


def bench_lora_rollout(model, tokenizer, prompts, spec, args) -> list[dict]:
    """The policy as PPO samples it with LoRA (r=16 on every linear layer): adapter run in the forward
    pass, against `merge_lora: true` (adapter folded into the base weights while sampling)."""
    import torch

    from alignment.config.model import LoraSpec
    from alignment.models.lora import apply_lora

    model = apply_lora(model, LoraSpec(r=16, lora_alpha=32))  # last: wraps the model's layers in place
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)  # a trained-looking adapter (peft starts B at zero)
    unmerged = spec.model_copy(update={"merge_lora": False})
    warm_up(model, tokenizer, prompts, unmerged)
    return [timed_generate("rollout", "ours: LoRA adapter unmerged", model, tokenizer, prompts, unmerged, args),
            timed_generate("rollout", "ours: LoRA merged for sampling", model, tokenizer, prompts, spec, args)]


STORY_TOPICS = ["a lighthouse", "a lost key", "two rivers", "a clockmaker", "the first snow", "a red kite",
                "an old map", "a quiet robot"]


def vllm_prompts(tokenizer, count: int, real_model: bool) -> list[str]:
    """Rendered prompts: on a real model, requests for stories (answers that run to max_new_tokens), else text."""
    from alignment.data.formatting import render_prompt

    rng = random.Random(0)
    if real_model:
        return [render_prompt(tokenizer, f"Write a story about {STORY_TOPICS[i % 8]}, number {i}.") for i in range(count)]
    return [render_prompt(tokenizer, text(rng, rng.randint(8, 48))) for _ in range(count)]


def bench_vllm(model_dir: Path, size: dict, args) -> list[dict]:
    """`backend: vllm` beside our HF sampler and plain `generate`, temperature 1, same prompts and lengths."""
    import torch

    from alignment.config.sampling import SamplingSpec
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.sampling import generate, vllm_engine

    tokenizer, model = load_tokenizer(str(model_dir)), load_policy(str(model_dir))
    engine = {"kv_cache_gib": args.vllm_kv_gib, "max_model_len": args.vllm_max_len}
    results = []

    def add(result: dict) -> None:  # printed as it comes: a long run cut short keeps what it measured
        results.append(result)
        print(json.dumps(result), flush=True)

    for eager in (True, False):
        settings = {"enforce_eager": eager, **engine}
        label = "eager" if eager else "compiled"
        spec = SamplingSpec(max_new_tokens=8, backend="vllm", vllm=settings)
        vllm_engine.close()
        with Peak() as start:
            started = vllm_engine._engine_for(model, spec.vllm, "bench")
        add(row("vllm", f"vLLM engine start-up ({label})", start.seconds, "s", start, model, args, False))
        pushes = []
        for _ in range(3):
            with Peak() as push:
                vllm_engine.push_weights(started, model)
            pushes.append(push.seconds)
        add(row("vllm", f"vLLM weight push ({label}, best of 3)", min(pushes), "s", push, model, args, False))
        shapes = args.vllm_shapes if eager else args.vllm_shapes[:1]  # compiled: the first shape, beside eager's
        for batch, new_tokens in shapes:
            prompts = vllm_prompts(tokenizer, batch, args.model is not None)
            shape = f"batch {batch} x {new_tokens} new tokens"
            spec = SamplingSpec(max_new_tokens=new_tokens, temperature=1.0, batch_size=batch, backend="vllm", vllm=settings)
            generate(model, tokenizer, prompts[:8], spec.model_copy(update={"max_new_tokens": 4}))  # warm-up
            add(timed_generate("vllm", f"vLLM {label}, {shape}", model, tokenizer, prompts, spec, args))
            if not eager:
                continue
            hf = spec.model_copy(update={"backend": "transformers"})
            warm_up(model, tokenizer, prompts, hf)
            add(timed_generate("vllm", f"ours: HF sampler, {shape}", model, tokenizer, prompts, hf, args))
            with Peak() as peak, torch.no_grad():
                batch_ids = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
                out = model.generate(**batch_ids, max_new_tokens=new_tokens, do_sample=True,
                                     pad_token_id=tokenizer.pad_token_id)
                tokens = int((out[:, batch_ids["input_ids"].shape[1]:] != tokenizer.pad_token_id).sum())
            add(row("vllm", f"plain: model.generate, {shape}", tokens / peak.seconds, "tokens/s", peak,
                               model, args, False))
    vllm_engine.close()
    return results


def row(section, variant, rate, unit, peak, model, args, training) -> dict:
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    util = mfu(rate, params, args.peak_tflops, training) if unit == "tokens/s" else None
    return {"section": section, "variant": variant, "rate": round(rate, 2), "unit": unit,
            "peak_mib": round(peak.mib, 1), "seconds": round(peak.seconds, 2), "mfu": util}


def sft_rows(size: dict, n: int) -> list[dict]:
    """Rows of varied length (an eighth to all of `seq`), as chat data has, so padding costs something."""
    rng = random.Random(1)
    half = size["seq"] // 2 - 4
    lengths = [rng.randint(max(1, half // 8), half) for _ in range(n)]
    return [{"prompt": text(rng, k), "completion": text(rng, k)} for k in lengths]


def bench_sft(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our sft stage's trainer settings vs TRL's defaults, identical data and batch."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from alignment.data.formatting import render_pair
    from alignment.models.loading import is_cuda, load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import sft

    tokenizer = load_tokenizer(str(model_dir))
    n = size["batch"] * size["steps"]
    data = datasets.Dataset.from_list([render_pair(tokenizer, r) for r in sft_rows(size, n)])
    common = dict(per_device_train_batch_size=size["batch"], max_steps=size["steps"], max_length=size["seq"],
                  report_to="none", save_strategy="no", logging_steps=size["steps"], seed=0)
    recipe_path = work / "sft.yaml"
    recipe_path.write_text(json.dumps({"name": "bench", "model": str(model_dir), "output_dir": str(work / "out"),
                                       "stages": {"sft": {"data": {"task": "arithmetic"}, "train": common}}}))
    ours = sft.trl_config(make_context(load_recipe(recipe_path), "sft"))
    plain = SFTConfig(output_dir=str(work / "plain"), **common, **({} if is_cuda() else {"bf16": False, "use_cpu": True}))
    # Packed rows hold several examples each: the same number of examples takes fewer steps.
    packed = dataclasses.replace(ours, packing=True, packing_strategy="bfd")
    results = []
    for variant, config in (("ours: sft stage defaults", ours), ("plain: trl.SFTConfig defaults", plain),
                            ("ours: packed, padding-free (opt-in)", packed)):
        model = load_policy(str(model_dir))
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        with Peak() as peak:
            trainer.train()
        # Tokens trained on in max_steps batches (packed rows are fewer and longer), padding excluded.
        rows = trainer.train_dataset["input_ids"]
        tokens = sum(len(x) for x in rows) * size["steps"] * size["batch"] / len(rows)
        results.append(row("sft", variant, tokens / peak.seconds, "tokens/s", peak, model, args, True))
        del trainer, model
    return results


def bench_dpo(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our dpo stage's settings (LoRA) vs TRL's DPOConfig defaults with the same LoRA."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from alignment.data.formatting import render_completion, render_prompt
    from alignment.config.model import LoraSpec
    from alignment.models.loading import is_cuda, load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.models.lora import peft_config
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import dpo

    tokenizer = load_tokenizer(str(model_dir))
    rng, half = random.Random(2), size["seq"] // 2 - 4
    rows = []
    for _ in range(size["pairs"]):
        prompt = text(rng, half)
        rows.append({"prompt": render_prompt(tokenizer, prompt),
                     "chosen": render_completion(tokenizer, prompt, text(rng, half)),
                     "rejected": render_completion(tokenizer, prompt, text(rng, half))})
    data = datasets.Dataset.from_list(rows)
    common = dict(per_device_train_batch_size=size["batch"], num_train_epochs=1, max_length=size["seq"],
                  report_to="none", save_strategy="no", logging_steps=1000, seed=0)
    recipe_path = work / "dpo.yaml"
    recipe_path.write_text(json.dumps({"name": "bench", "model": str(model_dir), "output_dir": str(work / "out"),
                                       "lora": {"r": 16, "lora_alpha": 32},
                                       "stages": {"dpo": {"data": {"task": "arithmetic"}, "train": common}}}))
    ours = dpo.trl_config(make_context(load_recipe(recipe_path), "dpo"))
    plain = DPOConfig(output_dir=str(work / "plain-dpo"), **common, **({} if is_cuda() else {"bf16": False, "use_cpu": True}))
    results = []
    for variant, config in (("ours: dpo stage defaults, LoRA", ours), ("plain: trl.DPOConfig defaults, LoRA", plain)):
        model = load_policy(str(model_dir))
        trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                             peft_config=peft_config(LoraSpec(r=16, lora_alpha=32)))
        with Peak() as peak:
            trainer.train()
        results.append(row("dpo", variant, len(rows) / peak.seconds, "pairs/s", peak, model, args, True))
        del trainer, model
    return results


BREVITY = "def brevity(completion):\n    return -len(completion) / 64.0\n"


def bench_ppo(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our ppo stage with LoRA for `updates` updates: rollout, scoring, reference and critic passes,
    `ppo_epochs` of minibatch steps. Reward: a verifier (shorter is better), so the memory is the
    policy/reference/critic trio alone, comparable with DPO-LoRA's policy/reference pair."""
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    rng, half = random.Random(3), size["seq"] // 2 - 4
    prompts = work / "ppo-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text(rng, half)}) + "\n" for _ in range(size["pairs"])))
    (work / "bench_rewards.py").write_text(BREVITY)
    batch = size["batch"]
    stage = {"kind": "ppo", "policy": str(model_dir), "data": {"dataset": str(prompts)},
             "verifiers": [{"name": "bench_rewards:brevity"}],
             "rollout": {"batch_size": 2 * batch, "max_new_tokens": min(size["new_tokens"], size["seq"] - half)},
             "train": {"total_updates": size["updates"], "mini_batch_size": batch, "ppo_epochs": 1,
                       "learning_rate": 1.0e-5, "save_every": 10_000}}
    recipe_path = work / "ppo.yaml"
    recipe_path.write_text(json.dumps({"name": "bench", "model": str(model_dir), "output_dir": str(work / "out-ppo"),
                                       "lora": {"r": 16, "lora_alpha": 32}, "stages": {"ppo": stage}}))
    recipe = load_recipe(recipe_path)
    with Peak() as peak:
        run_recipe(recipe)
    episodes = 2 * batch * size["updates"]
    return [row("ppo", "ours: ppo stage, LoRA (policy + reference + critic on one base)", episodes / peak.seconds,
                "episodes/s", peak, None, args, True)]


def memory_ratio(results: list[dict]) -> dict | None:
    """PPO's peak GPU memory over DPO-LoRA's (ours), when both ran on a GPU in this process."""
    import torch

    peaks = {r["section"]: r["peak_mib"] for r in results if r["variant"].startswith("ours") and
             r["section"] in ("ppo", "dpo")}
    if not torch.cuda.is_available() or len(peaks) < 2:
        return None
    return {"section": "ppo", "variant": "ours: peak memory / dpo-LoRA peak memory", "rate": round(peaks["ppo"] /
            peaks["dpo"], 2), "unit": "x", "peak_mib": peaks["ppo"], "seconds": 0.0, "mfu": None}


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("section", "variant", "rate", "unit", "peak MiB", "seconds", "MFU")
    for r in results:
        table.add_row(r["section"], r["variant"], f"{r['rate']:.1f}", r["unit"], f"{r['peak_mib']:.0f}",
                      f"{r['seconds']:.1f}", f"{r['mfu']:.1%}" if r["mfu"] is not None else "-")
    Console().print(table)


def shapes_arg(value: str) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(n)) for b, n in (item.split("x") for item in value.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected BATCHxNEW_TOKENS[,...], e.g. 64x32,256x128") from None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--sections", default="rollout,static,sft,dpo,ppo")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="accelerator peak for MFU (bf16)")
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=N",
                        help="override size settings, e.g. --set seq=128 batch=2 (a 0.5b shape on CPU)")
    parser.add_argument("--model", help="a local checkpoint instead of a random-init shape (vllm section)")
    parser.add_argument("--vllm-shapes", default="64x32,64x128,256x32,256x128", type=shapes_arg,
                        help="BATCHxNEW_TOKENS,... of the vllm section")
    parser.add_argument("--vllm-kv-gib", type=float, default=2.0, help="the vLLM engine's KV cache (GiB)")
    parser.add_argument("--vllm-max-len", type=int, default=512, help="the vLLM engine's max_model_len")
    parser.add_argument("--static-cache", action="store_true",
                        help="run the `static` section on CPU too (on a GPU it always runs)")
    args = parser.parse_args(argv)
    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    for setting in args.set:
        key, _, value = setting.partition("=")
        if key not in size or not value.isdigit():
            parser.error(f"--set {setting}: expected KEY=N with KEY one of {', '.join(size)}")
        size[key] = int(value)
    sections = args.sections.split(",")
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = Path(args.model) if args.model else build_model(size, work / "model")
        results = []
        if "rollout" in sections:
            results += bench_rollout(model_dir, size, args)
        if "static" in sections and (args.static_cache or torch.cuda.is_available()):
            results += bench_static(model_dir, size, args)
        if "sft" in sections:
            results += bench_sft(model_dir, size, args, work)
        if "dpo" in sections:
            results += bench_dpo(model_dir, size, args, work)
        if "ppo" in sections:
            results += bench_ppo(model_dir, size, args, work)
        if "vllm" in sections:
            results += bench_vllm(model_dir, size, args)
    if ratio := memory_ratio(results):
        results.append(ratio)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
